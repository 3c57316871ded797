"""ChunkStore: cross-request storage of prompt K/V, content addressed, under a byte budget."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .codec import ENTRY_OVERHEAD_BYTES, StoredChunk, encode_chunk, from_tensors, to_tensors
from .disk import DiskTier
from .keys import Key, chunk_key, chunk_spans
from .quant import SUPPORTED_BITS, default_group_size

logger = logging.getLogger(__name__)

__all__ = ["ENTRY_OVERHEAD_BYTES", "ChunkHit", "ChunkStore", "StoredChunk"]

LayerStates = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Per-layer keys and values of one chunk, each ``[num_kv_heads, num_tokens, head_dim]``."""


@dataclass(frozen=True)
class ChunkHit:
    """``num_tokens`` leading tokens of ``chunk`` reused at prompt position ``start``."""

    chunk: StoredChunk
    start: int
    num_tokens: int

    @property
    def exact_tokens(self) -> int:
        return self.chunk.exact_tokens(self.num_tokens)


@dataclass
class _IndexEntry:
    """A known chunk in any tier: enough to walk chains and match tokens without its tensors."""

    parent: Key
    token_ids: tuple[int, ...]


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class ChunkStore:
    """Content-addressed K/V chunks shared across requests, bounded by ``max_bytes``.

    Chunks form prefix chains: chunk ``i`` of a sequence is keyed by the key of chunk ``i-1``
    and its own tokens, so a hit is only returned for the exact same preceding tokens under the
    same model namespace. The last chunk of a sequence may be partial; lookups match a partial
    overlap with any stored chunk at token granularity.

    Settings:
        max_bytes: RAM budget, counting tensors, scales, token ids and bookkeeping; never exceeded.
        chunk_size: tokens per chunk.
        kv_bits: ``None`` stores the model's own dtype (lossless); 8 or 4 store KIVI-quantized
            K/V (keys per channel, values per token in groups of ``group_size`` channels).
        group_size: channel group for value quantization; must divide the model's head_dim
            (default: the largest of 128/64/32/16/8 that does).
        sink_tokens: the first ``sink_tokens`` tokens of every sequence stay full precision.
        disk_path / max_disk_bytes: a persistent tier; every stored chunk is also written there
            (checksummed safetensors), RAM misses are served from it, and another process
            pointed at the same directory reuses its entries.

    Eviction keeps what is worth most: ``(hits + 1) x recompute cost / bytes``, halved every
    ``recency_half_life`` store operations without use. Only chunks with no stored successor
    in RAM are evicted (a chain is cut from its tail), pinned chunks last. Thread safe.
    """

    def __init__(
        self,
        max_bytes: int = 2_000_000_000,
        chunk_size: int = 128,
        *,
        kv_bits: int | None = None,
        group_size: int | None = None,
        sink_tokens: int = 0,
        disk_path: str | os.PathLike | None = None,
        max_disk_bytes: int | None = None,
        recency_half_life: int = 256,
    ) -> None:
        _positive_int("max_bytes", max_bytes)
        _positive_int("chunk_size", chunk_size)
        _positive_int("group_size", group_size, allow_none=True)
        _positive_int("max_disk_bytes", max_disk_bytes, allow_none=True)
        _positive_int("recency_half_life", recency_half_life)
        if kv_bits is not None and kv_bits not in SUPPORTED_BITS:
            raise ValueError(f"kv_bits must be None, 8 or 4, got {kv_bits!r}")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be a non-negative int, got {sink_tokens!r}")
        if max_disk_bytes is not None and disk_path is None:
            raise ValueError("max_disk_bytes needs disk_path")
        self.max_bytes = max_bytes
        self.chunk_size = chunk_size
        self.kv_bits = kv_bits
        self.group_size = group_size
        self.sink_tokens = sink_tokens
        self.recency_half_life = recency_half_life
        self._lock = threading.RLock()
        self._ram: dict[Key, StoredChunk] = {}
        self._index: dict[Key, _IndexEntry] = {}  # every known chunk, RAM or disk
        self._children: dict[Key, dict[int, set[Key]]] = {}  # parent -> first token -> keys
        self._bytes = 0
        self._clock = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "hit_tokens", "lookup_tokens", "inserted", "evictions", "pinned_evictions", "rejected"), 0
        )
        self._disk: DiskTier | None = None
        self._disk_stamp: float | None = None
        if disk_path is not None:
            self._disk = DiskTier(disk_path, max_disk_bytes or 10 * max_bytes)
            self._refresh_disk_index()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._ram)

    def __contains__(self, key: Key) -> bool:
        return key in self._ram

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM now: tensors, scales, token ids and per-entry bookkeeping."""
        return self._bytes

    def entries(self) -> list[StoredChunk]:
        """The chunks held in RAM (a snapshot)."""
        with self._lock:
            return list(self._ram.values())

    def stats(self) -> dict:
        """Counters and sizes. ``hits``/``misses`` count lookups that reused at least one token /
        none; ``evictions`` count chunks dropped from RAM; ``rejected`` chunks that could not fit."""
        with self._lock:
            disk = self._disk
            disk_bytes = disk.nbytes() if disk else 0
            out = {
                "entries": len(self._ram),
                "bytes": self._bytes,
                "bytes_by_tier": {"ram": self._bytes, "disk": disk_bytes},
                "max_bytes": self.max_bytes,
                "chunk_size": self.chunk_size,
                "kv_bits": self.kv_bits,
                "pinned_entries": sum(1 for e in self._ram.values() if e.pinned),
                **self._counts,
                "disk_entries": len(self._index) if disk else 0,
                "disk_reads": disk.reads if disk else 0,
                "disk_writes": disk.writes if disk else 0,
                "corrupt_dropped": disk.corrupt_dropped if disk else 0,
            }
            return out

    def check_model(self, head_dim: int) -> None:
        """Raise ``ValueError`` when the settings cannot store K/V with this ``head_dim``."""
        if self.kv_bits is not None and self.group_size is not None and head_dim % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} does not divide the model's head_dim={head_dim}: "
                "pick a divisor of head_dim (or leave group_size=None)"
            )

    def lookup(self, namespace: Key, token_ids: Sequence[int], max_tokens: int | None = None) -> list[ChunkHit]:
        """The longest stored prefix of ``token_ids`` (at most ``max_tokens`` tokens), as chunk hits in order."""
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        size = self.chunk_size
        hits: list[ChunkHit] = []
        with self._lock:
            self._clock += 1
            if self._disk is not None:
                self._refresh_disk_index()
            parent, pos = namespace, 0
            chain: set[Key] = set()
            while pos < limit:
                want = tuple(token_ids[pos : pos + size])
                entry = self._fetch(chunk_key(parent, want), namespace, chain) if len(want) == size else None
                if entry is not None:
                    used = min(size, limit - pos)
                else:
                    entry, used = self._best_partial(parent, want, namespace, chain)
                    used = min(used, limit - pos)
                if entry is None or used <= 0:
                    break
                hits.append(ChunkHit(entry, pos, used))
                chain.add(entry.key)
                pos += used
                if used < entry.num_tokens or entry.num_tokens < size:
                    break  # a partial overlap ends the chain
                parent = entry.key
            for hit in hits:
                hit.chunk.hits += 1
                hit.chunk.last_used = self._clock
            self._counts["lookup_tokens"] += limit
            self._counts["hit_tokens"] += pos
            self._counts["hits" if pos else "misses"] += 1
        return hits

    def _fetch(self, key: Key, namespace: Key, protected: set[Key]) -> StoredChunk | None:
        entry = self._ram.get(key)
        if entry is not None or self._disk is None:
            return entry
        if key not in self._index:
            if not self._disk.has(key):  # another process may have written it since our last scan
                return None
            for record in self._disk.records({key}):
                self._index_entry(record.key, record.parent, record.token_ids)
        loaded = self._disk.read(key, namespace)
        if loaded is None:
            if not self._disk.has(key):
                self._forget(key)  # deleted by the disk budget, another process, or corrupt
            return None
        entry = from_tensors(key, *loaded)
        if self._make_room(entry.nbytes, protected):
            self._add_ram(entry)
        return entry

    def _best_partial(self, parent: Key, want: tuple[int, ...], namespace: Key, protected: set[Key]):
        if not want:
            return None, 0
        candidates = []
        for key in self._children.get(parent, {}).get(want[0], ()):
            n = _common_prefix_length(self._index[key].token_ids, want)
            candidates.append((n, key))
        for n, key in sorted(candidates, reverse=True):
            entry = self._fetch(key, namespace, protected)
            if entry is not None:
                return entry, n
        return None, 0

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        namespace: Key,
        token_ids: Sequence[int],
        states: Callable[[int, int], LayerStates],
        pin: bool = False,
    ) -> int:
        """Store every chunk of ``token_ids`` that is not stored yet; returns how many were added.

        ``states(start, end)`` returns the per-layer dense K/V of tokens ``[start, end)``; it is
        only called for missing chunks, and the store keeps (and owns) what it returns.
        ``pin=True`` marks the whole sequence as evicted last.
        """
        added = 0
        token_ids = tuple(token_ids)
        with self._lock:
            self._clock += 1
            parent = namespace
            chain: set[Key] = set()
            for start, end in chunk_spans(len(token_ids), self.chunk_size):
                toks = token_ids[start:end]
                key = chunk_key(parent, toks)
                entry = self._ram.get(key)
                if entry is None and key not in self._index:
                    if len(toks) < self.chunk_size and self._has_longer_sibling(parent, toks):
                        break  # a stored chunk already covers this partial one
                    keys, values = states(start, end)
                    group = self.group_size or default_group_size(keys[0].shape[-1])
                    fields = encode_chunk(keys, values, self.kv_bits, group, self.sink_tokens - start)
                    entry = StoredChunk(key, parent, namespace, start, toks, pinned=pin, **fields)
                    if not self._make_room(entry.nbytes, protected=chain):
                        break
                    self._add(entry)
                    added += 1
                if entry is not None:
                    entry.last_used = self._clock
                    entry.pinned = entry.pinned or pin
                chain.add(key)
                parent = key
        return added

    def _has_longer_sibling(self, parent: Key, toks: tuple[int, ...]) -> bool:
        for key in self._children.get(parent, {}).get(toks[0], ()):
            other = self._index[key].token_ids
            if len(other) >= len(toks) and other[: len(toks)] == toks:
                return True
        return False

    def _add(self, entry: StoredChunk) -> None:
        # A new chunk supersedes any stored partial sibling that is a prefix of it.
        for key in list(self._children.get(entry.parent, {}).get(entry.token_ids[0], ())):
            other = self._index[key].token_ids
            if len(other) < entry.num_tokens and entry.token_ids[: len(other)] == other:
                self._forget(key)
        self._add_ram(entry)
        self._counts["inserted"] += 1
        if self._disk is not None:
            tensors, metadata = to_tensors(entry)
            if not self._disk.write(entry.key, tensors, metadata):
                logger.warning("chunk of %d bytes does not fit in max_disk_bytes; kept in RAM only", entry.nbytes)

    def _add_ram(self, entry: StoredChunk) -> None:
        self._index_entry(entry.key, entry.parent, entry.token_ids)
        self._ram[entry.key] = entry
        self._bytes += entry.nbytes

    def _index_entry(self, key: Key, parent: Key, token_ids: tuple[int, ...]) -> None:
        if key not in self._index:
            self._index[key] = _IndexEntry(parent, token_ids)
            self._children.setdefault(parent, {}).setdefault(token_ids[0], set()).add(key)

    def _value(self, entry: StoredChunk) -> float:
        """What keeping ``entry`` is worth per byte: hits x recompute cost, decayed by idle time."""
        # Recomputing a chunk costs its tokens' MLP work plus attention over everything before it.
        cost = entry.num_tokens * (1.0 + (entry.start + entry.num_tokens / 2) / 1024)
        recency = 0.5 ** ((self._clock - entry.last_used) / self.recency_half_life)
        return (entry.hits + 1) * cost * recency / entry.nbytes

    def _make_room(self, nbytes: int, protected: set[Key]) -> bool:
        if nbytes > self.max_bytes:
            self._counts["rejected"] += 1
            logger.warning(
                "A %d-byte chunk does not fit in ChunkStore(max_bytes=%d); not stored. "
                "Raise max_bytes, lower chunk_size or set kv_bits.", nbytes, self.max_bytes
            )
            return False
        while self._bytes + nbytes > self.max_bytes:
            victim = self._pick_victim(protected)
            if victim is None:
                self._counts["rejected"] += 1
                return False
            if victim.pinned:
                self._counts["pinned_evictions"] += 1
                logger.warning("evicting a pinned chunk: the pinned entries alone exceed max_bytes")
            self._evict_ram(victim.key)
        return True

    def _pick_victim(self, protected: set[Key]) -> StoredChunk | None:
        has_ram_child = {e.parent for e in self._ram.values()}
        best, best_rank = None, None
        for entry in self._ram.values():
            if entry.key in protected:
                continue
            # Leaves first (cutting a chain from its tail keeps the rest reachable), pinned last.
            rank = (entry.pinned, entry.key in has_ram_child, self._value(entry))
            if best_rank is None or rank < best_rank:
                best, best_rank = entry, rank
        return best

    def _evict_ram(self, key: Key) -> None:
        entry = self._ram.pop(key)
        self._bytes -= entry.nbytes
        self._counts["evictions"] += 1
        if self._disk is None or not self._disk.has(key):
            self._forget(key)  # gone from every tier: its successors are unreachable too

    def _forget(self, key: Key) -> None:
        """Drop ``key`` from every tier, and every chunk that descends from it."""
        index = self._index.pop(key, None)
        entry = self._ram.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        if self._disk is not None:
            self._disk.remove(key)
        if index is not None:
            by_first = self._children.get(index.parent, {})
            group = by_first.get(index.token_ids[0])
            if group is not None:
                group.discard(key)
                if not group:
                    del by_first[index.token_ids[0]]
            if not by_first:
                self._children.pop(index.parent, None)
        for group in list(self._children.get(key, {}).values()):
            for child in list(group):
                self._forget(child)
        self._children.pop(key, None)

    def _refresh_disk_index(self) -> None:
        stamp = self._disk.stamp()
        if stamp == self._disk_stamp:
            return
        self._disk_stamp = stamp
        present = self._disk.keys()
        for key in [k for k in self._index if k not in present and k not in self._ram]:
            self._forget(key)
        for record in self._disk.records({k for k in present if k not in self._index}):
            self._index_entry(record.key, record.parent, record.token_ids)

    def clear(self) -> None:
        """Drop every RAM entry (the disk tier and counters are kept)."""
        with self._lock:
            for key in list(self._ram):
                entry = self._ram.pop(key)
                self._bytes -= entry.nbytes
                if self._disk is None:
                    self._forget(key)

    def __repr__(self) -> str:
        return (
            f"ChunkStore(entries={len(self._ram)}, bytes={self._bytes}, max_bytes={self.max_bytes}, "
            f"chunk_size={self.chunk_size}, kv_bits={self.kv_bits}, disk={self._disk.path if self._disk else None})"
        )
