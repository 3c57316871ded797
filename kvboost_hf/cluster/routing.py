"""Exact prefix-aware routing: which replica a request goes to, decided from the store's own chunk keys.

A replica reports the chunk keys its store holds (:class:`ReplicaReport`); a request's keys are
:func:`kvboost_hf.store.keys.prefix_keys` of its prompt under its scope's root, so "replica R holds
the first n keys" means R's store holds that prompt's first n chunks, exactly as a lookup would find
them (tenant and salt included: a request's keys never match another tenant's entries). The policy
only ranks replicas; a stale report costs a miss, never a wrong answer (the replica's own lookup
decides what it reuses). Pure functions: the Ray Serve router calls them.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvboost_hf.reuse.segments import segment_starts
from kvboost_hf.store.keys import Key, chunk_key, segment_spans, switch_root
from kvboost_hf.store.scope import CacheScope

KEY_PREFIX_BYTES = 8  # replicas report keys cut to this many bytes: 2^-64 false matches, half the size


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica says it holds (``held``: chunk keys cut to ``KEY_PREFIX_BYTES``) and how busy it is."""

    replica: str
    held: Collection[bytes]
    queue: int = 0
    shared_ends: Collection[int] = ()  # where the replica's shared prefixes (and their chunks) end


def short(key: Key) -> bytes:
    """A key as replicas report it."""
    return key[:KEY_PREFIX_BYTES]


def matched_chunks(keys: Sequence[Key], held: Collection[bytes]) -> int:
    """How many leading chunks of a prompt (its ``keys``) a replica holding ``held`` has."""
    n = 0
    for key in keys:
        if short(key) not in held:
            break
        n += 1
    return n


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's chunks as a replica's store keys them: cut at ``bounds`` (segment starts) and every
    ``chunk_size`` tokens, chained under ``root``, after the whole chunks a replica holds under
    ``shared_root`` (shared prefixes, :class:`CacheScope`)."""

    token_ids: tuple[int, ...]
    chunk_size: int
    bounds: tuple[int, ...]
    root: Key
    shared_root: Key | None = None

    def matched(self, held: Collection[bytes], shared_ends: Collection[int] = ()) -> int:
        """Leading chunks a replica holding ``held`` has, as its store's lookup walks them: the shared
        chain while it is held (a shared chunk may end at any of ``shared_ends``, where the replica's
        shared texts end), then the own chain after it (:func:`~kvboost_hf.store.keys.switch_root`), cut
        as an insert after that shared prefix cuts it."""
        ids, n, begin, parent = self.token_ids, 0, 0, self.root
        if self.shared_root is not None:
            spans = dict(segment_spans(len(ids), self.chunk_size, self.bounds))
            shared = self.shared_root
            while begin < len(ids):
                ends = {spans.get(begin, 0), *(e for e in shared_ends if begin < e <= begin + self.chunk_size)}
                found = self._held_chunk(shared, begin, sorted(ends, reverse=True), held)
                if found is None:
                    break
                (shared, begin), n = found, n + 1
            if n:
                parent = switch_root(shared, self.root)
        for start, end in segment_spans(len(ids), self.chunk_size, (*self.bounds, begin)):
            if start < begin:
                continue
            parent = chunk_key(parent, ids[start:end])
            if short(parent) not in held:
                break
            n += 1
        return n

    def _held_chunk(self, parent: Key, begin: int, ends: Sequence[int],
                    held: Collection[bytes]) -> tuple[Key, int] | None:
        """The key and end of the longest held chunk after ``parent`` from ``begin`` ending at one of ``ends``."""
        for end in ends:
            if end > begin:
                key = chunk_key(parent, self.token_ids[begin:end])
                if short(key) in held:
                    return key, end
        return None


@dataclass(frozen=True)
class Keying:
    """How a replica's store keys a prompt: the model's namespace, the chunk size and the segment
    tokens of its reuse state. Replicas report it with what they hold; a router needs no model."""

    namespace: Key
    chunk_size: int
    turn_tokens: tuple[int, ...] = ()
    separator: tuple[int, ...] = ()
    leading_special: tuple[int, ...] = ()

    def prompt_keys(self, token_ids: Sequence[int], scope: CacheScope | None = None) -> PromptKeys:
        """``token_ids`` under ``scope`` (a tenant's, a salt's): the keys the replica's lookup walks."""
        ids = tuple(token_ids)
        bounds = tuple(segment_starts(ids, self.turn_tokens, self.separator, (), self.leading_special))
        scope = scope or CacheScope()
        return PromptKeys(ids, self.chunk_size, bounds, scope.root(self.namespace), scope.shared_root(self.namespace))

    def as_dict(self) -> dict:
        return {"namespace": self.namespace.hex(), "chunk_size": self.chunk_size, "turn_tokens": list(self.turn_tokens),
                "separator": list(self.separator), "leading_special": list(self.leading_special)}

    @classmethod
    def from_dict(cls, data: dict) -> Keying:
        return cls(bytes.fromhex(data["namespace"]), int(data["chunk_size"]), tuple(data["turn_tokens"]),
                   tuple(data["separator"]), tuple(data["leading_special"]))


def rank_replicas(prompt: PromptKeys | Sequence[Key], reports: Sequence[ReplicaReport], imbalance: int,
                  rng: random.Random | None = None) -> list[list[str]]:
    """Replicas in order of preference, as ranks (Ray Serve's ``choose_replicas`` shape), for a prompt's
    keys (:class:`PromptKeys`, or a plain chain of keys).

    The replicas holding the longest prefix come first, least loaded first, unless even the least
    loaded of them has more than ``imbalance`` requests more than the least loaded replica: then (as
    without any hit) two replicas drawn at random, the less loaded first (power of two choices), then
    the rest by load.
    """
    if not reports:
        return []
    rng = rng or random.Random()
    lightest = min(r.queue for r in reports)
    matched = {r.replica: prompt.matched(r.held, r.shared_ends) if isinstance(prompt, PromptKeys)
               else matched_chunks(prompt, r.held) for r in reports}
    best = max(matched.values())
    holders = sorted((r for r in reports if best and matched[r.replica] == best), key=lambda r: r.queue)
    if holders and holders[0].queue - lightest <= imbalance:
        chosen = {r.replica for r in holders}
        rest = sorted((r for r in reports if r.replica not in chosen), key=lambda r: (-matched[r.replica], r.queue))
        return [[r.replica for r in holders]] + ([[r.replica for r in rest]] if rest else [])
    pair = sorted(rng.sample(list(reports), min(2, len(reports))), key=lambda r: r.queue)
    chosen = {r.replica for r in pair}
    rest = sorted((r for r in reports if r.replica not in chosen), key=lambda r: r.queue)
    return [[pair[0].replica]] + [[r.replica] for r in pair[1:]] + ([[r.replica for r in rest]] if rest else [])
