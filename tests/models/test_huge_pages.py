"""Weights on transparent huge pages, in place: frames chosen, values and pointers unchanged, the kernel asked."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch
from torch import nn

from kvboost_hf.kernels.layout import pack_dense
from kvboost_hf.models.huge_pages import HUGE_PAGE, back_with_huge_pages, huge_page_frames, module_tensors

MB = 1 << 20


def anon_huge_bytes(address: int, length: int = 1) -> int:
    """AnonHugePages of the mappings overlapping ``length`` bytes from ``address`` (/proc/self/smaps), in bytes."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo < address + length and address < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def private_floats(count: int, pages_past_frame: int) -> tuple[torch.Tensor, mmap.mmap]:
    """``count`` random float32 values on a private anonymous mapping of their own, starting ``pages_past_frame``
    4 KiB pages after a 2 MiB boundary, with the mapping it lives on (keep it alive). No other allocation shares
    its frames. A frame the collapse makes huge that also holds a neighbour's memory is split again when that
    neighbour is freed (a partial unmap: freeing a 5 MiB tensor beside a collapsed 24 MiB one took it from 12 huge
    frames to 11, /proc/vmstat thp_split_pmd +1), the likely cause of CI's 11 collapsed and 9 huge of a heap tensor."""
    mapping = mmap.mmap(-1, count * 4 + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -base % HUGE_PAGE + pages_past_frame * 4096
    values = torch.frombuffer(mapping, dtype=torch.float32, count=count, offset=offset)
    values.copy_(torch.randn(count))
    return values, mapping


def test_frames_are_those_the_spans_fill_enough_of():
    base = 10 * HUGE_PAGE
    assert huge_page_frames([]) == []
    assert huge_page_frames([(base, HUGE_PAGE)]) == [base]  # exactly one frame
    assert huge_page_frames([(base + 1, HUGE_PAGE)]) == [base]  # all but a byte of it; one byte of the next
    assert huge_page_frames([(base + HUGE_PAGE // 2 + 1, HUGE_PAGE // 2 - 1)]) == []  # under half a frame
    two = [(base + 100, HUGE_PAGE // 2), (base + HUGE_PAGE // 2 + 200, HUGE_PAGE // 4)]  # a frame filled by two
    assert huge_page_frames(two) == [base]
    assert huge_page_frames(two, min_cover=0.8) == []
    span = [(base + 3 * HUGE_PAGE // 4, 3 * HUGE_PAGE)]  # a quarter, three whole frames, three quarters
    assert huge_page_frames(span) == [base + HUGE_PAGE, base + 2 * HUGE_PAGE, base + 3 * HUGE_PAGE]


def test_a_tensor_is_collapsed_in_place_or_told_why():
    weight, mapping = private_floats(24 * MB // 4, pages_past_frame=300)  # its own frames; 1.17 MiB past a frame
    before, address = weight.clone(), weight.data_ptr()
    report = back_with_huge_pages([weight, weight[10:], weight.view(-1, 4)])  # one storage, three views
    huge = anon_huge_bytes(address, weight.nbytes)  # read first: nothing else happens between the collapse and this
    assert weight.data_ptr() == address and torch.equal(weight, before)
    assert report.frames == 12  # 11 whole frames and the last, 1.17 MiB filled (the first, 0.83 MiB, is too little)
    if report.reason is None:
        assert report.collapsed > 0
        assert report.bytes >= report.collapsed * HUGE_PAGE // 2
        assert huge >= report.collapsed * HUGE_PAGE
    else:
        assert report.collapsed == 0 and report.bytes == 0
    # Asked again: the frames made huge stay huge (a frame whose collapse failed the first time, as MADV_COLLAPSE may
    # when the kernel finds no free huge page at that moment, may succeed now: seen once in a fresh-clone run, 11
    # then 12), and nothing moves or changes.
    again = back_with_huge_pages([weight])
    assert again.collapsed >= report.collapsed and again.frames == report.frames
    assert weight.data_ptr() == address and torch.equal(weight, before)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVBOOST_HF_HUGE_PAGES", "0")
    report = back_with_huge_pages([torch.randn(8 * MB // 4)])
    assert (report.frames, report.collapsed, report.reason) == (0, 0, "KVBOOST_HF_HUGE_PAGES=0")


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(512, 1024)
        self.register_buffer("table", torch.randn(4 * MB // 4))
        self.packed = {"codes": torch.zeros(6 * MB, dtype=torch.uint8)}  # a kernel's packed weights
        self.blocks = pack_dense(torch.randn(64, 32))  # a dataclass of them
        self.pieces = [torch.ones(2 * MB // 4), (torch.ones(3),)]


def test_module_tensors_finds_what_a_module_holds_and_exclude_leaves_it_alone():
    holder = Holder()
    found = {t.data_ptr() for t in module_tensors(holder)}
    wanted = [holder.linear.weight, holder.linear.bias, holder.table, holder.packed["codes"], holder.pieces[0],
              holder.pieces[1][0], holder.blocks.weight]
    assert {t.data_ptr() for t in wanted} <= found
    assert back_with_huge_pages(holder, exclude=holder).frames == 0
    other = Holder()
    other.table = holder.table  # shared with ``holder``: left alone, the rest counted
    shared_alone = back_with_huge_pages([holder.table])
    assert back_with_huge_pages(other, exclude=holder).frames == (
        back_with_huge_pages(other).frames - shared_alone.frames)


def test_cuda_pinned_and_meta_tensors_are_left_alone():
    meta = torch.empty(64 * MB, dtype=torch.uint8, device="meta")
    assert back_with_huge_pages([meta]).frames == 0
    if torch.cuda.is_available():
        assert back_with_huge_pages([torch.empty(8 * MB, dtype=torch.uint8).pin_memory()]).frames == 0


@pytest.mark.parametrize("threshold", [0.25, 1.0])
def test_min_cover_decides_the_edge_frames(threshold):
    weight = torch.randn(5 * MB // 4)
    start, end = weight.data_ptr(), weight.data_ptr() + 5 * MB
    expected = huge_page_frames([(start, end - start)], threshold)
    assert back_with_huge_pages([weight], min_cover=threshold).frames == len(expected)


def mapping_of(address: int) -> str:
    """The /proc/self/maps name of the mapping holding ``address`` (a file's path; '' or [heap] for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5].strip() if len(parts) == 6 else ""
    raise AssertionError(f"{address:#x} is not mapped")


def test_a_private_file_mapping_is_copied_to_anonymous_memory_keeping_ties_and_views(tmp_path):
    path = tmp_path / "weights.bin"
    values = torch.randn(6 * MB // 4)
    values.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=values.numel(), dtype=torch.float32)  # copy-on-write
    assert mapping_of(mapped.data_ptr()) == str(path)
    holder = nn.Module()
    holder.embed = nn.Embedding(values.numel() // 64, 64)
    holder.embed.weight = nn.Parameter(mapped.view(-1, 64))
    holder.head = nn.Linear(64, values.numel() // 64, bias=False)
    holder.head.weight = holder.embed.weight  # tied: one Parameter
    holder.packed = {"rows": holder.embed.weight.detach()[100:200]}  # a view another module keeps
    report = back_with_huge_pages(holder)
    weight = holder.embed.weight
    # read first: the kernel may split a huge page again at any time (reclaim, DAMON), and once, under the full
    # suite's memory use, smaps read after the checks below showed none of the 3 the collapse had reported
    huge = anon_huge_bytes(weight.data_ptr())
    if report.reason is None:
        assert huge >= report.collapsed * HUGE_PAGE
    assert report.moved_bytes == 6 * MB and not mapping_of(weight.data_ptr()).startswith("/")  # anonymous, [heap]
    assert isinstance(weight, nn.Parameter) and weight.requires_grad and holder.head.weight is weight
    assert torch.equal(weight.view(-1), values) and torch.equal(holder.packed["rows"], values.view(-1, 64)[100:200])
    assert holder.packed["rows"].data_ptr() == weight.data_ptr() + 100 * 64 * 4  # still a view of it
    assert weight.data_ptr() % HUGE_PAGE == 0
    shared = torch.from_file(str(path), shared=True, size=values.numel(), dtype=torch.float32)
    before = shared.data_ptr()
    assert back_with_huge_pages([shared]).moved_bytes == 0 and shared.data_ptr() == before  # read from its file


def test_views_made_apart_on_one_private_mapping_move_together(tmp_path):
    """Storages at one address with other sizes, and overlapping ones: one copy, every byte, still shared."""
    import numpy as np

    values = torch.randn(5 * MB // 4)
    mapped = []
    for name in ("a.bin", "b.bin"):
        values.numpy().tofile(tmp_path / name)
        mapped.append(np.memmap(tmp_path / name, dtype=np.float32, mode="c"))  # private: copy-on-write
    small, big = torch.from_numpy(mapped[0][: MB // 4]), torch.from_numpy(mapped[0][: 4 * MB // 4])  # one address
    first, shifted = torch.from_numpy(mapped[1][: 3 * MB // 4]), torch.from_numpy(mapped[1][1024:])  # overlapping
    report = back_with_huge_pages([small, big, first, shifted])
    assert report.moved_bytes == 4 * MB + 5 * MB
    assert torch.equal(big, values[: 4 * MB // 4]) and torch.equal(small, values[: MB // 4])
    assert torch.equal(first, values[: 3 * MB // 4]) and torch.equal(shifted, values[1024:])
    assert not mapping_of(big.data_ptr()).startswith("/") and not mapping_of(shifted.data_ptr()).startswith("/")
    big[2000] = 7.0  # still one memory each: a write through one is seen through the other
    first[2000] = 8.0
    assert small[2000] == 7.0 and shifted[2000 - 1024] == 8.0


def test_shared_file_mappings_and_opaque_tensors_are_left_alone(tmp_path, monkeypatch):
    import kvboost_hf.models.huge_pages as huge_pages

    path = tmp_path / "weights.bin"
    torch.randn(6 * MB // 4).numpy().tofile(path)
    shared = torch.from_file(str(path), shared=True, size=6 * MB // 4, dtype=torch.float32)
    calls = []
    real = huge_pages._madvise()
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *a: calls.append(a) or real(*a))
    before = shared.data_ptr()
    report = back_with_huge_pages([shared, torch.randn(64, 64).to_mkldnn()])  # an opaque tensor: no storage
    assert (report.frames, report.moved_bytes, calls, shared.data_ptr()) == (0, 0, [], before)
