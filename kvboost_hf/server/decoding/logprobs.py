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

from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.models.fingerprint import UnfingerprintableModel
from kvboost_hf.models.namespace import namespace
from kvboost_hf.planner.memory import SCORE_ROWS, SCORE_SLICES
from kvboost_hf.reuse import commit_request, reuse_state
from kvboost_hf.store.scope import CacheScope
from kvboost_hf.store.logprobs import attach_logprobs, stored_logprobs


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


# Prompt positions per forward by default (logits [256, vocab]: 256 MiB for Gemma's 262k, fp32; the memory
# planner picks a smaller slice when that does not fit), and rows of logits turned into logprobs at once.
PROMPT_SLICE_TOKENS = SCORE_SLICES[0]
LOGSOFTMAX_ROWS = SCORE_ROWS


class PromptLogprobs(list):
    """A prompt's :class:`TokenLogprob` entries, and ``cached_tokens``: prompt tokens the scoring
    did not forward (their K/V or logprobs came from the store)."""

    def __init__(self, entries=(), cached_tokens: int = 0) -> None:
        super().__init__(entries)
        self.cached_tokens = cached_tokens


def prompt_logprobs(model, prompt_ids: list[int], top: int, store=None,
                    slice_tokens: int = PROMPT_SLICE_TOKENS, scope: CacheScope | None = None) -> PromptLogprobs:
    """Logprobs of every prompt token given the ones before it (the first has none).

    With ``store`` (reuse enabled on ``model``, lossless storage) and ``top`` 0, tokens whose
    logprobs the store keeps are not recomputed; see the module docstring. The prompt runs in
    slices of ``slice_tokens`` positions and their logits become logprobs ``LOGSOFTMAX_ROWS``
    rows at a time, so at most one slice's logits are alive (the memory planner's
    ``score_bytes`` counts them).
    """
    first = TokenLogprob(prompt_ids[0], None)
    state = reuse_state(model) if store is not None else None
    scope = scope or CacheScope()
    ns = _namespace_or_none(model, scope) if state is not None else None
    if ns is not None and scope.owner is not None:
        store.follow_purges(scope.owner)  # logprobs the store holds whole never reach the reuse hook
    shared = scope.shared_root(namespace(model)) if ns is not None else None
    if top > 0 or ns is None or store.kv_bits is not None:
        entries = [first, *_score(model, prompt_ids, 1, top, DynamicCache(config=model.config), slice_tokens)]
        if ns is not None:
            attach_logprobs(store, ns, prompt_ids, [e.logprob for e in entries], shared=shared, owner=scope.owner)
        return PromptLogprobs(entries)
    known = stored_logprobs(store, ns, prompt_ids, shared=shared)
    covered = max(len(known), 1)
    cached = len(prompt_ids)  # all of them when the store holds every logprob: nothing is forwarded
    if covered < len(prompt_ids):
        fresh, cached = _score_on_stored_prefix(model, state, store, prompt_ids, covered, slice_tokens, scope)
        known = [first.logprob, *known[1:covered]] + [e.logprob for e in fresh]
        attach_logprobs(store, ns, prompt_ids, known, shared=shared, owner=scope.owner)
    return PromptLogprobs([TokenLogprob(t, None if i == 0 else known[i]) for i, t in enumerate(prompt_ids)], cached)


def _namespace_or_none(model, scope: CacheScope):
    try:
        return scope.root(namespace(model))
    except UnfingerprintableModel:
        return None


def _rows_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """:func:`logprobs_at` over ``logits[:len(token_ids)]``, ``LOGSOFTMAX_ROWS`` rows at a time (the same
    values: log-softmax is per row)."""
    out: list[TokenLogprob] = []
    for start in range(0, len(token_ids), LOGSOFTMAX_ROWS):
        stop = min(len(token_ids), start + LOGSOFTMAX_ROWS)
        out += logprobs_at(logits[start:stop], token_ids[start:stop], top)
    return out


@torch.no_grad()
def _score(model, prompt_ids: list[int], covered: int, top: int, cache, slice_tokens: int) -> list[TokenLogprob]:
    """Logprobs of ``prompt_ids[covered:]`` (``covered`` >= 1), forwarding the prompt through ``cache`` in slices.

    The first forward holds ``prompt_ids[:end]`` and keeps the logits of positions ``covered - 1``
    on (a reuse cache loads the stored prefix before them and runs only the rest); each later
    forward continues the cache with the next slice. The logits at position ``p`` score token
    ``p + 1``, which the prompt already holds, so a slice's logits are used up (and freed) before
    the next forward runs.
    """
    n = len(prompt_ids)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    end = min(n, covered - 1 + slice_tokens)
    logits = model(input_ids=ids[:, :end], past_key_values=cache, use_cache=True,
                   logits_to_keep=end - covered + 1).logits[0]  # positions covered - 1 ... end - 1
    out = _rows_logprobs(logits, prompt_ids[covered:end + 1], top)
    del logits
    while end < n:
        stop = min(n, end + slice_tokens)
        logits = model(input_ids=ids[:, end:stop], past_key_values=cache, use_cache=True).logits[0]
        out += _rows_logprobs(logits, prompt_ids[end + 1:stop + 1], top)  # positions end ... stop - 1
        del logits
        end = stop
    return out


def _score_on_stored_prefix(model, state, store, prompt_ids: list[int], covered: int,
                            slice_tokens: int, scope: CacheScope | None = None) -> tuple[list[TokenLogprob], int]:
    """Logprobs of tokens ``covered...`` on the prefix K/V the store holds (exact hits only, else
    from scratch), and how many prompt tokens were not forwarded; the prompt's K/V are stored
    afterwards, as generate would."""
    cache = ChunkReuseCache(model.config, store)
    cache.scope = scope
    with torch.no_grad():
        out = _score(model, prompt_ids, covered, 0, cache, slice_tokens)
        stats = cache.stats
        if stats is None or stats.exact_tokens != stats.reused_tokens:  # never serve logprobs from lossy K/V
            # From the first token: every forward stays one slice long (a DynamicCache loads nothing).
            fresh = _score(model, prompt_ids, 1, 0, DynamicCache(config=model.config), slice_tokens)
            return fresh[covered - 1:], 0
    commit_request(state, cache)
    return out, stats.reused_tokens


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


OFFSET_LOOKAHEAD = 8  # characters a token's text may sit past the expected position (text not decoded from the ids)


def text_offsets(tokenizer, token_ids: list[int], text: str, start: int = 0) -> tuple[list[str], list[int]]:
    """Each token's text as ``text`` shows it and its offset in ``text`` (plus ``start``), so that
    ``text[offset - start:]`` starts with the token's text.

    A token whose own text sits at the current position keeps it; otherwise its text is the piece
    that decoding it after the tokens before it adds (a separator the tokenizer inserts, a
    character split over several byte tokens: the pieces before the last are empty), and a token
    ``text`` omits (``<bos>`` before a prompt given as text, ``<eos>`` after a reply) has empty text.
    """
    shown, offsets, pos = [], [], 0
    prefix = read = 0  # incremental decoding window (vLLM's prefix / read offsets), skipping special tokens
    for i, token_id in enumerate(token_ids):
        own = token_text(tokenizer, token_id)
        if own and text.startswith(own, pos):
            shown.append(own)
            offsets.append(start + pos)
            pos += len(own)
            prefix, read = i, i + 1
            continue
        before = tokenizer.decode(token_ids[prefix:read], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[prefix:i + 1], skip_special_tokens=True)
        piece = after[len(before):] if len(after) > len(before) and not after.endswith("\ufffd") else ""
        if piece:
            prefix, read = read, i + 1
        at = pos
        if piece and not text.startswith(piece, pos):
            at = text.find(piece, pos, pos + OFFSET_LOOKAHEAD + len(piece))
        if at < 0:  # the text was not decoded from these ids (a prompt the tokenizer normalised): best effort
            shown.append(own)
            offsets.append(start + min(pos, len(text)))
            pos = min(len(text), pos + len(piece))
            continue
        display = own if own and piece.endswith(own) else piece
        shown.append(display)
        offsets.append(start + at + len(piece) - len(display))
        pos = at + len(piece)
    return shown, offsets


def completion_logprobs(tokenizer, segments: list[tuple[str, list[TokenLogprob]]]) -> dict:
    """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset) of a
    choice whose text is the concatenation of ``segments``' texts, each with the logprobs of its tokens
    (with ``echo``: the prompt's, then the reply's)."""
    tokens, offsets, entries, start = [], [], [], 0
    for text, part in segments:
        shown, at = text_offsets(tokenizer, [e.token_id for e in part], text, start)
        tokens += shown
        offsets += at
        entries += part
        start += len(text)
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
