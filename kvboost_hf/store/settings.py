"""StoreSettings: what a ChunkStore is configured with, validated once with errors that name the setting."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvboost_hf.store.quant import SUPPORTED_BITS
from kvboost_hf.store.remote_guard import redact

REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")


def _positive_int(name: str, value, allow_none: bool = False) -> int | None:
    """``value`` as a positive int (integral floats such as ``2e9`` accepted); ValueError otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass
class StoreSettings:
    """Settings of a :class:`~.store.ChunkStore` (``ValueError`` naming the setting when one is wrong).

    max_bytes: RAM budget, counting tensors, scales, token ids and bookkeeping; never exceeded.
    chunk_size: tokens per chunk.
    kv_bits: ``None`` stores the model's own dtype (lossless); 8 or 4 store KIVI-quantized
        K/V (keys per channel, values per token in groups of ``group_size`` channels).
    group_size: channel group for value quantization; must divide the model's head_dim
        (default: the largest of 128/64/32/16/8 that does).
    sink_tokens: the first ``sink_tokens`` tokens of every sequence stay full precision.
    read_only: serve lookups but store nothing new (e.g. a curated, pre-warmed document set);
        with a disk tier, nothing in the directory is written, touched or deleted, so it
        may live on read-only media. The flag can be flipped at any time.
    remote / remote_prefix: a Redis URL (``redis://[[user]:password@]host:port/db``,
        ``rediss://`` for TLS) for a tier shared across replicas: lookups go RAM, disk, then
        Redis; new chunks are written there in the background (TTL ``remote_ttl_s``); hits
        are verified and promoted to RAM. Redis being down or slow (``remote_timeout_s``)
        costs speed, never a failed request. Needs ``pip install 'kvboost_hf[redis]'``.
    disk_path / max_disk_bytes: a persistent tier; every stored chunk is also written there
        (checksummed safetensors), RAM misses are served from it, and another process
        pointed at the same directory reuses its entries. Stores of different ``kv_bits``
        may share a directory: a lookup never returns an entry less precise than the
        store's own setting (a lossless store only lossless entries; int8 lossless or int8).
    recency_half_life: store operations after which an unused RAM entry's worth halves.
    """

    max_bytes: int = 2_000_000_000
    chunk_size: int = 128
    kv_bits: int | None = None
    group_size: int | None = None
    sink_tokens: int = 0
    disk_path: str | os.PathLike | None = None
    max_disk_bytes: int | None = None
    recency_half_life: int = 256
    read_only: bool = False
    remote: str | None = None
    remote_prefix: str = "kvboost"
    remote_ttl_s: int = 7 * 24 * 3600
    remote_timeout_s: float = 0.25

    def __post_init__(self) -> None:
        self.max_bytes = _positive_int("max_bytes", self.max_bytes)
        self.chunk_size = _positive_int("chunk_size", self.chunk_size)
        self.group_size = _positive_int("group_size", self.group_size, allow_none=True)
        self.max_disk_bytes = _positive_int("max_disk_bytes", self.max_disk_bytes, allow_none=True)
        self.recency_half_life = _positive_int("recency_half_life", self.recency_half_life)
        self.remote_ttl_s = _positive_int("remote_ttl_s", self.remote_ttl_s)
        if self.kv_bits is not None and self.kv_bits not in SUPPORTED_BITS:
            raise ValueError(f"kv_bits must be None, 8 or 4, got {self.kv_bits!r}")
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be a non-negative int, got {self.sink_tokens!r}")
        if self.max_disk_bytes is not None and self.disk_path is None:
            raise ValueError("max_disk_bytes needs disk_path")
        if self.remote is not None and (not isinstance(self.remote, str) or not self.remote.startswith(REMOTE_SCHEMES)):
            shown = redact(self.remote) if isinstance(self.remote, str) else self.remote
            raise ValueError(f"remote must be a Redis URL ({', '.join(REMOTE_SCHEMES)}...), got {shown!r}")
        if not isinstance(self.remote_prefix, str) or not self.remote_prefix:
            raise ValueError(f"remote_prefix must be a non-empty string, got {self.remote_prefix!r}")
        timeout = self.remote_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"remote_timeout_s must be a positive number of seconds, got {timeout!r}")
        self.read_only = bool(self.read_only)
