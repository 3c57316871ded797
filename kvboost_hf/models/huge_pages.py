"""Weights held in transparent huge pages (Linux), in place.

A decode step reads every weight once, as a stream. On 4 KiB pages that stream takes a TLB miss every
4 KiB, and in a virtual machine each miss walks two page tables: on the 2-vCPU Xeon VM this was
measured on, Gemma-3-270M's 335 MB bf16 LM head read in 18.4 ms on 4 KiB pages and in 11.9 ms on
2 MiB ones, and a weight left unread for a second took 150 ms to read again against 33 ms (the host
reclaims idle guest pages in 4 KiB units). So the memory of a model's tensors is asked to be backed
by huge pages with ``madvise(MADV_COLLAPSE)`` (Linux 6.1+), which remaps the pages already there:
no tensor moves, no storage is copied, views and ties stay shared, and no value changes.

One kind of memory cannot be collapsed in place: a private mapping of a file, which is where
transformers leaves the weights of a checkpoint loaded in its stored dtype (safetensors mapped
copy-on-write). Those storages are copied once into anonymous memory on huge pages, and every tensor
found on them is pointed at the copy (``Tensor.set_``: the same tensor objects, Parameters and ties,
other data pointers). A shared mapping (``host="mmap"`` streaming reads its file on purpose) is left
alone.

Where the kernel cannot (another OS, an older kernel, THP switched off, no free huge page), nothing
changes and the report says why; ``KVBOOST_HF_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import errno
import logging
import os
import sys
import time
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_COVER = 0.5  # a frame is collapsed only if tensors fill at least this much of it (bounds the memory it adds)
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_ENV = "KVBOOST_HF_HUGE_PAGES"


@dataclasses.dataclass(frozen=True)
class HugePageReport:
    """What :func:`back_with_huge_pages` did: ``frames`` 2 MiB frames the tensors fill enough of,
    ``collapsed`` of them now huge pages, covering ``bytes`` bytes of tensor memory (``moved_bytes`` of
    them copied out of private file mappings first); ``reason`` says why none could be (``None`` when
    some were, or when there was nothing to do)."""

    frames: int = 0
    collapsed: int = 0
    bytes: int = 0
    moved_bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None


def merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ``spans`` (start, length) merged where they overlap or touch: (start, length), in address order."""
    out: list[list[int]] = []
    for start, length in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length)
        else:
            out.append([start, start + length])
    return [(lo, hi - lo) for lo, hi in out]


def huge_pages_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVBOOST_HF_HUGE_PAGES`` in ``environ`` (default: this process's) leaves huge pages on (all but
    ``0``): the one switch for the weights' huge pages and ``kvboost-hf serve``'s heap on them."""
    return (os.environ if environ is None else environ).get(_ENV, "1") != "0"


def huge_page_frames(spans: Iterable[tuple[int, int]], min_cover: float = MIN_COVER) -> list[int]:
    """The 2 MiB-aligned frame addresses that the byte ``spans`` (start, length; overlaps counted once) fill to
    at least ``min_cover`` of a frame, in address order."""
    return _filled(_frame_cover(spans), min_cover)


def _frame_cover(spans: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Per 2 MiB frame the byte ``spans`` touch (overlaps counted once), how many of its bytes they hold."""
    cover: dict[int, int] = {}
    for start, length in merged(spans):
        end = start + length
        frame = start - start % HUGE_PAGE
        while frame < end:
            cover[frame] = cover.get(frame, 0) + min(end, frame + HUGE_PAGE) - max(start, frame)
            frame += HUGE_PAGE
    return cover


def _filled(cover: dict[int, int], min_cover: float) -> list[int]:
    return sorted(f for f, n in cover.items() if n >= min_cover * HUGE_PAGE)


def module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor ``module``'s tree holds: parameters, buffers, and tensors in its modules' attributes
    (also inside lists, tuples, dicts and dataclasses), such as packed kernel weights."""
    def visit(value, depth: int = 0):
        if isinstance(value, torch.Tensor):
            yield value
        elif depth >= 3:
            return
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from visit(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                yield from visit(item, depth + 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                yield from visit(getattr(value, field.name, None), depth + 1)

    for sub in module.modules():
        for value in vars(sub).values():
            yield from visit(value)


def back_with_huge_pages(tensors: nn.Module | Iterable[torch.Tensor], min_cover: float = MIN_COVER, *,
                         exclude: nn.Module | None = None) -> HugePageReport:
    """Ask Linux to back the host memory of ``tensors`` (or of every tensor a module holds,
    :func:`module_tensors`) with transparent huge pages.

    Anonymous memory is collapsed in place (no value, pointer or sharing changes); memory in a private file
    mapping is copied to anonymous memory first (module docstring); a shared file mapping is left alone.
    Storages shared by several tensors count once; CUDA, pinned, meta, non-strided and storage-less tensors
    are left alone, and so are the storages of module ``exclude`` (a draft's weights shared with its target).
    Returns what was done; never raises for a host that cannot do it."""
    start = time.perf_counter()
    if isinstance(tensors, nn.Module):
        tensors = module_tensors(tensors)
    if not huge_pages_allowed():
        return HugePageReport(reason=f"{_ENV}=0")
    if not sys.platform.startswith("linux"):
        return HugePageReport(reason=f"transparent huge pages are Linux only ({sys.platform})")
    storages = _storages(tensors)
    if exclude is not None:
        for address in _storages(module_tensors(exclude)):
            storages.pop(address, None)
    madvise = _madvise()
    if madvise is None:
        return HugePageReport(reason="madvise is not available from libc")
    moved = 0
    private, shared = _in_file_mappings(storages)
    for address in shared:  # read from its file on purpose (host="mmap" streaming): not ours to move
        storages.pop(address)
    for interval in merged((a, storages[a][0]) for a in private):
        members = {a: storages.pop(a) for a in private if interval[0] <= a < interval[0] + interval[1]}
        copy = _anonymous_copy(interval, members, madvise)
        if copy is None:  # left where it is (its frames cannot be collapsed there; counted as not collapsed)
            storages.update(members)
        else:
            storages[copy] = (interval[1], [])
            moved += interval[1]
    cover = _frame_cover((address, nbytes) for address, (nbytes, _) in storages.items())
    frames = _filled(cover, min_cover)
    if not frames:
        return HugePageReport(moved_bytes=moved)
    collapsed, last_error = [], 0
    for frame in frames:
        madvise(frame, HUGE_PAGE, _MADV_HUGEPAGE)  # lets the frame stay huge if a later fault splits it
        if madvise(frame, HUGE_PAGE, _MADV_COLLAPSE) == 0:
            collapsed.append(frame)
        else:
            last_error = ctypes.get_errno()
    report = HugePageReport(len(frames), len(collapsed), sum(cover[f] for f in collapsed), moved,
                            time.perf_counter() - start, None if collapsed else _why(last_error))
    logger.info("huge pages: %d of %d frames (%.1f MB of tensors, %.1f MB copied out of file mappings) in %.2f s%s",
                report.collapsed, report.frames, report.bytes / 1e6, report.moved_bytes / 1e6, report.seconds,
                f" ({report.reason})" if report.reason else "")
    return report


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[int, list[torch.Tensor]]]:
    """Host storages by address: (bytes, the tensors on it). Two storages at one address (views of one buffer
    made apart) count as the larger."""
    out: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for tensor in tensors:
        try:
            if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_pinned():
                continue
            storage = tensor.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (opaque, some subclasses)
            continue
        if nbytes and address:
            size, views = out.get(address, (0, []))
            if not any(v is tensor for v in views):  # a tied Parameter is found once per module holding it
                views.append(tensor)
            out[address] = (max(size, nbytes), views)
    return out


def _in_file_mappings(storages: dict) -> tuple[list[int], list[int]]:
    """The storage addresses that lie in private (copy-on-write) and in shared mappings of a file (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return [], []
    files = []  # (start, end, private), in address order
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            files.append((lo, hi, parts[1][3] == "p"))
    starts = [lo for lo, _, _ in files]
    private, shared = [], []
    for address in storages:
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < files[i][1]:
            (private if files[i][2] else shared).append(address)
    return private, shared


def _anonymous_copy(interval: tuple[int, int], members: dict, madvise) -> int | None:
    """Copy the bytes of ``interval`` (start, length), which ``members`` (address -> (bytes, tensors)) fill, into
    fresh anonymous memory asked for huge pages, and point every member tensor at the copy; the copy's address, or
    None (nothing changed) where a tensor cannot be pointed there (an inference tensor outside inference mode, an
    offset that is not a whole number of its elements)."""
    lo, nbytes = interval
    views = [(address - lo, v) for address, (_, vs) in members.items() for v in vs]
    if any((shift % v.element_size()) or v.is_inference() and not torch.is_inference_mode_enabled()
           for shift, v in views):
        return None
    frames = nbytes >= HUGE_PAGE // 2
    rounded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE if frames else nbytes  # the last frame inside the buffer too
    buffer = torch.empty(rounded + (HUGE_PAGE if frames else 0), dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE if frames else 0  # a multiple of 64: of every element size
    if frames:
        madvise(buffer.data_ptr() + offset, rounded, _MADV_HUGEPAGE)  # faulted in as huge pages
    for address, (_, vs) in members.items():  # the largest of the storages at an address holds the others' bytes
        source = torch.empty(0, dtype=torch.uint8).set_(max((v.untyped_storage() for v in vs), key=len))
        start = offset + address - lo
        buffer[start:start + source.numel()].copy_(source)
    with torch.no_grad():
        for shift, view in views:
            view.set_(buffer.untyped_storage(), view.storage_offset() + (offset + shift) // view.element_size(),
                      view.size(), view.stride())
    return buffer.data_ptr() + offset


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _why(code: int) -> str:
    if code == errno.EINVAL:
        return ("this memory cannot be collapsed (file-backed, a frame crossing a mapping's edge, THP 'never', "
                "or a kernel older than 6.1 without MADV_COLLAPSE)")
    if code in (errno.ENOMEM, errno.EAGAIN, errno.EBUSY):
        return f"no free huge pages now ({errno.errorcode.get(code, code)})"
    return f"madvise failed ({errno.errorcode.get(code, code)})"
