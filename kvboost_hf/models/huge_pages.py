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

import ctypes
import dataclasses
import errno
import logging
import os
import sys
import time
from typing import Iterable, Iterator

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


def huge_page_frames(spans: Iterable[tuple[int, int]], min_cover: float = MIN_COVER) -> list[int]:
    """The 2 MiB-aligned frame addresses that the byte ``spans`` (start, length; not overlapping) fill to at
    least ``min_cover`` of a frame, in address order."""
    cover: dict[int, int] = {}
    for start, length in spans:
        end = start + length
        frame = start - start % HUGE_PAGE
        while frame < end:
            cover[frame] = cover.get(frame, 0) + min(end, frame + HUGE_PAGE) - max(start, frame)
            frame += HUGE_PAGE
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
    :func:`module_tensors`) with transparent huge pages, in place.

    Storages shared by several tensors count once; CUDA, pinned, meta and storage-less tensors are left
    alone, and so are the storages of module ``exclude`` (a draft's weights shared with its target). Values,
    pointers and sharing do not change. Returns what was done; never raises for a host that cannot do it."""
    start = time.perf_counter()
    if isinstance(tensors, nn.Module):
        tensors = module_tensors(tensors)
    if os.environ.get(_ENV, "1") == "0":
        return HugePageReport(reason=f"{_ENV}=0")
    if not sys.platform.startswith("linux"):
        return HugePageReport(reason=f"transparent huge pages are Linux only ({sys.platform})")
    storages = _storages(tensors)
    if exclude is not None:
        for address in _storages(module_tensors(exclude)):
            storages.pop(address, None)
    madvise = _madvise()
    moved = 0
    if madvise is not None:
        for address in _in_private_file_mappings(storages):
            nbytes, views = storages.pop(address)
            copy = _anonymous_copy(nbytes, views, madvise)
            if copy is not None:
                storages[copy] = (nbytes, views)
                moved += nbytes
    spans = {address: nbytes for address, (nbytes, _) in storages.items()}
    frames = huge_page_frames(spans.items(), min_cover)
    if not frames:
        return HugePageReport()
    if madvise is None:
        return HugePageReport(frames=len(frames), reason="madvise is not available from libc")
    collapsed, last_error = [], 0
    for frame in frames:
        madvise(frame, HUGE_PAGE, _MADV_HUGEPAGE)  # lets the frame stay huge if a later fault splits it
        if madvise(frame, HUGE_PAGE, _MADV_COLLAPSE) == 0:
            collapsed.append(frame)
        else:
            last_error = ctypes.get_errno()
    covered = _covered_bytes(spans.items(), collapsed)
    report = HugePageReport(len(frames), len(collapsed), covered, moved, time.perf_counter() - start,
                            None if collapsed else _why(last_error))
    logger.info("huge pages: %d of %d frames (%.1f MB of tensors, %.1f MB copied out of file mappings) in %.2f s%s",
                report.collapsed, report.frames, report.bytes / 1e6, report.moved_bytes / 1e6, report.seconds,
                f" ({report.reason})" if report.reason else "")
    return report


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[int, list[torch.Tensor]]]:
    """Host storages by address: (bytes, the tensors on it)."""
    out: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.is_sparse or tensor.is_pinned():
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. some subclasses)
            continue
        if storage.nbytes() and storage.data_ptr():
            views = out.setdefault(storage.data_ptr(), (storage.nbytes(), []))[1]
            if not any(v is tensor for v in views):  # a tied Parameter is found once per module holding it
                views.append(tensor)
    return out


def _in_private_file_mappings(storages: dict) -> list[int]:
    """The storage addresses that lie in a private (copy-on-write) mapping of a file (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    files = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[1][3] == "p" and parts[5].startswith("/"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            files.append((lo, hi))
    return [a for a, (n, _) in storages.items() if any(lo <= a and a + n <= hi for lo, hi in files)]


def _anonymous_copy(nbytes: int, views: list[torch.Tensor], madvise) -> int | None:
    """Copy a storage into fresh anonymous memory asked for huge pages and point ``views`` at it; its address, or
    None where a view cannot be changed (an inference tensor outside inference mode)."""
    if any(v.is_inference() for v in views) and not torch.is_inference_mode_enabled():
        return None
    pad = HUGE_PAGE if nbytes >= HUGE_PAGE // 2 else 0  # room to start on a frame
    buffer = torch.empty(nbytes + pad, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE if pad else 0  # a multiple of 64: of every element size
    copy = buffer[offset:offset + nbytes]
    if pad:
        madvise(copy.data_ptr(), nbytes - nbytes % HUGE_PAGE, _MADV_HUGEPAGE)  # faulted in as huge pages
    copy.copy_(torch.empty(0, dtype=torch.uint8).set_(views[0].untyped_storage()))
    with torch.no_grad():
        for view in views:
            view.set_(buffer.untyped_storage(), view.storage_offset() + offset // view.element_size(), view.size(),
                      view.stride())
    return copy.data_ptr()


def _covered_bytes(spans: Iterable[tuple[int, int]], frames: list[int]) -> int:
    done = set(frames)
    total = 0
    for start, length in spans:
        end = start + length
        frame = start - start % HUGE_PAGE
        while frame < end:
            if frame in done:
                total += min(end, frame + HUGE_PAGE) - max(start, frame)
            frame += HUGE_PAGE
    return total


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
        return "the kernel cannot collapse this memory (MADV_COLLAPSE needs Linux 6.1+ and THP not 'never')"
    if code in (errno.ENOMEM, errno.EAGAIN, errno.EBUSY):
        return f"no free huge pages now ({errno.errorcode.get(code, code)})"
    return f"madvise failed ({errno.errorcode.get(code, code)})"
