"""Token log-probabilities: the model's own log-softmax, in float32, for generated and prompt tokens.

Generated tokens: the raw logits generate returns (``output_logits=True``), before any logits
processor, temperature or grammar mask, so a logprob is the model's and not the sampler's.
Prompt tokens (``echo`` with ``logprobs``), with reuse on and ``top_logprobs`` 0: the logprobs
the store keeps with its chunks are served from there, and only the rest of the prompt runs, as
the tail of a forward whose prefix K/V come from the store; the logprobs found are then kept with
the prompt's stored chunks for the next request. ``top_logprobs`` > 0 over prompt tokens, a
lossy (quantized) store or reuse off: one full forward of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..cache import ChunkReuseCache
from ..generate import finish_request
from ..state import namespace, reuse_state
from ..store.keys import UnfingerprintableModel
from ..store.logprobs import attach_logprobs, stored_logprobs


@dataclass
class TokenLogprob:
    """A token, its log-probability (None for a prompt's first token) and the ``top`` (id, logprob) pairs."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


def logprobs_at(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """``logits[i]`` predicts ``token_ids[i]``: their logprobs and the ``top`` most likely tokens per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    out = [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen)]
    if top > 0:
        values, indices = logp.topk(top, dim=-1)
        for entry, vs, ix in zip(out, values.tolist(), indices.tolist()):
            entry.top = list(zip(ix, vs))
    return out


PROMPT_SLICE_TOKENS = 256  # prompt positions scored per forward: logits [256, vocab] (268 MB for Gemma's 262k)


def prompt_logprobs(model, prompt_ids: list[int], top: int, store=None,
                    slice_tokens: int = PROMPT_SLICE_TOKENS) -> list[TokenLogprob]:
    """Logprobs of every prompt token given the ones before it (the first has none).

    With ``store`` (reuse enabled on ``model``, lossless storage) and ``top`` 0, tokens whose
    logprobs the store keeps are not recomputed; see the module docstring. The prompt runs in
    slices of ``slice_tokens`` positions, so logits never cover the whole prompt at once.
    """
    first = TokenLogprob(prompt_ids[0], None)
    state = reuse_state(model) if store is not None else None
    ns = _namespace_or_none(model) if state is not None else None
    if top > 0 or ns is None or store.kv_bits is not None:
        entries = [first, *_score(model, prompt_ids, 1, top, DynamicCache(config=model.config), slice_tokens)]
        if ns is not None:
            attach_logprobs(store, ns, prompt_ids, [e.logprob for e in entries])
        return entries
    known = stored_logprobs(store, ns, prompt_ids)
    covered = max(len(known), 1)
    if covered < len(prompt_ids):
        fresh = _score_on_stored_prefix(model, state, store, prompt_ids, covered, slice_tokens)
        known = [first.logprob, *known[1:covered]] + [e.logprob for e in fresh]
        attach_logprobs(store, ns, prompt_ids, known)
    return [TokenLogprob(t, None if i == 0 else known[i]) for i, t in enumerate(prompt_ids)]


def _namespace_or_none(model):
    try:
        return namespace(model)
    except UnfingerprintableModel:
        return None


@torch.no_grad()
def _score(model, prompt_ids: list[int], covered: int, top: int, cache, slice_tokens: int) -> list[TokenLogprob]:
    """Logprobs of ``prompt_ids[covered:]`` (``covered`` >= 1), forwarding the prompt through ``cache`` in slices.

    The first forward holds ``prompt_ids[:end]`` and keeps the logits of positions ``covered - 1``
    on (a reuse cache loads the stored prefix before them and runs only the rest); each later
    forward continues the cache with the next slice.
    """
    n = len(prompt_ids)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    end = min(n, covered - 1 + slice_tokens)
    logits = model(input_ids=ids[:, :end], past_key_values=cache, use_cache=True,
                   logits_to_keep=end - covered + 1).logits[0]  # positions covered - 1 ... end - 1
    out = logprobs_at(logits[:-1], prompt_ids[covered:end], top)
    carry = logits[-1:]  # position end - 1 predicts token end
    while end < n:
        stop = min(n, end + slice_tokens)
        logits = model(input_ids=ids[:, end:stop], past_key_values=cache, use_cache=True).logits[0]
        out += logprobs_at(torch.cat([carry, logits[:-1]]), prompt_ids[end:stop], top)
        carry, end = logits[-1:], stop
    return out


def _score_on_stored_prefix(model, state, store, prompt_ids: list[int], covered: int,
                            slice_tokens: int) -> list[TokenLogprob]:
    """Logprobs of tokens ``covered...`` on the prefix K/V the store holds (exact hits only, else
    from scratch); the prompt's K/V are stored afterwards, as generate would."""
    cache = ChunkReuseCache(model.config, store)
    with torch.no_grad():
        out = _score(model, prompt_ids, covered, 0, cache, slice_tokens)
        stats = cache.stats
        if stats is None or stats.exact_tokens != stats.reused_tokens:  # never serve logprobs from lossy K/V
            return _score(model, prompt_ids, covered, 0, DynamicCache(config=model.config), slice_tokens)
    finish_request(state, cache)
    return out


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, entries: list[TokenLogprob], text_start: int = 0) -> dict:
    """The legacy completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets, position = [], text_start
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None and not e.top else {token_text(tokenizer, i): lp for i, lp in e.top}
            for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }
