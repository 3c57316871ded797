"""Where a ChunkStore keeps its chunks: RAM, the disk and a shared Redis (:mod:`.tier`), and the index
of every chunk they hold; fetching across them, making room, forgetting whole chains."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvboost_hf.store.codec import StoredChunk, chunk_from_blob
from kvboost_hf.store.disk import DiskTier
from kvboost_hf.store.index import ChunkIndex, IndexEntry, common_prefix_length
from kvboost_hf.store.keys import Key
from kvboost_hf.store.ram import RamTier
from kvboost_hf.store.remote import ANCHOR_TOKENS as REMOTE_ANCHOR_TOKENS
from kvboost_hf.store.remote import RemoteTier
from kvboost_hf.store.settings import StoreSettings
from kvboost_hf.store.tier import Tier

logger = logging.getLogger(__name__)


def _precision_rank(bits: int | None) -> int:
    return 1 << 30 if bits is None else bits


class TieredChunks:
    """The tiers and index behind :class:`~kvboost_hf.store.ChunkStore` (its lookups and inserts run over these)."""

    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self.max_bytes = settings.max_bytes
        self.chunk_size = settings.chunk_size
        self.kv_bits = settings.kv_bits
        self.group_size = settings.group_size
        self.sink_tokens = settings.sink_tokens
        self.recency_half_life = settings.recency_half_life
        self._read_only = bool(settings.read_only)
        self._lock = threading.RLock()
        self._ram = RamTier(self.max_bytes, self.recency_half_life)
        self._index = ChunkIndex()  # every known chunk, RAM or disk
        self._clock = 0
        self._generations: dict[str | None, int] = {}  # owner -> purges Redis had counted when last read
        self._disk: DiskTier | None = None
        self._disk_stamp: float | None = None
        self._remote: RemoteTier | None = None
        if settings.remote is not None:
            self._remote = RemoteTier(settings.remote, settings.remote_prefix, ttl_s=settings.remote_ttl_s,
                                      timeout_s=settings.remote_timeout_s,
                                      anchor_tokens=min(REMOTE_ANCHOR_TOKENS, self.chunk_size), accepts=self.accepts)
        if settings.disk_path is not None:
            self._disk = DiskTier(settings.disk_path, settings.max_disk_bytes or 10 * self.max_bytes, read_only=self._read_only)
            self._refresh_disk_index()

    @property
    def tiers(self) -> list[Tier]:
        """Where chunks are kept, nearest first: RAM, then the disk and the remote tier when configured."""
        return [t for t in (self._ram, self._disk, self._remote) if t is not None]

    @property
    def read_only(self) -> bool:
        """Serve lookups but store nothing (and write nothing to the disk tier)."""
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        self._read_only = bool(value)
        if self._disk is not None:
            self._disk.read_only = self._read_only

    def accepts(self, bits: int | None) -> bool:
        """Whether entries stored with ``bits`` (None: lossless) are precise enough for this store."""
        return _precision_rank(bits) >= _precision_rank(self.kv_bits)

    def __len__(self) -> int:
        return len(self._ram)

    def __contains__(self, key: Key) -> bool:
        return key in self._ram

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM now: tensors, scales, token ids and per-entry bookkeeping."""
        return self._ram.nbytes

    def entries(self) -> list[StoredChunk]:
        """The chunks held in RAM (a snapshot)."""
        with self._lock:
            return self._ram.entries()

    def _remote_step(self, namespace: Key, parent: Key, ids: tuple[int, ...], pos: int, protected: set[Key],
                     beat: int = 0):
        """``(entry, tokens used)``: the successor of ``parent`` in the remote tier matching the most of
        ``ids[pos:]`` (more than ``beat`` tokens), verified and promoted to RAM (and the disk tier); None
        when there is none. Nothing is read when the index promises no more than ``beat``."""
        if self._remote is None:
            return None
        rest = ids[pos:]
        found = self._remote.best_successor(parent, rest)
        if found is None or found[1] <= beat:
            return None
        best = found[0]
        # Blob level: a blob missing (or only at precisions we do not serve) keeps its successor entry,
        # which other stores may use; one that does not decode or lies about its tokens loses it.
        loaded = self._remote.read_blob(best, namespace, via=(parent, rest))
        if loaded is None:
            return None
        entry = chunk_from_blob(best, loaded)
        used = common_prefix_length(entry.token_ids, rest) if entry is not None else 0  # the blob's tokens, not the index's
        if (entry is None or entry.parent != parent or entry.start != pos or used <= beat
                or not self.accepts(entry.bits)):
            self._remote.forget_successor(parent, rest, best)
            return None
        if self.stale(entry):
            self._remote.remove(best)  # written before a purge of its owner (another replica's late write)
            return None
        if best not in self._ram and self._make_room(entry.nbytes, protected, entry.owner):
            self._add_ram(entry)
            self._persist_to(self._disk, entry)  # a restarted process finds it locally; its chain stays whole on disk
        return self._ram.get(best, entry), used

    def _mark_used(self, entries: list[StoredChunk]) -> None:
        for entry in entries:
            entry.hits += 1
            entry.last_used = self._clock
        if self._disk is not None and entries:
            self._disk.touch([e.key for e in entries])  # recency of the disk copies, for every process

    def _fetch(self, key: Key, namespace: Key, protected: set[Key]) -> StoredChunk | None:
        entry = self._ram.get(key)
        if entry is not None or self._disk is None:
            return entry
        if key not in self._index:
            if not self._disk.has(key):  # another process may have written it since our last scan
                return None
            self._index_records(self._disk.records({key}))
            if key not in self._index:
                return None
        loaded = self._disk.read_blob(key, namespace)  # blob level: "gone" and "does not decode" differ below
        if loaded is None:
            if not self._disk.has(key):
                self._forget(key)  # deleted by the disk budget, another process, or corrupt
            return None
        entry = chunk_from_blob(key, loaded)
        if entry is None or not self.accepts(entry.bits):
            # Replaced since it was indexed by a less precise entry (another store's): not for us.
            self._forget(key, delete_files=False)
            return None
        if self.stale(entry):
            self._forget(key)  # its owner was purged since it was written (e.g. while this process was down)
            return None
        if self._make_room(entry.nbytes, protected, entry.owner):
            self._add_ram(entry)
        return entry

    def stale(self, entry: StoredChunk) -> bool:
        """Whether ``entry`` was stored before a purge of its owner that this store knows of."""
        return entry.generation < self._generations.get(entry.owner, 0)

    def _add(self, entry: StoredChunk) -> None:
        # A new chunk supersedes any stored partial sibling that is a prefix of it.
        for key in self._index.siblings(entry.parent, entry.token_ids[0]):
            other = self._index.get(key).token_ids
            is_leaf = not self._index.has_children(key)
            if is_leaf and len(other) < entry.num_tokens and entry.token_ids[: len(other)] == other:
                self._forget(key)
        self._add_ram(entry)
        self._counts["inserted"] += 1
        for tier in self.tiers[1:]:
            self._persist_to(tier, entry)

    def persist(self, entries: Sequence[StoredChunk]) -> None:
        """Write RAM ``entries`` to the disk and remote tiers again, after a field was attached
        (per-token ``logprobs``)."""
        with self._lock:
            for entry in entries:
                if self._ram.get(entry.key) is entry:
                    for tier in self.tiers[1:]:
                        self._persist_to(tier, entry)

    def _persist_to(self, tier: Tier | None, entry: StoredChunk) -> None:
        if tier is None or self._read_only:
            return
        if not tier.write(entry) and tier is self._disk:
            logger.info("a %d-byte chunk is kept in RAM only (no room in max_disk_bytes without evicting its "
                        "own chain, or its predecessor has no file)", entry.nbytes)

    def _add_ram(self, entry: StoredChunk) -> None:
        self._index.add(entry.key, IndexEntry(entry.parent, entry.namespace, entry.token_ids, entry.bits))
        self._ram.write(entry)

    def _make_room(self, nbytes: int, protected: set[Key], owner: str | None = None) -> bool:
        return self._ram.make_room(nbytes, protected, self._clock, self._evict_ram, owner)

    def _evict_ram(self, key: Key) -> None:
        self._ram.remove(key)
        if self._disk is None or not self._disk.has(key):
            self._forget(key)  # gone from every tier: its successors are unreachable too

    def _forget(self, key: Key, delete_files: bool = True) -> None:
        """Drop ``key`` from every tier, and every chunk that descends from it (their files too,
        unless ``delete_files`` is False: entries that are valid, just not for this store)."""
        self._ram.remove(key)
        if self._disk is not None and delete_files:
            self._disk.remove(key)
        for child in self._index.remove(key):
            self._forget(child, delete_files)

    def _refresh_disk_index(self) -> None:
        stamp = self._disk.stamp()
        if stamp == self._disk_stamp:
            return
        self._disk_stamp = stamp
        present = self._disk.keys()
        for key in [k for k in self._index if k not in present and k not in self._ram]:
            self._forget(key)
        self._index_records(self._disk.records({k for k in present if k not in self._index}))

    def _index_records(self, records) -> None:
        """Index disk entries precise enough for this store (others stay on disk for their stores)."""
        for record in records:
            if self.accepts(record.bits):
                self._index.add(record.key, IndexEntry(record.parent, record.namespace, record.token_ids, record.bits))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until chunks queued for the remote tier are written; False on timeout (True without one)."""
        return self._remote.flush(timeout_s) if self._remote is not None else True

    def close(self) -> None:
        """Finish pending remote writes and stop the remote writer (the store still serves RAM and disk)."""
        for tier in self.tiers:
            tier.close()

    def clear(self) -> None:
        """Drop every RAM entry (the disk tier and counters are kept)."""
        with self._lock:
            for key in self._ram:
                if self._ram.remove(key) is None:
                    continue  # already forgotten with an ancestor (a chain of more than one chunk)
                if self._disk is None:
                    self._forget(key)
