"""A prompt's store lookup and its chunked prefill, for one request's own cache.

:func:`start_prefill` runs the reuse hook's own request start on the whole prompt (exact and
approximate lookup, repair, stats: what ``generate``'s first forward does), leaving the
uncached tail to forward. :meth:`PromptPrefill.take` hands out the next tail tokens for a
batched forward (:class:`~kvboost_hf.batching.runner.BatchRunner`); :meth:`PromptPrefill.run`
forwards a scattered (CacheBlend) tail alone, all at once. The hook never runs again for these
forwards (the tail's tokens are already tracked).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from transformers import DynamicCache

from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.models import attention
from kvboost_hf.models.target import target_model
from kvboost_hf.reuse import reuse_state, start_request
from kvboost_hf.reuse.repair.base import in_inner_forward, inner_forward

logger = logging.getLogger(__name__)


def new_row_cache(model, store) -> DynamicCache:
    """A fresh per-request cache: a ChunkReuseCache when reuse is on (and a store is given)."""
    target = target_model(model)
    if store is not None and reuse_state(target) is not None:
        return ChunkReuseCache(target.config, store)
    return DynamicCache(config=target.config)


class PromptPrefill:
    """The part of one prompt still to forward, and the forwards that do it."""

    def __init__(self, model, cache: DynamicCache, tail: torch.Tensor, positions: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> None:
        self.model = target_model(model)
        self.cache = cache
        self.tail = tail  # [1, n] token ids still to forward
        self.positions = positions  # [1, n] their positions
        self.attention_mask = attention_mask  # only for a scattered (CacheBlend) forward: all of it at once
        self.done = 0

    @property
    def scattered(self) -> bool:
        return self.attention_mask is not None

    @property
    def remaining(self) -> int:
        return self.tail.shape[1] - self.done

    def take(self, n: int) -> tuple[torch.Tensor, int, bool]:
        """The next ``n`` tail tokens (1D), the position of the first, and whether they end the prompt;
        the caller forwards them (batched with other rows). Not for scattered prefills."""
        if self.scattered:
            raise RuntimeError("a scattered (CacheBlend) prefill runs in one forward: use run()")
        n = max(1, min(n, self.remaining))
        ids = self.tail[0, self.done : self.done + n]
        start = int(self.positions[0, self.done])
        self.done += n
        return ids, start, self.done == self.tail.shape[1]

    def run(self, n: int) -> torch.Tensor | None:
        """Forward the next ``n`` tail tokens (all of them when scattered); the last token's logits
        (``[vocab]``) when this finished the prompt, else None."""
        n = self.remaining if self.scattered else max(1, min(n, self.remaining))
        ids = self.tail[:, self.done : self.done + n]
        positions = self.positions[:, self.done : self.done + n]
        last = self.done + n == self.tail.shape[1]
        kwargs = dict(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
        if self.scattered:
            kwargs["attention_mask"] = self.attention_mask
        with torch.no_grad(), inner_forward() if not in_inner_forward() else contextlib.nullcontext():
            try:
                if last:
                    logits = self.model(**kwargs, logits_to_keep=1).logits[0, -1]
                else:
                    self.model.base_model(**kwargs)
                    logits = None
            finally:
                if self.scattered:
                    attention.set_scattered_queries(None)
                    self.cache.end_blend()
        self.done += n
        return logits


def start_prefill(model, cache: DynamicCache, prompt_ids: list[int]) -> PromptPrefill:
    """Look ``prompt_ids`` up in the store (when ``cache`` is a ChunkReuseCache on a reuse-enabled
    model), load what is reused into ``cache``, and return what is left to forward."""
    target = target_model(model)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=target.device)
    positions = torch.arange(len(prompt_ids), device=target.device)[None, :]
    state = reuse_state(target)
    if state is None or not isinstance(cache, ChunkReuseCache):
        return PromptPrefill(target, cache, input_ids, positions)
    kwargs = dict(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                  attention_mask=torch.ones_like(input_ids))
    start_request(target, state, cache, input_ids, kwargs)  # the hook's own lookup, load and repair
    tail = kwargs["input_ids"]
    start = len(prompt_ids) - tail.shape[1]
    tail_positions = kwargs.get("position_ids")
    if tail_positions is None:
        tail_positions = torch.arange(start, len(prompt_ids), device=target.device)[None, :]
    return PromptPrefill(target, cache, tail, tail_positions, kwargs["attention_mask"] if cache.blending else None)
