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

from kvboost_hf.store.keys import Key

KEY_PREFIX_BYTES = 8  # replicas report keys cut to this many bytes: 2^-64 false matches, half the size


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica says it holds (``held``: chunk keys cut to ``KEY_PREFIX_BYTES``) and how busy it is."""

    replica: str
    held: Collection[bytes]
    queue: int = 0


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


def rank_replicas(keys: Sequence[Key], reports: Sequence[ReplicaReport], imbalance: int,
                  rng: random.Random | None = None) -> list[list[str]]:
    """Replicas in order of preference, as ranks (Ray Serve's ``choose_replicas`` shape).

    The replicas holding the longest prefix come first, least loaded first, unless even the least
    loaded of them has more than ``imbalance`` requests more than the least loaded replica: then (as
    without any hit) two replicas drawn at random, the less loaded first (power of two choices), then
    the rest by load.
    """
    if not reports:
        return []
    rng = rng or random.Random()
    lightest = min(r.queue for r in reports)
    matched = {r.replica: matched_chunks(keys, r.held) for r in reports}
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
