"""Streaming counters: prefetch hits, late arrivals, misses, bytes moved, time compute waited."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields, replace


@dataclass
class StreamingStats:
    """Counters of one streamed model since load (or the last :func:`reset_streaming_stats`).

    Each time a streamed decoder layer starts its forward it needs its weights in a staging
    slot: a *hit* finds them loaded, a *late* arrival finds them in flight and waits, a *miss*
    finds them not requested and loads them synchronously. ``blocked_ms`` is the time compute
    waited (late + miss). ``bytes_moved`` counts bytes made ready: host -> slot copies on CUDA,
    prepared in place (an mmap'd file's readahead) on a CPU.
    """

    residency_mode: str = "full_resident"
    host: str = "ram"
    n_staging_slots: int = 0
    prefetch: bool = True
    streamed_layers: int = 0
    resident_int4_bytes: int = 0
    streamed_int4_bytes: int = 0
    staging_bytes: int = 0
    huge_page_bytes: int = 0
    head_tile_bytes: int = 0
    hits: int = 0
    late: int = 0
    misses: int = 0
    loads: int = 0
    bytes_moved: int = 0
    blocked_ms: float = 0.0
    load_ms: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def acquisitions(self) -> int:
        return self.hits + self.late + self.misses

    @property
    def hit_rate(self) -> float:
        """Fraction of streamed-layer forwards whose weights were already loaded (1.0 when none ran)."""
        return self.hits / self.acquisitions if self.acquisitions else 1.0

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> StreamingStats:
        with self._lock:
            return replace(self, _lock=threading.Lock())

    def __getstate__(self) -> dict:  # a copy (deepcopy, pickle) gets its own lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            for name in ("hits", "late", "misses", "loads", "bytes_moved"):
                setattr(self, name, 0)
            self.blocked_ms = 0.0
            self.load_ms = 0.0

    def to_dict(self) -> dict:
        snap = self.snapshot()
        out = {f.name: getattr(snap, f.name) for f in fields(snap) if not f.name.startswith("_")}
        out["hit_rate"] = snap.hit_rate
        return out
