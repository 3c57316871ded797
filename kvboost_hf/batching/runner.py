"""Executes a step's forwards: prompt chunks of prefilling rows, one batched decode of the others."""

from __future__ import annotations

import torch

from ..cache import ChunkReuseCache
from ..generate import finish_request
from ..reuse import _target
from ..state import reuse_state
from .prefill import new_row_cache, start_prefill
from .rows_cache import PaddedRowsCache, decode_masks
from .sequence import Sequence


class BatchRunner:
    """Runs ``model`` for sequences: their store lookup, prefill chunks and batched decode steps."""

    def __init__(self, model, store=None) -> None:
        self.model = _target(model)
        self.store = store
        self.device = self.model.device
        self.dtype = next(self.model.parameters()).dtype
        decode_masks_check(self.model.config)

    def start(self, seq: Sequence) -> None:
        """Give ``seq`` its own cache and load what the store holds of its prompt."""
        cache = new_row_cache(self.model, self.store)
        seq.start(cache, start_prefill(self.model, cache, seq.prompt_ids))

    def prefill(self, seq: Sequence, n: int) -> torch.Tensor | None:
        """Forward ``n`` more prompt tokens of ``seq``; the prompt's last logits once it is all in."""
        return seq.prefill.run(n)

    def decode(self, rows: list[Sequence]) -> torch.Tensor:
        """One forward of every row's latest token; returns ``[len(rows), vocab]`` logits."""
        caches = [seq.cache for seq in rows]
        masks = decode_masks(self.model.config, caches, self.dtype, self.device)
        ids = torch.tensor([[seq.feed_token()] for seq in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[seq.position] for seq in rows], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=masks.attention_mask,
                             past_key_values=PaddedRowsCache(caches, masks), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]


    def finish(self, seq: Sequence) -> int:
        """Store the confirmed K/V of a finished (or cancelled) ``seq``; returns the chunks stored."""
        state, cache = reuse_state(self.model), seq.cache
        if state is None or not isinstance(cache, ChunkReuseCache) or cache.request is None:
            return 0
        finish_request(state, cache)
        return cache.stats.stored_chunks if cache.stats is not None else 0


def decode_masks_check(config) -> None:
    """Raise ``ValueError`` early when the model's attention cannot take the decode masks."""
    from .rows_cache import MASKED_ATTENTION

    if config._attn_implementation not in MASKED_ATTENTION:
        raise ValueError(f"batched decoding needs attn_implementation in {MASKED_ATTENTION} "
                         f"(load the model with attn_implementation='sdpa'), got {config._attn_implementation!r}")
