"""Executes a step's forwards: batched prompt chunks, one batched decode of the decoding rows."""

from __future__ import annotations

import torch

from ..cache import ChunkReuseCache
from ..generate import finish_request
from ..reuse import _target
from ..state import reuse_state
from .prefill import new_row_cache, start_prefill
from .rows_cache import PaddedRowsCache, check_attention, row_masks
from .sequence import Sequence


class BatchRunner:
    """Runs ``model`` for sequences: their store lookup, prefill chunks, batched decode steps, commit."""

    def __init__(self, model, store=None) -> None:
        self.model = _target(model)
        self.store = store
        self.device = self.model.device
        self.dtype = next(self.model.parameters()).dtype
        check_attention(self.model.config)

    def start(self, seq: Sequence) -> None:
        """Give ``seq`` its own cache and load what the store holds of its prompt."""
        cache = new_row_cache(self.model, self.store)
        seq.start(cache, start_prefill(self.model, cache, seq.prompt_ids))

    def prefill(self, seqs: list[Sequence], chunks: list[int]) -> list[torch.Tensor | None]:
        """Forward ``chunks[i]`` more prompt tokens of each of ``seqs`` in one batched forward (a
        scattered CacheBlend prefill runs alone); per row, the prompt's last logits once it is all in."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        batched = []
        for i, (seq, n) in enumerate(zip(seqs, chunks)):
            if seq.prefill.scattered:
                out[i] = seq.prefill.run(n)
            else:
                batched.append(i)
        if batched:
            taken = [seqs[i].prefill.take(chunks[i]) for i in batched]
            ends = [last for _, _, last in taken]
            logits = self._forward([seqs[i].cache for i in batched], [ids for ids, _, _ in taken],
                                   [start for _, start, _ in taken], lm_head=any(ends))
            for k, (i, last) in enumerate(zip(batched, ends)):
                out[i] = logits[k] if last else None
        return out

    def decode(self, rows: list[Sequence]) -> torch.Tensor:
        """One forward of every row's latest token; returns ``[len(rows), vocab]`` logits."""
        ids = [torch.tensor([seq.feed_token()]) for seq in rows]
        return self._forward([seq.cache for seq in rows], ids, [seq.position for seq in rows])

    def finish(self, seq: Sequence) -> int:
        """Store the confirmed K/V of a finished (or cancelled) ``seq``; returns the chunks stored."""
        state, cache = reuse_state(self.model), seq.cache
        if state is None or not isinstance(cache, ChunkReuseCache) or cache.request is None:
            return 0
        finish_request(state, cache)
        return cache.stats.stored_chunks if cache.stats is not None else 0

    def _forward(self, caches: list, ids: list[torch.Tensor], starts: list[int],
                 lm_head: bool = True) -> torch.Tensor | None:
        """One forward of ``ids[b]`` (1D) at positions ``starts[b]``... for each row's cache, left-padded;
        the logits of each row's last token, ``[rows, vocab]`` (None without ``lm_head``: only the
        decoder runs, for prompt chunks that end no prompt)."""
        new = [int(t.numel()) for t in ids]
        width = max(new)
        input_ids = torch.zeros(len(ids), width, dtype=torch.long, device=self.device)
        positions = torch.zeros(len(ids), width, dtype=torch.long, device=self.device)
        for b, (t, start) in enumerate(zip(ids, starts)):
            input_ids[b, width - new[b] :] = t.to(self.device)
            positions[b] = torch.arange(start - (width - new[b]), start + new[b], device=self.device).clamp(min=0)
        masks = row_masks(self.model.config, caches, new, self.dtype, self.device)
        kwargs = dict(input_ids=input_ids, position_ids=positions, attention_mask=masks.attention_mask,
                      past_key_values=PaddedRowsCache(caches, masks), use_cache=True)
        with torch.no_grad():
            if not lm_head:
                self.model.base_model(**kwargs)
                return None
            return self.model(**kwargs, logits_to_keep=1).logits[:, -1]
