"""The RAM tier: the decoded chunks a store serves from, under a byte budget."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator

from kvboost_hf.store.codec import StoredChunk
from kvboost_hf.store.eviction import ram_victim
from kvboost_hf.store.keys import Key

logger = logging.getLogger(__name__)


class RamTier:
    """Chunks held in memory, at most ``max_bytes`` of them. Not thread safe: the store locks around it."""

    name = "ram"

    def __init__(self, max_bytes: int, recency_half_life: int) -> None:
        self.max_bytes = max_bytes
        self.recency_half_life = recency_half_life
        self.nbytes = 0
        self.counts = {"evictions": 0, "pinned_evictions": 0, "rejected": 0, "quota_evictions": 0}
        self.quotas: dict[str, int] = {}  # owner -> bytes its own entries may hold (the store sets it)
        self.owner_bytes: Counter[str | None] = Counter()
        self._entries: dict[Key, StoredChunk] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._entries))

    def entries(self) -> list[StoredChunk]:
        return list(self._entries.values())

    def get(self, key: Key, default: StoredChunk | None = None) -> StoredChunk | None:
        return self._entries.get(key, default)

    # ------------------------------------------------------------------ Tier
    def has(self, key: Key) -> bool:
        return key in self._entries

    def read(self, key: Key, namespace: Key) -> StoredChunk | None:
        entry = self._entries.get(key)
        return entry if entry is not None and entry.namespace == namespace else None

    def write(self, entry: StoredChunk) -> bool:
        """Hold ``entry`` (room must have been made: :meth:`make_room`)."""
        old = self._entries.get(entry.key)
        if old is not None:
            self.nbytes -= old.nbytes
            self.owner_bytes[old.owner] -= old.nbytes
        self._entries[entry.key] = entry
        self.nbytes += entry.nbytes
        self.owner_bytes[entry.owner] += entry.nbytes
        return True

    def remove(self, key: Key) -> StoredChunk | None:
        """Drop ``key``; returns the entry that was held (None when there was none)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self.owner_bytes[entry.owner] -= entry.nbytes
        return entry

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.nbytes,
                "pinned_entries": sum(1 for e in self._entries.values() if e.pinned), **self.counts}

    # ------------------------------------------------------------------ budget
    def make_room(self, nbytes: int, protected: set[Key], clock: int, evict: Callable[[Key], None],
                  owner: str | None = None) -> bool:
        """Evict until ``nbytes`` more of ``owner``'s fit (never an entry in ``protected``), calling
        ``evict(key)`` for each victim, which must remove it; False (and nothing evicted beyond what was
        needed) when they cannot fit.

        An owner with a quota makes room within its own entries first; then, while the total is over
        ``max_bytes``, entries of owners without a quota go first. Entries of owners with a quota are only
        evicted for another owner with a quota, once the quotas add up to more than the budget: so one
        owner's traffic never evicts another's quota'd entries while the quotas fit the budget.
        """
        quota = self.quotas.get(owner) if owner is not None else None
        limit = self.max_bytes if quota is None else min(quota, self.max_bytes)
        if nbytes > limit:
            self.counts["rejected"] += 1
            logger.warning(
                "A %d-byte chunk does not fit in %s of %d bytes; not stored. Raise it, lower chunk_size or set kv_bits.",
                nbytes, "ChunkStore(max_bytes)" if quota is None else "its owner's quota", limit,
            )
            return False
        while quota is not None and self.owner_bytes[owner] + nbytes > quota:
            own = (e for e in self._entries.values() if e.owner == owner)
            if not self._evict_one(own, protected, clock, evict):
                self.counts["rejected"] += 1
                return False
            self.counts["quota_evictions"] += 1
        while self.nbytes + nbytes > self.max_bytes:
            unquotad = [e for e in self._entries.values() if e.owner not in self.quotas]
            if not (self._evict_one(unquotad, protected, clock, evict)
                    or quota is not None and self._evict_one(self._entries.values(), protected, clock, evict)):
                self.counts["rejected"] += 1
                return False
        return True

    def _evict_one(self, entries, protected: set[Key], clock: int, evict: Callable[[Key], None]) -> bool:
        """Evict the best victim among ``entries``; False when there is none."""
        victim = ram_victim(entries, protected, clock, self.recency_half_life)
        if victim is None:
            return False
        if victim.pinned:
            self.counts["pinned_evictions"] += 1
            logger.warning("evicting a pinned chunk: the pinned entries alone exceed the budget")
        self.counts["evictions"] += 1
        evict(victim.key)
        return True
