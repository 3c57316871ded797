"""What to evict: pure functions shared by the RAM tier and the disk tier.

Both tiers keep what is worth most per byte and cut chains from their tail: a chunk is only
reachable through its whole chain of predecessors, so evicting a chain's root strands every
successor. Order of eviction: chunks already unreachable, then leaves by value, then inner
chunks (with all their successors), pinned chunks last.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvboost_hf.store.codec import StoredChunk

Key = bytes

# The disk tier has no cross-process hit counts: a file's mtime (refreshed on every hit, in any
# process) stands in for them, and its worth halves every this many seconds unused.
DISK_HALF_LIFE_S = 3600.0


def recompute_cost(start: int, num_tokens: int) -> float:
    """Relative cost of recomputing a chunk: its tokens' MLP work plus attention over what precedes them."""
    return num_tokens * (1.0 + (start + num_tokens / 2) / 1024)


@dataclass(frozen=True)
class Candidate:
    """A stored chunk as eviction sees it."""

    key: Key
    parent: Key
    namespace: Key
    nbytes: int
    value: float  # worth per byte; higher is kept longer
    pinned: bool = False


def descendants(key: Key, children: dict[Key, list[Key]]) -> list[Key]:
    """Every chunk whose chain passes through ``key`` (not ``key`` itself)."""
    out, todo = [], list(children.get(key, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, ()))
    return out


def choose_victims(candidates: Sequence[Candidate], need: int, keep: Iterable[Key] = ()) -> list[Key] | None:
    """Keys to delete so that at least ``need`` bytes are freed, or None when that is impossible
    without touching ``keep`` (e.g. the chain a new chunk is being appended to).

    Unreachable chunks (parent neither the namespace root nor present) go first, then leaves in
    order of value, then inner chunks together with their successors; pinned chunks last.
    """
    keep = set(keep)
    by_key = {c.key: c for c in candidates}
    children: dict[Key, list[Key]] = {}
    for c in candidates:
        children.setdefault(c.parent, []).append(c.key)
    # Anything on a kept chain (its ancestors) must stay too.
    protected = set()
    for key in keep:
        while key in by_key and key not in protected:
            protected.add(key)
            key = by_key[key].parent
    gone: set[Key] = set()
    freed = 0
    victims: list[Key] = []

    def reachable(c: Candidate) -> bool:
        key = c.key
        while True:
            parent = by_key[key].parent
            if parent == by_key[key].namespace:
                return True
            if parent not in by_key or parent in gone:
                return False
            key = parent

    def drop(key: Key) -> None:
        nonlocal freed
        for k in [key, *descendants(key, children)]:
            if k not in gone:
                gone.add(k)
                freed += by_key[k].nbytes
                victims.append(k)

    for c in candidates:
        if freed >= need:
            return victims
        if c.key not in protected and c.key not in gone and not reachable(c):
            drop(c.key)
    while freed < need:
        best, best_rank = None, None
        for c in candidates:
            if c.key in gone or c.key in protected:  # protected holds every ancestor of a kept chunk
                continue
            is_inner = any(k not in gone for k in children.get(c.key, ()))
            rank = (c.pinned, is_inner, c.value)
            if best_rank is None or rank < best_rank:
                best, best_rank = c, rank
        if best is None:
            return None
        drop(best.key)
    return victims


def ram_value(entry: StoredChunk, clock: int, half_life: int) -> float:
    """What keeping a RAM entry is worth per byte: (hits + 1) x recompute cost, halved every ``half_life`` idle ops."""
    recency = 0.5 ** ((clock - entry.last_used) / half_life)
    return (entry.hits + 1) * recompute_cost(entry.start, entry.num_tokens) * recency / entry.nbytes


def ram_victim(entries: Iterable[StoredChunk], protected: set[Key], clock: int, half_life: int) -> StoredChunk | None:
    """The RAM entry to evict next: leaves before chunks with a successor in RAM, pinned last, lowest value first.

    A chunk whose successor stays in RAM may still go when the successor's file keeps the chain
    reachable from disk; the store forgets successors that end up unreachable.
    """
    entries = list(entries)
    has_ram_child = {e.parent for e in entries}
    best, best_rank = None, None
    for entry in entries:
        if entry.key in protected:
            continue
        rank = (entry.pinned, entry.key in has_ram_child, ram_value(entry, clock, half_life))
        if best_rank is None or rank < best_rank:
            best, best_rank = entry, rank
    return best
