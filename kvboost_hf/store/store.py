"""ChunkStore: cross-request storage of prompt K/V, content addressed, under a byte budget."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Container, Sequence

import torch

from kvboost_hf.store.codec import ENTRY_OVERHEAD_BYTES, ChunkHit, StoredChunk, encode_chunk
from kvboost_hf.store.index import ANCHOR_TOKENS, ChainTail
from kvboost_hf.store.keys import Key, chunk_key, segment_spans, switch_root
from kvboost_hf.store.quant import default_group_size
from kvboost_hf.store.settings import StoreSettings
from kvboost_hf.store.tiered import TieredChunks

__all__ = ["ENTRY_OVERHEAD_BYTES", "ChunkHit", "ChunkStore", "StoredChunk"]

LayerStates = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Per-layer keys and values of one chunk, each ``[num_kv_heads, num_tokens, head_dim]``."""


class ChunkStore(TieredChunks):
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
        super().__init__(settings)
        self._epochs: dict[str | None, int] = {}  # owner -> purges so far
        self.purges = 0  # local purges of any owner (indexes built over the store rebuild after one)
        self._counts = dict.fromkeys(
            ("hits", "misses", "hit_tokens", "lookup_tokens", "content_hit_tokens", "inserted"), 0
        )

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
            ram = self._ram.stats()
            disk = self._disk.stats() if self._disk else {}
            out = {
                "entries": ram["entries"],
                "bytes": ram["bytes"],
                "bytes_by_tier": {"ram": ram["bytes"], "disk": disk.get("bytes", 0)},
                "max_bytes": self.max_bytes,
                "chunk_size": self.chunk_size,
                "kv_bits": self.kv_bits,
                "pinned_entries": ram["pinned_entries"],
                **self._counts,
                "evictions": ram["evictions"],
                "pinned_evictions": ram["pinned_evictions"],
                "rejected": ram["rejected"],
                "disk_entries": disk.get("entries", 0),
                "disk_reads": disk.get("reads", 0),
                "disk_writes": disk.get("writes", 0),
                "corrupt_dropped": disk.get("corrupt_dropped", 0),
                "temp_files_reclaimed": disk.get("temp_files_reclaimed", 0),
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

    def held_keys(self, prefix_bytes: int = 8) -> set[bytes]:
        """Every chunk key the local tiers (RAM, disk) hold, cut to ``prefix_bytes``: what a replica reports
        to a prefix-aware router (:mod:`kvboost_hf.cluster.routing`)."""
        with self._lock:
            return {key[:prefix_bytes] for key in self._index}

    def chain_ends(self, namespace: Key) -> set[int]:
        """Lengths in tokens of the chains of ``namespace`` the local tiers hold that nothing continues:
        where stored texts end (a router cuts a shared prefix's last chunk there, as a lookup would)."""
        with self._lock:
            return {len(ids) for _, ids in self._index.chains(namespace)}

    def stored_prefix_length(self, namespace: Key, token_ids: Sequence[int], *, shared: Key | None = None) -> int:
        """Leading tokens of ``token_ids`` the local tiers (RAM, disk) know for ``namespace`` (after the
        ``shared`` chain's, see :meth:`lookup`): an estimate from the index alone (nothing is loaded or
        verified, no counter moves), for cost decisions."""
        ids = tuple(token_ids)
        with self._lock:
            start, root, partial = self._shared_prefix(shared, namespace, ids)
            own = sum(used for _, used in self._index.match_path(root, ids, self.chunk_size, start))
            return start + (own or partial)

    def lookup(self, namespace: Key, token_ids: Sequence[int], max_tokens: int | None = None, *,
               shared: Key | None = None) -> list[ChunkHit]:
        """The longest stored prefix of ``token_ids`` (at most ``max_tokens`` tokens), as chunk hits in order.

        With ``shared`` (the root of entries shared on purpose), the prefix starts with the whole chunks
        stored under ``shared`` and goes on in ``namespace``'s chain after them (:func:`~.keys.switch_root`).
        """
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        ids = tuple(token_ids[:limit])
        with self._lock:
            self._clock += 1
            if self._disk is not None:
                self._refresh_disk_index()
            # Remote steps stop after this budget: a slow Redis costs a bounded delay per lookup.
            deadline = time.monotonic() + max(1.0, 8 * self.settings.remote_timeout_s)
            hits: list[ChunkHit] = []
            root, partial = namespace, []
            if shared is not None:
                hits = self._walk(shared, ids, 0, deadline, set())
                whole = 0
                while whole < len(hits) and hits[whole].num_tokens == hits[whole].chunk.num_tokens:
                    whole += 1
                hits, partial = hits[:whole], hits[whole:]
                if hits:
                    root = switch_root(hits[-1].chunk.key, namespace)
            start = sum(h.num_tokens for h in hits)
            hits += self._walk(root, ids, start, deadline, {h.chunk.key for h in hits}) or partial
            pos = sum(h.num_tokens for h in hits)
            self._mark_used([hit.chunk for hit in hits])
            self._counts["lookup_tokens"] += limit
            self._counts["hit_tokens"] += pos
            self._counts["hits" if pos else "misses"] += 1
        return hits

    def _walk(self, root: Key, ids: tuple[int, ...], pos: int, deadline: float, chain: set[Key]) -> list[ChunkHit]:
        """Hits of the chain of ``root`` from ``ids[pos]`` on (RAM, disk, then Redis until ``deadline``)."""
        hits: list[ChunkHit] = []
        parent, limit = root, len(ids)
        while pos < limit:
            last, hung = None, (parent, pos)  # the local path's last hit, and its parent and position
            for key, used in self._index.match_path(parent, ids, self.chunk_size, pos):
                entry = self._fetch(key, root, chain)
                if entry is None:
                    break
                last, hung = ChunkHit(entry, pos, used), (parent, pos)
                hits.append(last)
                chain.add(key)
                pos, parent = pos + used, key
                if used < entry.num_tokens:
                    break
            found = None
            whole = last is None or last.num_tokens == last.chunk.num_tokens  # nothing local ends inside a chunk
            if whole and pos < limit and time.monotonic() < deadline:
                found = self._remote_step(root, parent, ids, pos, chain)
            if found is None and last is not None and last.num_tokens < self.chunk_size:
                # The local path ends in a chunk the prompt leaves, or in a short one (a sequence's last),
                # and Redis has nothing after it: it may hold a sibling that goes further (another
                # replica's later turn of the chat). Only the path's last chunk: match_path chose the
                # longest local path, and a remote successor, when there is one, keeps it.
                if limit - hung[1] > last.num_tokens and time.monotonic() < deadline:
                    found = self._remote_step(root, hung[0], ids, hung[1], chain, beat=last.num_tokens)
                    if found is not None:
                        hits.pop()
                        pos = hung[1]
            if found is None:
                break
            entry, used = found
            hits.append(ChunkHit(entry, pos, used))
            chain.add(entry.key)
            pos, parent = pos + used, entry.key
            if used < entry.num_tokens:
                break
        return hits

    def _shared_prefix(self, shared: Key | None, namespace: Key, ids: tuple[int, ...]) -> tuple[int, Key, int]:
        """``(tokens, root, partial)``: the whole chunks of ``ids`` the index knows under ``shared``, the root
        ``namespace``'s chain continues from after them, and the tokens of a partly matching next one."""
        if shared is None:
            return 0, namespace, 0
        start, root = 0, namespace
        for key, used in self._index.match_path(shared, ids, self.chunk_size):
            if used != len(self._index.get(key).token_ids):
                return start, root, used
            start, root = start + used, switch_root(key, namespace)
        return start, root, 0

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

    def insert(
        self,
        namespace: Key,
        token_ids: Sequence[int],
        states: Callable[[int, int], LayerStates],
        pin: bool = False,
        boundaries: Sequence[int] = (),
        *,
        shared: Key | None = None,
        owner: str | None = None,
        epoch: int | None = None,
    ) -> int:
        """Store every chunk of ``token_ids`` that is not stored yet; returns how many were added.

        Chunks start at every position in ``boundaries`` (segment starts: documents, chat
        turns) and every ``chunk_size`` tokens inside a segment.

        ``states(start, end)`` returns the per-layer dense K/V of tokens ``[start, end)``; it is
        only called for missing chunks, and the store keeps (and owns) what it returns.
        ``pin=True`` marks the whole sequence as evicted last. With ``shared`` (see :meth:`lookup`),
        only what follows the stored shared chunks is stored, in ``namespace``'s chain after them.
        New chunks are charged to ``owner`` (its quota: :meth:`set_quota`); given the owner's
        :meth:`epoch` when the request began, nothing is stored if the owner was purged since.
        """
        added = 0
        token_ids = tuple(token_ids)
        if self.read_only:
            return 0
        with self._lock:
            if epoch is not None and epoch != self._epochs.get(owner, 0):
                return 0  # purged while the request ran: what it confirmed is forgotten too
            self._clock += 1
            begin, root, _ = self._shared_prefix(shared, namespace, token_ids)
            parent = root
            chain: set[Key] = set()
            for start, end in segment_spans(len(token_ids), self.chunk_size, [*boundaries, begin]):
                if start < begin:
                    continue
                toks = token_ids[start:end]
                key = chunk_key(parent, toks)
                entry = self._ram.get(key)
                if entry is None and key not in self._index:
                    if end == len(token_ids) and self._index.has_longer_sibling(parent, toks):
                        break  # a stored chunk already covers this final partial one
                    keys, values = states(start, end)
                    group = self.group_size or default_group_size(keys[0].shape[-1])
                    fields = encode_chunk(keys, values, self.kv_bits, group, self.sink_tokens - start)
                    entry = StoredChunk(key, parent, root, start, toks, pinned=pin, owner=owner,
                                        generation=self._generations.get(owner, 0), **fields)
                    if not self._make_room(entry.nbytes, protected=chain, owner=owner):
                        break
                    self._add(entry)
                    added += 1
                if entry is not None:
                    entry.last_used = self._clock
                    if pin and not entry.pinned:
                        entry.pinned = True
                        self._persist_to(self._disk, entry)  # the disk tier evicts pinned files last too
                chain.add(key)
                parent = key
        return added

    # ------------------------------------------------------------------ owners
    def set_quota(self, owner: str, max_bytes: int | None) -> None:
        """Cap ``owner``'s entries at ``max_bytes`` in RAM and on disk (None: no cap). Going over evicts that
        owner's own entries; over the store's budget, owners without a quota are evicted first."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty string, got {owner!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1):
            raise ValueError(f"a quota must be a positive number of bytes or None, got {max_bytes!r}")
        with self._lock:
            for tier in (self._ram, self._disk):
                if tier is None:
                    continue
                if max_bytes is None:
                    tier.quotas.pop(owner, None)
                else:
                    tier.quotas[owner] = max_bytes

    def quotas(self) -> dict[str, int]:
        """Owner -> quota in bytes, for every owner with one."""
        with self._lock:
            return dict(self._ram.quotas)

    def owner_bytes(self) -> dict[str | None, int]:
        """Bytes of RAM entries per owner (None: entries charged to nobody)."""
        with self._lock:
            return {owner: n for owner, n in self._ram.owner_bytes.items() if n > 0}

    def epoch(self, owner: str | None) -> int:
        """How many times ``owner`` was purged: pass it to :meth:`insert` to drop what a purge overtook."""
        with self._lock:
            return self._epochs.get(owner, 0)

    def purge(self, owner: str | None, timeout_s: float = 5.0) -> dict[str, int | None]:
        """Forget every entry charged to ``owner`` in every tier (Redis and its queued writes included);
        inserts of requests that began before are dropped too (:meth:`epoch`), and with Redis every
        replica drops the owner's older entries at its next look (:meth:`follow_purges`). Returns how many
        entries went from RAM, disk and Redis (``remote`` None when Redis could not be purged: down, or no
        answer in ``timeout_s``; without a remote tier it is 0)."""
        with self._lock:
            self._epochs[owner] = self._epochs.get(owner, 0) + 1  # from now on, older requests store nothing
        remote = 0
        if self._remote is not None:  # first: a lookup meanwhile may copy its entries here; the local purge follows
            done = self._remote.purge(owner, timeout_s)
            remote = None if done is None else done[0]
            if done is not None:
                with self._lock:
                    self._generations[owner] = done[1]  # entries older than this are stale everywhere
        ram, disk = self._purge_local(owner)
        return {"ram": ram, "disk": disk, "remote": remote}

    def _purge_local(self, owner: str | None, below: int | None = None) -> tuple[int, int]:
        """Forget ``owner``'s entries in RAM and on disk (only those of a generation under ``below``, given one)."""
        def gone(record) -> bool:
            return record.owner == owner and (below is None or record.generation < below)

        with self._lock:
            ram = [e.key for e in self._ram.entries() if gone(e)]
            disk = [r.key for r in self._disk.records(self._disk.keys()) if gone(r)] if self._disk is not None else []
            for key in [*ram, *disk]:
                self._forget(key)
            self.purges += 1
        return len(ram), len(disk)

    def follow_purges(self, owner: str | None) -> bool:
        """With a Redis tier: forget ``owner``'s entries stored before its latest purge by any replica (one
        Redis read; nothing while Redis is down). True when it forgot some."""
        if self._remote is None:
            return False
        count = self._remote.purges(owner)
        if count is None:
            return False
        with self._lock:
            seen = self._generations.get(owner)
            self._generations[owner] = count
            if seen is not None and count <= seen:
                return False
        return sum(self._purge_local(owner, below=count)) > 0

    def __repr__(self) -> str:
        return (
            f"ChunkStore(entries={len(self._ram)}, bytes={self._ram.nbytes}, max_bytes={self.max_bytes}, "
            f"chunk_size={self.chunk_size}, kv_bits={self.kv_bits}, disk={self._disk.path if self._disk else None}, "
            f"remote={self._remote.url if self._remote else None})"
        )
