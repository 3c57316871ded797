"""ChunkStore: cross-request storage of prompt K/V, content addressed, under a byte budget."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Container, Sequence

import torch

from kvboost_hf.store.codec import ENTRY_OVERHEAD_BYTES, ChunkHit, StoredChunk, encode_chunk, from_tensors, to_tensors
from kvboost_hf.store.disk import DiskTier
from kvboost_hf.store.eviction import ram_victim
from kvboost_hf.store.index import ANCHOR_TOKENS, ChainTail, ChunkIndex, IndexEntry, common_prefix_length
from kvboost_hf.store.keys import Key, chunk_key, segment_spans
from kvboost_hf.store.quant import default_group_size
from kvboost_hf.store.remote import ANCHOR_TOKENS as REMOTE_ANCHOR_TOKENS
from kvboost_hf.store.remote import RemoteTier
from kvboost_hf.store.settings import StoreSettings

logger = logging.getLogger(__name__)

__all__ = ["ENTRY_OVERHEAD_BYTES", "ChunkHit", "ChunkStore", "StoredChunk"]

LayerStates = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Per-layer keys and values of one chunk, each ``[num_kv_heads, num_tokens, head_dim]``."""


def _chunk_from(key: Key, loaded) -> StoredChunk | None:
    """A verified blob's chunk, or None when its (checksummed but forged) layout does not decode."""
    try:
        return from_tensors(key, *loaded)
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError) as err:
        logger.warning("a stored entry passed its checksum but does not decode (%s); not used", err)
        return None


def _precision_rank(bits: int | None) -> int:
    return 1 << 30 if bits is None else bits


class ChunkStore:
    """Content-addressed K/V chunks shared across requests, bounded by ``max_bytes``.

    Chunks form prefix chains: chunk ``i`` of a sequence is keyed by the key of chunk ``i-1``
    and its own tokens, so a hit is only returned for the exact same preceding tokens under the
    same model namespace. The last chunk of a sequence may be partial; lookups match a partial
    overlap with any stored chunk at token granularity.

    Settings are validated by :class:`~.settings.StoreSettings` (see it for each one): the RAM
    budget, chunk size, storage precision (``kv_bits``; a lookup never returns an entry less
    precise than that), sink tokens, a disk tier, a shared Redis tier, read-only serving.

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
        read_only: bool = False,
        remote: str | None = None,
        remote_prefix: str = "kvboost",
        remote_ttl_s: int = 7 * 24 * 3600,
        remote_timeout_s: float = 0.25,
    ) -> None:
        settings = StoreSettings(
            max_bytes=max_bytes, chunk_size=chunk_size, kv_bits=kv_bits, group_size=group_size,
            sink_tokens=sink_tokens, disk_path=disk_path, max_disk_bytes=max_disk_bytes,
            recency_half_life=recency_half_life, read_only=read_only, remote=remote, remote_prefix=remote_prefix,
            remote_ttl_s=remote_ttl_s, remote_timeout_s=remote_timeout_s,
        )
        self.settings = settings
        self.max_bytes = settings.max_bytes
        self.chunk_size = settings.chunk_size
        self.kv_bits = settings.kv_bits
        self.group_size = settings.group_size
        self.sink_tokens = settings.sink_tokens
        self.recency_half_life = settings.recency_half_life
        self._read_only = bool(read_only)
        self._lock = threading.RLock()
        self._ram: dict[Key, StoredChunk] = {}
        self._index = ChunkIndex()  # every known chunk, RAM or disk
        self._bytes = 0
        self._clock = 0
        self._counts = dict.fromkeys(
            (
                "hits", "misses", "hit_tokens", "lookup_tokens", "content_hit_tokens",
                "inserted", "evictions", "pinned_evictions", "rejected",
            ),
            0,
        )
        self._disk: DiskTier | None = None
        self._disk_stamp: float | None = None
        self._remote: RemoteTier | None = None
        if remote is not None:
            self._remote = RemoteTier(remote, remote_prefix, ttl_s=settings.remote_ttl_s,
                                      timeout_s=settings.remote_timeout_s,
                                      anchor_tokens=min(REMOTE_ANCHOR_TOKENS, self.chunk_size))
        if disk_path is not None:
            self._disk = DiskTier(disk_path, settings.max_disk_bytes or 10 * self.max_bytes, read_only=self._read_only)
            self._refresh_disk_index()

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

    def token_chains(self, namespace: Key, skip: Container[Key] = ()) -> list[tuple[Key, tuple[int, ...]]]:
        """Token ids of every stored chain of ``namespace`` (RAM and disk tiers) that no chunk continues,
        as ``(key of its last chunk, token ids)``; chains whose last key is in ``skip`` are left out."""
        with self._lock:
            return list(self._index.chains(namespace, skip))

    def chain_tails(self, namespace: Key, known: Container[Key], context: int = 0) -> list[ChainTail]:
        """What :meth:`token_chains` adds since ``known`` (chunk keys already read): per leaf chain, only
        the chunks after its last known one, with ``context`` tokens before them (see ``ChunkIndex``)."""
        with self._lock:
            return list(self._index.chain_tails(namespace, known, context))

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
                "disk_entries": len(disk.keys()) if disk else 0,
                "disk_reads": disk.reads if disk else 0,
                "disk_writes": disk.writes if disk else 0,
                "corrupt_dropped": disk.corrupt_dropped if disk else 0,
                "temp_files_reclaimed": disk.temp_reclaimed if disk else 0,
                "remote": self._remote.stats() if self._remote else None,
            }
            return out

    def check_model(self, head_dim: int) -> None:
        """Raise ``ValueError`` when the settings cannot store K/V with this ``head_dim``."""
        if self.kv_bits is not None and self.group_size is not None and head_dim % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} does not divide the model's head_dim={head_dim}: "
                "pick a divisor of head_dim (or leave group_size=None)"
            )

    def stored_prefix_length(self, namespace: Key, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` the local tiers (RAM, disk) know for ``namespace``: an estimate
        from the index alone (nothing is loaded or verified, no counter moves), for cost decisions."""
        with self._lock:
            return sum(used for _, used in self._index.match_path(namespace, tuple(token_ids), self.chunk_size))

    def lookup(self, namespace: Key, token_ids: Sequence[int], max_tokens: int | None = None) -> list[ChunkHit]:
        """The longest stored prefix of ``token_ids`` (at most ``max_tokens`` tokens), as chunk hits in order."""
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        hits: list[ChunkHit] = []
        with self._lock:
            self._clock += 1
            if self._disk is not None:
                self._refresh_disk_index()
            ids, pos, parent = tuple(token_ids[:limit]), 0, namespace
            chain: set[Key] = set()
            # Remote steps stop after this budget: a slow Redis costs a bounded delay per lookup.
            remote_deadline = time.monotonic() + max(1.0, 8 * self.settings.remote_timeout_s)
            while pos < limit:
                ended = False  # the chain ends inside a chunk: nothing can follow
                for key, used in self._index.match_path(parent, ids, self.chunk_size, pos):
                    entry = self._fetch(key, namespace, chain)
                    if entry is None:
                        break
                    hits.append(ChunkHit(entry, pos, used))
                    chain.add(key)
                    pos, parent, ended = pos + used, key, used < entry.num_tokens
                    if ended:
                        break
                remote = not ended and pos < limit and time.monotonic() < remote_deadline
                found = self._remote_step(namespace, parent, ids, pos, chain) if remote else None
                if found is None:
                    break
                entry, used = found
                hits.append(ChunkHit(entry, pos, used))
                chain.add(entry.key)
                pos, parent = pos + used, entry.key
                if used < entry.num_tokens:
                    break
            self._mark_used([hit.chunk for hit in hits])
            self._counts["lookup_tokens"] += limit
            self._counts["hit_tokens"] += pos
            self._counts["hits" if pos else "misses"] += 1
        return hits

    def _remote_step(self, namespace: Key, parent: Key, ids: tuple[int, ...], pos: int, protected: set[Key]):
        """``(entry, tokens used)``: the successor of ``parent`` in the remote tier matching the most of
        ``ids[pos:]``, verified and promoted to RAM (and the disk tier); None when there is none."""
        if self._remote is None:
            return None
        rest = ids[pos:]
        best = self._remote.best_successor(parent, rest)
        if best is None:
            return None
        loaded = self._remote.read(best, namespace, self.accepts, parent, rest)
        if loaded is None:
            return None
        entry = _chunk_from(best, loaded)
        used = common_prefix_length(entry.token_ids, rest) if entry is not None else 0  # the blob's tokens, not the index's
        if entry is None or entry.parent != parent or used == 0 or not self.accepts(entry.bits):
            self._remote.forget_successor(parent, rest, best)
            return None
        if best not in self._ram and self._make_room(entry.nbytes, protected):
            self._add_ram(entry)
            self._write_disk(entry)  # a restarted process finds it locally; its chain stays whole on disk
        return self._ram.get(best, entry), used

    def lookup_content(
        self, namespace: Key, token_ids: Sequence[int], start: int, stop: int, min_tokens: int = 16
    ) -> list[ChunkHit]:
        """Stored chunks whose tokens appear anywhere in ``token_ids[start:stop]``, whatever preceded them.

        Scans left to right: at each position, a chunk continuing the previous hit in its own
        chain is preferred, else any chunk anchored there; tokens nothing matches are skipped,
        so a gap never blocks later hits. A hit of fewer than ``min_tokens`` tokens only counts
        when it continues the previous hit. Returned hits have ``exact=False``.
        """
        ids = tuple(token_ids[:stop])
        hits: list[ChunkHit] = []
        with self._lock:
            self._clock += 1
            if self._disk is not None:
                self._refresh_disk_index()
            pos, previous = start, None
            while pos < stop:
                found = self._index.continuation(previous, ids, pos) if previous is not None else None
                if found is None and pos + ANCHOR_TOKENS <= stop:
                    found = self._index.anchored(namespace, ids, pos, min_tokens)
                entry = self._fetch(found[0], namespace, {h.chunk.key for h in hits}) if found else None
                if entry is None:
                    pos, previous = pos + 1, None
                    continue
                key, offset, n = found
                hits.append(ChunkHit(entry, pos, n, offset=offset, exact=False))
                self._mark_used([entry])
                pos += n
                previous = key if offset + n == entry.num_tokens else None
            self._counts["content_hit_tokens"] += sum(h.num_tokens for h in hits)
        return hits

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
        loaded = self._disk.read(key, namespace)
        if loaded is None:
            if not self._disk.has(key):
                self._forget(key)  # deleted by the disk budget, another process, or corrupt
            return None
        entry = _chunk_from(key, loaded)
        if entry is None or not self.accepts(entry.bits):
            # Replaced since it was indexed by a less precise entry (another store's): not for us.
            self._forget(key, delete_files=False)
            return None
        if self._make_room(entry.nbytes, protected):
            self._add_ram(entry)
        return entry

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        namespace: Key,
        token_ids: Sequence[int],
        states: Callable[[int, int], LayerStates],
        pin: bool = False,
        boundaries: Sequence[int] = (),
    ) -> int:
        """Store every chunk of ``token_ids`` that is not stored yet; returns how many were added.

        Chunks start at every position in ``boundaries`` (segment starts: documents, chat
        turns) and every ``chunk_size`` tokens inside a segment.

        ``states(start, end)`` returns the per-layer dense K/V of tokens ``[start, end)``; it is
        only called for missing chunks, and the store keeps (and owns) what it returns.
        ``pin=True`` marks the whole sequence as evicted last.
        """
        added = 0
        token_ids = tuple(token_ids)
        if self.read_only:
            return 0
        with self._lock:
            self._clock += 1
            parent = namespace
            chain: set[Key] = set()
            for start, end in segment_spans(len(token_ids), self.chunk_size, boundaries):
                toks = token_ids[start:end]
                key = chunk_key(parent, toks)
                entry = self._ram.get(key)
                if entry is None and key not in self._index:
                    if end == len(token_ids) and self._index.has_longer_sibling(parent, toks):
                        break  # a stored chunk already covers this final partial one
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
                    if pin and not entry.pinned:
                        entry.pinned = True
                        self._write_disk(entry)  # the disk tier evicts pinned files last too
                chain.add(key)
                parent = key
        return added

    def _add(self, entry: StoredChunk) -> None:
        # A new chunk supersedes any stored partial sibling that is a prefix of it.
        for key in self._index.siblings(entry.parent, entry.token_ids[0]):
            other = self._index.get(key).token_ids
            is_leaf = not self._index.has_children(key)
            if is_leaf and len(other) < entry.num_tokens and entry.token_ids[: len(other)] == other:
                self._forget(key)
        self._add_ram(entry)
        self._counts["inserted"] += 1
        self._write_disk(entry)
        self._write_remote(entry)

    def persist(self, entries: Sequence[StoredChunk]) -> None:
        """Write RAM ``entries`` to the disk and remote tiers again, after a field was attached
        (per-token ``logprobs``)."""
        with self._lock:
            for entry in entries:
                if self._ram.get(entry.key) is entry:
                    self._write_disk(entry)
                    self._write_remote(entry)

    def _write_remote(self, entry: StoredChunk) -> None:
        if self._remote is not None and not self._read_only:
            tensors, metadata = to_tensors(entry)
            self._remote.write_async(entry.key, entry.parent, entry.token_ids, entry.bits, tensors, metadata)

    def _write_disk(self, entry: StoredChunk) -> None:
        if self._disk is None or self._read_only:
            return
        tensors, metadata = to_tensors(entry)
        if not self._disk.write(entry.key, tensors, metadata):
            logger.info("a %d-byte chunk is kept in RAM only (no room in max_disk_bytes without evicting its "
                        "own chain, or its predecessor has no file)", entry.nbytes)

    def _add_ram(self, entry: StoredChunk) -> None:
        self._index.add(entry.key, IndexEntry(entry.parent, entry.namespace, entry.token_ids, entry.bits))
        self._ram[entry.key] = entry
        self._bytes += entry.nbytes

    def _make_room(self, nbytes: int, protected: set[Key]) -> bool:
        if nbytes > self.max_bytes:
            self._counts["rejected"] += 1
            logger.warning(
                "A %d-byte chunk does not fit in ChunkStore(max_bytes=%d); not stored. "
                "Raise max_bytes, lower chunk_size or set kv_bits.", nbytes, self.max_bytes
            )
            return False
        while self._bytes + nbytes > self.max_bytes:
            victim = ram_victim(self._ram.values(), protected, self._clock, self.recency_half_life)
            if victim is None:
                self._counts["rejected"] += 1
                return False
            if victim.pinned:
                self._counts["pinned_evictions"] += 1
                logger.warning("evicting a pinned chunk: the pinned entries alone exceed max_bytes")
            self._evict_ram(victim.key)
        return True

    def _evict_ram(self, key: Key) -> None:
        entry = self._ram.pop(key)
        self._bytes -= entry.nbytes
        self._counts["evictions"] += 1
        if self._disk is None or not self._disk.has(key):
            self._forget(key)  # gone from every tier: its successors are unreachable too

    def _forget(self, key: Key, delete_files: bool = True) -> None:
        """Drop ``key`` from every tier, and every chunk that descends from it (their files too,
        unless ``delete_files`` is False: entries that are valid, just not for this store)."""
        entry = self._ram.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
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
        if self._remote is not None:
            self._remote.close()

    def clear(self) -> None:
        """Drop every RAM entry (the disk tier and counters are kept)."""
        with self._lock:
            for key in list(self._ram):
                entry = self._ram.pop(key, None)
                if entry is None:
                    continue  # already forgotten with an ancestor (a chain of more than one chunk)
                self._bytes -= entry.nbytes
                if self._disk is None:
                    self._forget(key)

    def __repr__(self) -> str:
        return (
            f"ChunkStore(entries={len(self._ram)}, bytes={self._bytes}, max_bytes={self.max_bytes}, "
            f"chunk_size={self.chunk_size}, kv_bits={self.kv_bits}, disk={self._disk.path if self._disk else None}, "
            f"remote={self._remote.url if self._remote else None})"
        )
