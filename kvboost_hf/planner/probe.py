"""Machine probes for planning: memory limit and memory bandwidth, each bounded in time with a fallback."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
FALLBACK_BANDWIDTH_GB_S = 10.0


def parse_bytes(text: str | int) -> int:
    """``"24GiB"``, ``"500MB"``, ``"1.5gb"`` or a plain number of bytes, as bytes (ValueError otherwise)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 24GiB, 500MB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def memory_limit_bytes() -> int:
    """The memory this process may use: the cgroup limit when set, else the machine's total memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:
            return int(value)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        logger.warning("could not read the memory size; assuming 8 GiB (pass --memory)")
        return 8 * 2**30


def memory_bandwidth_gb_s(megabytes: int = 256, max_seconds: float = 2.0) -> float:
    """Read bandwidth of this machine (sum over a buffer larger than the caches), at most ``max_seconds``."""
    try:
        import torch

        buffer = torch.ones(megabytes * 2**20 // 4)
        buffer.sum()  # touch every page once
        best, deadline = 0.0, time.perf_counter() + max_seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            buffer.sum()
            best = max(best, buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
        return best or FALLBACK_BANDWIDTH_GB_S
    except (RuntimeError, MemoryError) as err:
        logger.warning("bandwidth probe failed (%s); assuming %.0f GB/s (pass --bandwidth)", err,
                       FALLBACK_BANDWIDTH_GB_S)
        return FALLBACK_BANDWIDTH_GB_S
