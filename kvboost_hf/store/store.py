"""ChunkStore: cross-request storage of prompt K/V, content addressed, under a byte budget."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .keys import Key, chunk_key, chunk_spans

logger = logging.getLogger(__name__)

# Bookkeeping bytes per entry beyond its tensors and token ids (key, dict slots, dataclass).
ENTRY_OVERHEAD_BYTES = 256

LayerStates = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Per-layer keys and values of one chunk, each ``[num_kv_heads, num_tokens, head_dim]``."""


@dataclass
class StoredChunk:
    """One chunk of a prefix chain: the real prefill K/V of ``token_ids`` after ``parent``."""

    key: Key
    parent: Key
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        tensor_bytes = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        self.nbytes = tensor_bytes + 8 * len(self.token_ids) + ENTRY_OVERHEAD_BYTES

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ChunkHit:
    """``num_tokens`` leading tokens of ``chunk`` reused at prompt position ``start``."""

    chunk: StoredChunk
    start: int
    num_tokens: int


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    inserted: int = 0
    evictions: int = 0
    rejected: int = 0


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChunkStore:
    """Content-addressed K/V chunks shared across requests, bounded by ``max_bytes``.

    Chunks form prefix chains: chunk ``i`` of a sequence is keyed by the key of chunk ``i-1``
    and its own tokens, so a hit is only ever returned for the exact same preceding tokens
    under the same model namespace. The last chunk of a sequence may be partial; lookups match
    a partial overlap with any stored chunk at token granularity.

    Eviction is least-recently-used over whole chains: lookups refresh a chain from its tail to
    its root, so leaves go first, and evicting a chunk also drops every chunk after it (they
    can no longer be reached). The store never holds more than ``max_bytes``. Thread safe.
    """

    def __init__(self, max_bytes: int = 2_000_000_000, chunk_size: int = 128) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.max_bytes = max_bytes
        self.chunk_size = chunk_size
        self._lock = threading.RLock()
        self._entries: OrderedDict[Key, StoredChunk] = OrderedDict()  # LRU order, oldest first
        self._children: dict[Key, dict[int, set[Key]]] = {}  # parent -> first token -> child keys
        self._bytes = 0
        self._counters = _Counters()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held now: tensors, token ids and per-entry bookkeeping."""
        return self._bytes

    def stats(self) -> dict:
        """Counters: ``entries``, ``bytes``, ``max_bytes``, ``hits``/``misses`` (lookups that
        reused at least one token / none), ``hit_tokens``, ``lookup_tokens``, ``inserted``,
        ``evictions``, ``rejected`` (chunks too large for the budget)."""
        with self._lock:
            c = self._counters
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "chunk_size": self.chunk_size,
                "hits": c.hits,
                "misses": c.misses,
                "hit_tokens": c.hit_tokens,
                "lookup_tokens": c.lookup_tokens,
                "inserted": c.inserted,
                "evictions": c.evictions,
                "rejected": c.rejected,
            }

    def lookup(self, namespace: Key, token_ids: Sequence[int], max_tokens: int | None = None) -> list[ChunkHit]:
        """The longest stored prefix of ``token_ids`` (at most ``max_tokens`` tokens), as chunk hits in order."""
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        size = self.chunk_size
        hits: list[ChunkHit] = []
        with self._lock:
            parent, pos = namespace, 0
            while pos < limit:
                want = token_ids[pos : pos + size]
                entry = self._entries.get(chunk_key(parent, want)) if len(want) == size else None
                if entry is not None:
                    used = min(size, limit - pos)
                else:
                    entry, used = self._best_partial(parent, want)
                    used = min(used, limit - pos)
                if entry is None or used <= 0:
                    break
                hits.append(ChunkHit(entry, pos, used))
                pos += used
                if used < entry.num_tokens or entry.num_tokens < size:
                    break  # a partial overlap ends the chain
                parent = entry.key
            for hit in reversed(hits):  # tail first, so ancestors end up most recent
                hit.chunk.hits += 1
                self._entries.move_to_end(hit.chunk.key)
            c = self._counters
            c.lookup_tokens += limit
            c.hit_tokens += pos
            if pos:
                c.hits += 1
            else:
                c.misses += 1
        return hits

    def _best_partial(self, parent: Key, want: Sequence[int]) -> tuple[StoredChunk | None, int]:
        if not want:
            return None, 0
        best, best_len = None, 0
        for key in self._children.get(parent, {}).get(want[0], ()):
            entry = self._entries[key]
            n = _common_prefix_length(entry.token_ids, want)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        namespace: Key,
        token_ids: Sequence[int],
        states: Callable[[int, int], LayerStates],
    ) -> int:
        """Store every chunk of ``token_ids`` that is not stored yet; returns how many were added.

        ``states(start, end)`` returns the per-layer K/V of tokens ``[start, end)``; it is only
        called for chunks that are missing, and the store keeps (and owns) what it returns.
        """
        added = 0
        token_ids = tuple(token_ids)
        with self._lock:
            parent = namespace
            chain: set[Key] = set()
            for start, end in chunk_spans(len(token_ids), self.chunk_size):
                toks = token_ids[start:end]
                key = chunk_key(parent, toks)
                if key not in self._entries:
                    if len(toks) < self.chunk_size and self._has_longer_sibling(parent, toks):
                        break  # a stored chunk already covers this partial one
                    keys, values = states(start, end)
                    entry = StoredChunk(key, parent, toks, keys, values)
                    if not self._make_room(entry.nbytes, protected=chain):
                        break
                    self._add(entry)
                    added += 1
                else:
                    self._entries.move_to_end(key)
                chain.add(key)
                parent = key
            # The chain was walked root first; refresh it tail first so its root stays the most recent.
            for key in reversed(list(chain)):
                if key in self._entries:
                    self._entries.move_to_end(key)
        return added

    def _has_longer_sibling(self, parent: Key, toks: tuple[int, ...]) -> bool:
        for key in self._children.get(parent, {}).get(toks[0], ()):
            other = self._entries[key].token_ids
            if len(other) >= len(toks) and other[: len(toks)] == toks:
                return True
        return False

    def _add(self, entry: StoredChunk) -> None:
        # A new chunk supersedes any stored partial sibling that is a prefix of it.
        first = entry.token_ids[0]
        for key in list(self._children.get(entry.parent, {}).get(first, ())):
            other = self._entries[key]
            if other.num_tokens < entry.num_tokens and entry.token_ids[: other.num_tokens] == other.token_ids:
                self._remove(key)
        self._children.setdefault(entry.parent, {}).setdefault(first, set()).add(entry.key)
        self._entries[entry.key] = entry
        self._bytes += entry.nbytes
        self._counters.inserted += 1

    def _make_room(self, nbytes: int, protected: set[Key]) -> bool:
        if nbytes > self.max_bytes:
            self._counters.rejected += 1
            logger.warning(
                "A %d-byte chunk does not fit in ChunkStore(max_bytes=%d); not stored. "
                "Raise max_bytes or lower chunk_size.", nbytes, self.max_bytes
            )
            return False
        while self._bytes + nbytes > self.max_bytes:
            victim = next((k for k in self._entries if k not in protected), None)
            if victim is None:
                self._counters.rejected += 1
                return False
            self._counters.evictions += self._remove(victim)
        return True

    def _remove(self, key: Key) -> int:
        """Drop ``key`` and every chunk that descends from it; returns how many were dropped."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self._bytes -= entry.nbytes
        by_first = self._children.get(entry.parent)
        if by_first is not None:
            siblings = by_first.get(entry.token_ids[0])
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del by_first[entry.token_ids[0]]
            if not by_first:
                del self._children[entry.parent]
        removed = 1
        for group in list(self._children.get(key, {}).values()):
            for child in list(group):
                removed += self._remove(child)
        self._children.pop(key, None)
        return removed

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._children.clear()
            self._bytes = 0

    def __repr__(self) -> str:
        return (
            f"ChunkStore(entries={len(self._entries)}, bytes={self._bytes}, "
            f"max_bytes={self.max_bytes}, chunk_size={self.chunk_size})"
        )
