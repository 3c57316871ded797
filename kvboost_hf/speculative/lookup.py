"""Lookup drafts: continuations of n-grams seen in this request (prompt lookup) or anywhere in the store.

A store-wide index is built from the token ids of the chains a :class:`~kvboost_hf.ChunkStore`
holds under the target's namespace (every stored prompt and reply, in any tier), one index per
``(store, namespace)``, refreshed with the chains added since at the start of each request.
Drafts are deterministic, so HF's verification (greedy match, or sampling from the target and
keeping candidates while they agree) returns exactly the target's distribution.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import torch

from kvboost_hf.speculative.ngram import LookupSettings, NgramIndex, Proposal
from kvboost_hf.store import ChunkStore
from kvboost_hf.store.keys import Key

STORE_LOOKUP = LookupSettings(max_ngram=6, min_ngram=2)  # one shared token says little across requests
# What one indexed token costs in Python objects: an n-gram tuple key, a dict slot and a position per n-gram
# size (5 here), plus the token in its sequence list. Measured with tracemalloc (test_lookup.py checks it).
BYTES_PER_INDEXED_TOKEN = 1000
INDEX_SHARE = 0.05  # the index may hold at most this share of the store's max_bytes, beyond it
MAX_INDEXED_TOKENS = 1_000_000

_indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> {namespace: StoreNgrams}
_indexes_lock = threading.Lock()


def index_token_budget(store: ChunkStore) -> int:
    """How many tokens the store-wide index of ``store`` may hold: ``INDEX_SHARE`` of its ``max_bytes``."""
    return max(1, min(MAX_INDEXED_TOKENS, int(store.max_bytes * INDEX_SHARE) // BYTES_PER_INDEXED_TOKEN))


class StoreNgrams:
    """The n-gram index of one namespace's stored chains, refreshed incrementally and bounded in size.

    Each refresh indexes only the chunks stored since the last one (a chain extended by a later turn
    adds its new chunks, with a few tokens before them so n-grams across the seam are found; the part
    indexed before is not indexed again). Evicted chains stay indexed (drafts are only ever verified)
    until the index would pass ``max_tokens``; then it is rebuilt from the newest chains the store
    holds, up to ``max_tokens``.
    """

    def __init__(self, settings: LookupSettings = STORE_LOOKUP, max_tokens: int = MAX_INDEXED_TOKENS) -> None:
        self.settings, self.max_tokens = settings, max_tokens
        self.index = NgramIndex(settings)
        self.known: set[Key] = set()  # chunk keys indexed
        self.tokens = 0
        self.purges = 0  # the store's purge count when last refreshed: a purge rebuilds the index
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Estimated memory of the index (``BYTES_PER_INDEXED_TOKEN`` per indexed token)."""
        return self.tokens * BYTES_PER_INDEXED_TOKEN

    def refresh(self, store: ChunkStore, namespace: Key) -> None:
        """Index the chunks stored since the last refresh, rebuilding if the index would grow too large."""
        context = self.settings.max_ngram
        with self.lock:
            if store.purges != self.purges:  # purged text must never be proposed again
                self.purges = store.purges
                self.index, self.known, self.tokens = NgramIndex(self.settings), set(), 0
            tails = store.chain_tails(namespace, self.known, context)
            if self.tokens + sum(len(t.context) + len(t.token_ids) for t in tails) > self.max_tokens:
                tails = self._newest(store.chain_tails(namespace, (), 0))
                self.index, self.known, self.tokens = NgramIndex(self.settings), set(), 0
            for tail in tails:
                self.index.add_sequence(tail.context + tail.token_ids)
                self.known.update(tail.keys)
                self.tokens += len(tail.context) + len(tail.token_ids)

    def _newest(self, chains: list) -> list:
        """The newest whole chains that fit ``max_tokens`` (oldest first); a chain too long keeps its end."""
        kept, total = [], 0
        for tail in reversed(chains):
            room = self.max_tokens - total
            if room <= 0:
                break
            if len(tail.token_ids) > room:
                tail = type(tail)(tail.keys, (), tail.token_ids[len(tail.token_ids) - room:])
            kept.append(tail)
            total += len(tail.token_ids)
        return kept[::-1]

    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal | None:
        with self.lock:
            return self.index.propose(context, max_tokens)


def store_ngrams(store: ChunkStore, namespace: Key) -> StoreNgrams:
    """The (shared, refreshed) store-wide index of ``namespace`` in ``store``."""
    with _indexes_lock:
        per_store = _indexes.setdefault(store, {})
        index = per_store.get(namespace)
        if index is None:
            index = per_store[namespace] = StoreNgrams(max_tokens=index_token_budget(store))
    index.refresh(store, namespace)
    return index


class LazyStoreNgrams:
    """The store-wide index, found and refreshed at the first proposal (after the first token, not before)."""

    def __init__(self, find: Callable[[], StoreNgrams | None]) -> None:
        self._find, self._index, self._found = find, None, False

    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal | None:
        if not self._found:
            self._index, self._found = self._find(), True
        return None if self._index is None else self._index.propose(context, max_tokens)


class LookupProposer:
    """Proposes the continuation of the longest n-gram match in the request so far, or in the store.

    The longer match wins; on a tie, the request's own text. Drafts stop after an EOS token.
    """

    def __init__(self, settings: LookupSettings, store_index: StoreNgrams | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.name = "store" if store_index is not None else "prompt-lookup"
        self.context = NgramIndex(settings)
        self.store_index = store_index
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.source_counts = {"request": 0, "store": 0}

    def unseen(self, input_ids: torch.LongTensor) -> int:
        return 0  # lookups read the tokens themselves: nothing to catch up

    def propose(self, input_ids: torch.LongTensor, k: int) -> tuple[torch.LongTensor, None]:
        ids = input_ids[0].tolist()
        known = sum(len(s) for s in self.context.sequences)
        self.context.extend(ids[known:])
        best = self.context.propose(ids, k)
        source = "request"
        if self.store_index is not None:
            other = self.store_index.propose(ids, k)
            if other is not None and other.tokens and (best is None or other.ngram > best.ngram or not best.tokens):
                best, source = other, "store"
        if best is None or not best.tokens:
            return input_ids, None
        tokens = _cut_after_eos(best.tokens, self.eos)
        self.source_counts[source] += 1
        draft = torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, draft], dim=1), None

    def update(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        pass

    def finish(self, sequence: torch.LongTensor) -> None:
        pass


def _cut_after_eos(tokens: tuple[int, ...], eos: frozenset[int]) -> tuple[int, ...]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
