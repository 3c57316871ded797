"""Executes a step's forwards: every decoding row's latest token and the step's prompt chunks."""

from __future__ import annotations

import torch

from kvboost_hf.batching.packed import PACKED_ATTENTION, PackedRowsCache, packed_forward
from kvboost_hf.batching.prefill import new_row_cache, start_prefill
from kvboost_hf.batching.rows_cache import PaddedRowsCache, check_attention, row_masks
from kvboost_hf.batching.scheduler import group_chunks
from kvboost_hf.batching.sequence import Sequence
from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.models import attention
from kvboost_hf.models.attention import attention_implementation
from kvboost_hf.models.target import target_model
from kvboost_hf.reuse import commit_request, reuse_state


class BatchRunner:
    """Runs ``model`` for sequences: their store lookup, batched steps, commit.

    With SDPA attention a step is **one packed forward** (:mod:`.packed`): decode tokens and
    prompt chunks side by side, no padding, each row attending to its own cache. With eager
    attention a step is a padded decode forward plus padded prompt-chunk forwards
    (:mod:`.rows_cache`). The packed form switches the model's attention to ``kvboost_sdpa``
    once and keeps it (:func:`kvboost_hf.models.attention.use_kvboost_sdpa`: stock SDPA outside a
    routed forward; the config is shared with other threads, so no step puts it back).
    """

    def __init__(self, model, store=None) -> None:
        self.model = target_model(model)
        self.store = store
        self.device = self.model.device
        self.dtype = next(self.model.parameters()).dtype
        check_attention(self.model.config)
        if self.packed:
            attention.use_kvboost_sdpa(self.model)

    @property
    def packed(self) -> bool:
        return attention_implementation(self.model.config) in PACKED_ATTENTION

    def start(self, seq: Sequence) -> None:
        """Give ``seq`` its own cache and load what the store holds of its prompt."""
        cache = new_row_cache(self.model, self.store)
        if isinstance(cache, ChunkReuseCache):
            cache.scope = seq.scope
        seq.start(cache, start_prefill(self.model, cache, seq.prompt_ids))

    def step(self, decoding: list[Sequence], prefilling: list[Sequence] = (),
             chunks: list[int] = ()) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Forward the latest token of every ``decoding`` row and ``chunks[i]`` more prompt tokens of
        ``prefilling[i]``. Returns the decoding rows' next-token logits (``[rows, vocab]``, None
        without decoding rows) and, per prefilling row, its prompt's last logits (``[vocab]``) when
        this chunk finished the prompt, else None. A scattered (CacheBlend) prefill runs alone."""
        check_attention(self.model.config)
        ends: list[torch.Tensor | None] = [None] * len(prefilling)
        batched = []
        for i, (seq, n) in enumerate(zip(prefilling, chunks)):
            if n <= 0:
                continue
            if seq.prefill.scattered:
                ends[i] = seq.prefill.run(n)
            else:
                batched.append(i)
        if not self.packed:
            return self._padded_step(decoding, [prefilling[i] for i in batched], [chunks[i] for i in batched],
                                     batched, ends)
        caches = [seq.cache for seq in decoding]
        ids = [torch.tensor([seq.feed_token()]) for seq in decoding]
        starts = [seq.position for seq in decoding]
        wanted = [True] * len(decoding)
        for i in batched:
            chunk, start, last = prefilling[i].prefill.take(chunks[i])
            caches.append(prefilling[i].cache)
            ids.append(chunk)
            starts.append(start)
            wanted.append(last)
        if not caches:
            return None, ends
        logits = self._packed_forward(caches, ids, starts, wanted)
        rows = iter(logits) if logits is not None else iter(())
        decoded = torch.stack([next(rows) for _ in decoding]) if decoding else None
        for i, last in zip(batched, wanted[len(decoding):]):
            ends[i] = next(rows) if last else None
        return decoded, ends

    def decode(self, rows: list[Sequence]) -> torch.Tensor:
        """One forward of every row's latest token; returns ``[len(rows), vocab]`` logits."""
        return self.step(rows)[0]

    def prefill(self, seqs: list[Sequence], chunks: list[int]) -> list[torch.Tensor | None]:
        """Forward ``chunks[i]`` more prompt tokens of each of ``seqs``; per row, the prompt's last
        logits once it is all in."""
        return self.step([], seqs, chunks)[1]

    @property
    def shares_prefills(self) -> bool:
        """Whether rows can reuse each other's prompts through the store (reuse on, a store given)."""
        return self.store is not None and reuse_state(self.model) is not None

    def in_flight(self, prefilling: list[Sequence]) -> list[tuple[list[int], int]]:
        """Each exact prefilling row's prompt and how many of its first tokens it loaded from the store
        (a scattered, CacheBlend row is left out: what it computes is not stored as an exact prefix)."""
        return [(seq.prompt_ids, len(seq.prompt_ids) - seq.prefill.tail.shape[1])
                for seq in prefilling if seq.prefill is not None and not seq.prefill.scattered]

    def publish(self, seq: Sequence) -> int:
        """Store ``seq``'s prompt K/V as soon as its prefill ended, so rows waiting on it reuse it (what
        :meth:`finish` stores later is only the rest); returns the chunks stored."""
        state, cache = reuse_state(self.model), seq.cache
        if state is None or not isinstance(cache, ChunkReuseCache) or cache.request is None or not cache.trackable:
            return 0
        stored = cache.commit(boundaries=state.boundaries(cache.token_ids(), cache.segments))
        seq.published += stored
        return stored

    def finish(self, seq: Sequence) -> int:
        """Store the confirmed K/V of a finished (or cancelled) ``seq``; returns the chunks it stored (those
        :meth:`publish` stored included)."""
        state, cache = reuse_state(self.model), seq.cache
        if state is None or not isinstance(cache, ChunkReuseCache) or cache.request is None:
            return 0
        commit_request(state, cache)
        if cache.stats is None:
            return seq.published
        cache.stats.stored_chunks += seq.published
        return cache.stats.stored_chunks

    # ------------------------------------------------------------------ packed (SDPA)
    def _packed_forward(self, caches: list, ids: list[torch.Tensor], starts: list[int],
                        wanted: list[bool]) -> list[torch.Tensor] | None:
        """One ``[1, tokens]`` forward of every row's ``ids`` at positions ``starts[b]``...; the logits
        of the last token of each row with ``wanted[b]`` (None when no row wants any: decoder only)."""
        new = [int(t.numel()) for t in ids]
        input_ids = torch.cat([t.reshape(-1) for t in ids]).to(self.device)[None]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, new)]).to(self.device)[None]
        last = torch.tensor(new).cumsum(0) - 1
        keep = last[torch.tensor(wanted, dtype=torch.bool)].to(self.device)
        cache = PackedRowsCache(caches, new)
        # A prepared 4D mask makes transformers skip building masks; packed attention ignores it.
        placeholder = torch.ones(1, 1, input_ids.shape[1], 1, dtype=torch.bool, device=self.device)
        kwargs = dict(input_ids=input_ids, position_ids=positions, attention_mask=placeholder,
                      past_key_values=cache, use_cache=True)
        if not attention.use_kvboost_sdpa(self.model):  # e.g. set back to "eager" since the last step
            raise RuntimeError(f"packed forward needs SDPA attention, the model now runs "
                               f"{attention_implementation(self.model.config)!r}")
        with torch.no_grad(), packed_forward(cache):
            if not keep.numel():
                self.model.base_model(**kwargs)
                return None
            return list(self.model(**kwargs, logits_to_keep=keep).logits[0])

    # ------------------------------------------------------------------ padded (eager)
    def _padded_step(self, decoding: list[Sequence], prefilling: list[Sequence], chunks: list[int],
                     indices: list[int], ends: list) -> tuple[torch.Tensor | None, list]:
        decoded = None
        if decoding:
            ids = [torch.tensor([seq.feed_token()]) for seq in decoding]
            decoded = self._padded_forward([seq.cache for seq in decoding], ids, [seq.position for seq in decoding])
        for group in group_chunks(chunks):
            taken = [prefilling[k].prefill.take(chunks[k]) for k in group]
            last = [end for _, _, end in taken]
            logits = self._padded_forward([prefilling[k].cache for k in group], [t for t, _, _ in taken],
                                          [s for _, s, _ in taken], lm_head=any(last))
            for j, k in enumerate(group):
                ends[indices[k]] = logits[j] if last[j] else None
        return decoded, ends

    def _padded_forward(self, caches: list, ids: list[torch.Tensor], starts: list[int],
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
