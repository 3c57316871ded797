"""Storing what a request confirmed."""

from __future__ import annotations

from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.reuse.state import ReuseState


def commit_request(state: ReuseState, cache: ChunkReuseCache, pin: bool = False) -> None:
    """Store the confirmed K/V of ``cache`` (chunked at the state's segment boundaries) and publish its
    stats as the model's latest."""
    ids = cache.token_ids() if cache.trackable else []
    stored = cache.commit(pin=pin, boundaries=state.boundaries(ids, cache.segments))
    if cache.stats is not None:
        cache.stats.stored_chunks = stored
        state.last_stats = cache.stats
