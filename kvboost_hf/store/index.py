"""ChunkIndex: every known chunk (in any tier) by key, by parent and by content anchor, without tensors.

It answers the matching questions of a lookup: the stored chain covering the most of a prompt
after a given chunk, the chunk continuing a given one, the chunks whose tokens start with the
prompt's tokens at some position. Tiers and budgets are the :class:`ChunkStore`'s business.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

from kvboost_hf.store.keys import Key, chunk_key

# Content lookups anchor on this many tokens at the start of every stored chunk (and one token
# later, so a tokenizer that merges a document's first token with the text before it costs
# only that token).
ANCHOR_TOKENS = 8
ANCHOR_OFFSETS = (0, 1)

Match = tuple[Key, int, int]
"""``(key, offset, tokens)``: tokens ``[offset, offset + tokens)`` of chunk ``key`` match."""


@dataclass
class IndexEntry:
    """A known chunk: enough to walk chains and match tokens without its tensors."""

    parent: Key
    namespace: Key
    token_ids: tuple[int, ...]
    bits: int | None = None


@dataclass(frozen=True)
class ChainTail:
    """New chunks at the end of a stored chain: their ``keys`` (in order), ``context`` tokens just before
    them (from chunks already seen) and their ``token_ids``."""

    keys: tuple[Key, ...]
    context: tuple[int, ...]
    token_ids: tuple[int, ...]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _anchor_keys(namespace: Key, token_ids: tuple[int, ...]) -> Iterator[tuple[tuple, int]]:
    for offset in ANCHOR_OFFSETS:
        if len(token_ids) >= offset + ANCHOR_TOKENS:
            yield (namespace, token_ids[offset : offset + ANCHOR_TOKENS]), offset


class ChunkIndex:
    """Chunks by key, by ``(parent, first token)`` and by ``(namespace, anchor tokens)``. Not thread safe."""

    def __init__(self) -> None:
        self._entries: dict[Key, IndexEntry] = {}
        self._children: dict[Key, dict[int, set[Key]]] = {}  # parent -> first token -> keys
        self._anchors: dict[tuple, set[tuple[Key, int]]] = {}  # (namespace, tokens) -> (key, offset)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._entries))

    def get(self, key: Key) -> IndexEntry | None:
        return self._entries.get(key)

    def add(self, key: Key, entry: IndexEntry) -> None:
        if key in self._entries:
            return
        self._entries[key] = entry
        self._children.setdefault(entry.parent, {}).setdefault(entry.token_ids[0], set()).add(key)
        for anchor, offset in _anchor_keys(entry.namespace, entry.token_ids):
            self._anchors.setdefault(anchor, set()).add((key, offset))

    def remove(self, key: Key) -> list[Key]:
        """Drop ``key``; returns its children (the caller decides what happens to them)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            for anchor, offset in _anchor_keys(entry.namespace, entry.token_ids):
                group = self._anchors.get(anchor)
                if group is not None:
                    group.discard((key, offset))
                    if not group:
                        del self._anchors[anchor]
            by_first = self._children.get(entry.parent, {})
            group = by_first.get(entry.token_ids[0])
            if group is not None:
                group.discard(key)
                if not group:
                    del by_first[entry.token_ids[0]]
            if not by_first:
                self._children.pop(entry.parent, None)
        children = [child for group in self._children.pop(key, {}).values() for child in group]
        return children

    def has_children(self, key: Key) -> bool:
        return bool(self._children.get(key))

    def chains(self, namespace: Key, skip: Container[Key] = ()) -> Iterator[tuple[Key, tuple[int, ...]]]:
        """``(last key, token ids)`` of every chain of ``namespace`` that no known chunk continues (but
        those ending in a key in ``skip``)."""
        for key, entry in self._entries.items():
            if entry.namespace != namespace or key in skip or self.has_children(key):
                continue
            parts, node = [], entry
            while node is not None:
                parts.append(node.token_ids)
                node = self._entries.get(node.parent)
            yield key, tuple(t for part in reversed(parts) for t in part)

    def chain_tails(self, namespace: Key, known: Container[Key], context: int) -> Iterator[ChainTail]:
        """The part of every leaf chain of ``namespace`` after its last chunk in ``known`` (whole chains when
        none is), oldest chain first, with up to ``context`` tokens of the known chunk before it."""
        for key, entry in self._entries.items():
            if entry.namespace != namespace or key in known or self.has_children(key):
                continue
            keys, parts, node = [], [], entry
            while node is not None:
                keys.append(key)
                parts.append(node.token_ids)
                key = node.parent
                node = self._entries.get(key)
                if node is not None and key in known:
                    before = node.token_ids[len(node.token_ids) - context:] if context else ()
                    break
            else:
                before = ()
            yield ChainTail(tuple(reversed(keys)), tuple(before), tuple(t for part in reversed(parts) for t in part))

    def siblings(self, parent: Key, first_token: int) -> list[Key]:
        """Chunks after ``parent`` that start with ``first_token``."""
        return list(self._children.get(parent, {}).get(first_token, ()))

    def has_longer_sibling(self, parent: Key, toks: tuple[int, ...]) -> bool:
        """Whether a chunk after ``parent`` starts with all of ``toks`` (and maybe more)."""
        for key in self.siblings(parent, toks[0]):
            other = self._entries[key].token_ids
            if len(other) >= len(toks) and other[: len(toks)] == toks:
                return True
        return False

    # ------------------------------------------------------------------ matching
    def continuation(self, previous: Key, ids: tuple[int, ...], pos: int) -> Match | None:
        """The chunk after ``previous`` matching the most of ``ids[pos:]``."""
        best = None
        for key in self.siblings(previous, ids[pos]):
            n = common_prefix_length(self._entries[key].token_ids, ids[pos:])
            if best is None or n > best[2]:
                best = (key, 0, n)
        return best

    def anchored(self, namespace: Key, ids: tuple[int, ...], pos: int, min_tokens: int) -> Match | None:
        """The chunk whose tokens (from an anchor offset) match the most of ``ids[pos:]``, wherever it was stored."""
        best = None
        for key, offset in self._anchors.get((namespace, ids[pos : pos + ANCHOR_TOKENS]), ()):
            tokens = self._entries[key].token_ids
            n = common_prefix_length(tokens[offset:], ids[pos:])
            if n >= min(min_tokens, len(tokens) - offset) and (best is None or n > best[2]):
                best = (key, offset, n)
        return best

    def match_path(self, parent: Key, ids: tuple[int, ...], chunk_size: int, pos: int = 0,
                   budget: list[int] | None = None) -> list[tuple[Key, int]]:
        """The chain of known chunks after ``parent`` covering the most of ``ids[pos:]``, as ``(key, tokens used)``.

        Chunkings differ between sequences (segment boundaries), so where several stored
        chunks match a position, each complete match is followed and the longest total wins
        (at most ``budget[0]`` branch explorations per lookup, 64 by default).
        """
        budget = [64] if budget is None else budget
        path: list[tuple[Key, int]] = []
        limit = len(ids)
        while pos < limit:
            key = chunk_key(parent, ids[pos : pos + chunk_size]) if pos + chunk_size <= limit else None
            if key is not None and key in self._entries:
                path.append((key, chunk_size))
                parent, pos = key, pos + chunk_size
                continue
            candidates = []
            for child in self.siblings(parent, ids[pos]):
                tokens = self._entries[child].token_ids
                n = common_prefix_length(tokens, ids[pos:])
                candidates.append((n == len(tokens) and pos + n < limit, n, child))
            if not candidates:
                break
            candidates.sort(key=lambda c: c[1], reverse=True)
            if len(candidates) == 1 or budget[0] <= 0:
                follow, n, child = candidates[0]
                path.append((child, n))
                if not follow:
                    break
                parent, pos = child, pos + n
                continue
            best: list[tuple[Key, int]] = []
            for follow, n, child in candidates:
                budget[0] -= 1
                option = [(child, n)] + (self.match_path(child, ids, chunk_size, pos + n, budget) if follow else [])
                if sum(u for _, u in option) > sum(u for _, u in best):
                    best = option
            path.extend(best)
            break
        return path
