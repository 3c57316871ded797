"""Token log-probabilities: the model's own log-softmax, in float32, for generated and prompt tokens.

Generated tokens: the raw logits generate returns (``output_logits=True``), before any logits
processor, temperature or grammar mask, so a logprob is the model's and not the sampler's.
Prompt tokens (``echo`` with ``logprobs``): one forward of the whole prompt without the reuse
cache (prompt tokens served from the store have no logits to read, so the prompt is recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


def prompt_logprobs(model, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
    """Logprobs of every prompt token given the ones before it (the first has none): one full forward."""
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1]
    first = TokenLogprob(prompt_ids[0], None)
    return [first, *logprobs_at(logits, prompt_ids[1:], top)] if len(prompt_ids) > 1 else [first]


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
            None if e.logprob is None and not e.top else {token_text(tokenizer, i): lp for i, lp in e.top} for e in entries
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
