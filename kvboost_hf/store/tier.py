"""The protocol every place a chunk can be kept implements: RAM, the disk, a shared Redis.

A :class:`~kvboost_hf.store.ChunkStore` is lookup, insert and eviction over an ordered list of
tiers, nearest first. A tier returns only verified entries: one that fails its checksum or does
not decode is dropped there (and counted), never returned. How a tier finds chunks differs
(RAM and disk entries are indexed by the store; Redis is searched by successor hashes), so lookup
is the store's; what a tier does with one chunk is this protocol.
"""

from __future__ import annotations

from typing import Protocol

from kvboost_hf.store.codec import StoredChunk
from kvboost_hf.store.keys import Key


class Tier(Protocol):
    name: str

    def has(self, key: Key) -> bool:
        """Whether the tier holds ``key`` now (another process may have written or removed it)."""

    def read(self, key: Key, namespace: Key) -> StoredChunk | None:
        """The verified entry ``key`` of ``namespace``, or None (missing, corrupt, or not for this store)."""

    def write(self, entry: StoredChunk) -> bool:
        """Keep ``entry`` (or queue it); False when the tier does not take it (full, read-only, down)."""

    def remove(self, key: Key) -> None:
        """Drop ``key`` (no error when it is not there)."""

    def close(self) -> None:
        """Finish pending work; the tier serves nothing new after this."""

    def stats(self) -> dict:
        """The tier's counters and sizes."""
