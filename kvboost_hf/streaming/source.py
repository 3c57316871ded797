"""Where streamed packed weights live between uses: host RAM, or a file mapped from disk.

Both hold torch's packed int4 layout (converted once). ``MmapSource`` writes the converted
tensors to one file the first time a checkpoint is loaded (keyed by the checkpoint files, torch
version and CPU ISA, since the packed layout is torch's own) and maps it afterwards: its pages
are file-backed, so the kernel can drop them and they never count as anonymous memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_ALIGN = 64
_FORMAT = 1


class HostSource:
    """Named packed tensors on the host.

    A CUDA device gets them through ``copy_into`` (a staging slot in device memory). A CPU computes
    on the host tensors in place after ``prepare``: copying RAM to RAM would be CPU work competing
    with compute for the same cores and memory bandwidth (measured: 1.26x the resident layer time
    on 2 cores, unthrottled), and gains nothing, since host memory *is* compute memory.
    """

    def __init__(self, throttle_bytes_per_s: float | None = None) -> None:
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self._tensors: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def nbytes(self, name: str) -> int:
        t = self._tensors[name]
        return t.numel() * t.element_size()

    def tensors(self) -> list[torch.Tensor]:
        """The packed tensors held (for memory placement, not for computing)."""
        return list(self._tensors.values())

    def total_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self._tensors)

    def copy_into(self, name: str, dst: torch.Tensor, non_blocking: bool = False) -> int:
        """Copy tensor ``name`` into ``dst``. Returns bytes moved.

        CPU to CPU goes through numpy: one single-threaded memcpy without the GIL. torch's
        ``copy_`` splits it over the intra-op pool, and on a busy machine waiting for that pool
        made a 2.7 MB copy take 8-30 ms instead of 0.3 ms (measured on 2 shared cores).
        """
        src = self._tensors[name]
        if dst.device.type == "cpu" and src.device.type == "cpu":
            np.copyto(dst.numpy(), src.numpy())
        else:
            dst.copy_(src, non_blocking=non_blocking)
        return self.nbytes(name)

    def prepare(self, name: str) -> int:
        """Make tensor ``name`` cheap to read in place (CPU compute reads it without a copy). Returns its bytes."""
        return self.nbytes(name)

    def throttle(self, nbytes: int, started: float) -> None:
        """Benchmarks: sleep until ``nbytes`` took ``nbytes / throttle_bytes_per_s`` since ``started``."""
        if self.throttle_bytes_per_s:
            remaining = nbytes / self.throttle_bytes_per_s - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)


class RamSource(HostSource):
    """Packed tensors kept in host memory (pinned when the compute device is CUDA)."""

    def __init__(self, pin: bool = False, throttle_bytes_per_s: float | None = None) -> None:
        super().__init__(throttle_bytes_per_s)
        self.pin = pin

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        self._tensors[name] = tensor.pin_memory() if self.pin else tensor


def cpu_isa() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        return "unknown"


def cache_key(checkpoint_files: Iterable[str], extra: dict) -> str:
    """Key of a converted file: checkpoint identity (path, size, mtime), torch version, CPU ISA, settings."""
    parts = []
    for path in sorted(checkpoint_files):
        st = os.stat(path)
        parts.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    description = {"files": parts, "torch": torch.__version__, "isa": cpu_isa(), "format": _FORMAT, **extra}
    return hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16).hexdigest()


class MmapSource(HostSource):
    """Packed tensors in one file under ``directory``, mapped read-only-by-convention (MAP_SHARED)."""

    def __init__(self, directory: Path, throttle_bytes_per_s: float | None = None) -> None:
        super().__init__(throttle_bytes_per_s)
        self.directory = Path(directory)
        self.data_path = self.directory / "int4pack.bin"
        self.index_path = self.directory / "index.json"
        self._offsets: dict[str, int] = {}
        self._fd: int | None = None

    def exists(self) -> bool:
        return self.index_path.exists() and self.data_path.exists()

    def write(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write ``(name, packed)`` pairs one at a time (bounded memory), then publish the index."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.data_path.with_suffix(f".tmp{os.getpid()}")
        index: dict[str, dict] = {}
        offset = 0
        with open(tmp, "wb") as f:
            for name, tensor in tensors:
                pad = -offset % _ALIGN
                f.write(b"\0" * pad)
                offset += pad
                data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                f.write(data)
                index[name] = {"offset": offset, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}
                offset += len(data)
        os.replace(tmp, self.data_path)
        index_tmp = self.index_path.with_suffix(f".tmp{os.getpid()}")
        index_tmp.write_text(json.dumps({"format": _FORMAT, "size": offset, "tensors": index}))
        os.replace(index_tmp, self.index_path)
        logger.info("wrote %d converted int4 tensors (%.1f MB) to %s", len(index), offset / 1e6, self.data_path)

    def open(self) -> None:
        """Map the file and create a view per tensor (no data is read here)."""
        meta = json.loads(self.index_path.read_text())
        size = meta["size"]
        mapped = torch.from_file(str(self.data_path), shared=True, size=max(size, 1), dtype=torch.uint8)
        for name, entry in meta["tensors"].items():
            dtype = getattr(torch, entry["dtype"].removeprefix("torch."))
            numel = 1
            for dim in entry["shape"]:
                numel *= dim
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            view = mapped.narrow(0, entry["offset"], nbytes).view(dtype).view(entry["shape"])
            self._tensors[name] = view
            self._offsets[name] = entry["offset"]
        self._fd = os.open(self.data_path, os.O_RDONLY)

    def prepare(self, name: str) -> int:
        """Ask the kernel to read the tensor's pages ahead (asynchronous readahead into the page cache).

        The compute thread then maps them with cheap minor faults instead of waiting on the disk.
        """
        nbytes = self.nbytes(name)
        if self._fd is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._offsets[name], nbytes, os.POSIX_FADV_WILLNEED)
        return nbytes

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
