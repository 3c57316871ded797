"""``warm``: fill a store with the K/V of a system prompt, documents or any token sequence ahead of requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cache import ChunkReuseCache
from .generate import finish_request
from .reuse import _target, disable_chunk_reuse, enable_chunk_reuse, is_chunk_reuse_enabled
from .state import reuse_state
from .store import ChunkStore
from .telemetry import ReuseStats


def warm(
    model: torch.nn.Module,
    input_ids_or_text: str | Sequence[int] | torch.Tensor | Sequence[str] | None = None,
    store: ChunkStore | None = None,
    tokenizer=None,
    pin: bool = False,
    *,
    documents: Sequence[str | Sequence[int]] | None = None,
) -> ReuseStats:
    """Prefill ``store`` with the K/V of a text or token sequence (one forward, no generation).

    Text is tokenized with ``tokenizer`` exactly as a prompt would be (special tokens added),
    so a warmed system prompt is a prefix of later prompts that start with it; its chunks start
    right after the leading special tokens, so the text is also found by content wherever it
    later appears (with a ``recompute_strategy``). ``documents=[...]`` (or a list of strings)
    warms each document as a segment of its own. ``pin=True`` makes the store evict these
    chunks last. ``store`` defaults to the store reuse is enabled with on ``model``.
    Returns the stats summed over everything warmed.
    """
    target = _target(model)
    if store is None:
        state = reuse_state(target)
        if state is None:
            raise ValueError("warm() needs store=: pass the ChunkStore to fill, or enable_chunk_reuse(model, store) first")
        store = state.store
    if documents is None and isinstance(input_ids_or_text, (list, tuple)) and input_ids_or_text \
            and isinstance(input_ids_or_text[0], str):
        documents = input_ids_or_text
    if documents is not None:
        total = ReuseStats()
        for document in documents:
            stats = warm(model, document, store, tokenizer=tokenizer, pin=pin)
            total.prompt_tokens += stats.prompt_tokens
            total.reused_tokens += stats.reused_tokens
            total.exact_tokens += stats.exact_tokens
            total.recomputed_tokens += stats.recomputed_tokens
            total.stored_chunks += stats.stored_chunks
            total.lookup_ms += stats.lookup_ms
        return total
    if isinstance(input_ids_or_text, str):
        if tokenizer is None:
            raise ValueError("warm() got text: pass tokenizer= to tokenize it, or pass token ids")
        ids = tokenizer(input_ids_or_text, return_tensors="pt")["input_ids"]
    elif input_ids_or_text is None:
        raise ValueError("warm() needs a text, token ids, or documents=[...]")
    else:
        ids = torch.as_tensor(input_ids_or_text, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"warm() needs one non-empty token sequence, got shape {tuple(ids.shape)}")
    ids = ids.to(target.device)
    installed_here = not is_chunk_reuse_enabled(target)
    if installed_here:
        enable_chunk_reuse(target, store)
    try:
        state = reuse_state(target)
        cache = ChunkReuseCache(target.config, store)
        with torch.no_grad():
            target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        finish_request(state, cache, pin=pin)
    finally:
        if installed_here:
            disable_chunk_reuse(target)
    return cache.stats
