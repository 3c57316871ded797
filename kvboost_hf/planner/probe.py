"""Machine probes for planning: memory limit, resident set, memory bandwidth and decode step time, each bounded
in time with a fallback."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from kvboost_hf.units import parse_size

logger = logging.getLogger(__name__)

FALLBACK_BANDWIDTH_GB_S = 10.0


def parse_bytes(text: str | int) -> int:
    """``"24GiB"``, ``"500MB"``, ``"1.5gb"`` or a plain number of bytes, as bytes (ValueError otherwise);
    :func:`kvboost_hf.units.parse_size` with bare numbers meaning bytes."""
    return parse_size(text, bare_unit="B")


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


def process_rss_bytes() -> int:
    """Resident memory of this process now (0 when /proc is unavailable)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


FALLBACK_DECODE_STEP_S = 0.5


def decode_step_seconds(model, max_seconds: float = 10.0) -> float:
    """One decode step of ``model`` (8-token prompt, then 1 token), timed; bounded by ``max_seconds``
    (a thread; past it, or on any error, a conservative default with a log line)."""
    import torch

    result: list[float] = []

    def probe() -> None:
        try:
            device = next(model.parameters()).device
            ids = torch.ones((1, 8), dtype=torch.long, device=device)
            with torch.no_grad():
                out = model(ids, use_cache=True, logits_to_keep=1)
                start = time.perf_counter()
                model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
            result.append(time.perf_counter() - start)
        except Exception as err:  # a probe must never stop the server from starting
            logger.warning("decode-step probe failed (%s: %s)", type(err).__name__, err)

    thread = threading.Thread(target=probe, name="kvboost-decode-probe", daemon=True)
    thread.start()
    thread.join(max_seconds)
    if not result:
        logger.warning("decode-step probe gave no figure within %.0f s; assuming %.1f s", max_seconds,
                       FALLBACK_DECODE_STEP_S)
        # An interpreter that exits while the probe is inside a torch op aborts ("terminate called
        # without an active exception"): let the probe finish first.
        import atexit

        atexit.register(thread.join)
        return FALLBACK_DECODE_STEP_S
    return result[0]
