"""OpenAI's sampling adjustments as standard transformers ``LogitsProcessor``s.

They work on any ``model.generate`` call (and so compose with reuse and with whatever scheduler
runs generate): ``logit_bias`` adds a bias to token ids, ``presence_penalty`` and
``frequency_penalty`` follow OpenAI's definition over the tokens generated so far::

    logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)

Temperature and top-p are applied after them (:func:`sampling_processors`), so a penalty moves
the raw logits exactly as OpenAI documents, whatever the temperature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.decoding.grammar_mask import GrammarMask


class LogitBias(LogitsProcessor):
    """Adds ``bias[token_id]`` to that token's logit at every step (OpenAI ``logit_bias``)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids, values = self.ids.to(scores.device), self.values.to(scores.device, scores.dtype)
        scores = scores.clone()
        scores[:, ids] += values
        return scores


class OpenAIPenalties(LogitsProcessor):
    """Presence and frequency penalties over the completion tokens (those after ``prompt_len``)."""

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def sampling_processors(temperature: float, top_p: float) -> list[LogitsProcessor]:
    """Temperature then top-p, as generate would add them, to run after custom processors."""
    out: list[LogitsProcessor] = []
    if temperature > 0 and temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if temperature > 0 and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


async def request_processors(body, schema: dict | None, param: str, grammars, tokenizer, vocab_size: int,
                             eos_ids: list[int]) -> Callable[[int], list] | None:
    """A request's per-call processor factory ``make(prompt_len) -> [grammar, logit_bias, penalties]``.

    None when the request needs none. Compiles the grammar now (bounded and cached: ``GrammarCompilers.compile``),
    so a bad schema or token id is a 400 naming ``param`` (``logit_bias``) before anything is queued.
    """
    bias = body.logit_bias or {}
    bad = [t for t in bias if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"logit_bias token ids must be in [0, {vocab_size}); got {bad[:5]}",
                       param="logit_bias", code="invalid_value")
    presence, frequency = body.presence_penalty or 0.0, body.frequency_penalty or 0.0
    grammar = None
    if schema is not None:
        try:  # compiled now, on a thread of its own (never where generation runs): a 400 here
            compiled = await grammars.compile(tokenizer, vocab_size, eos_ids, schema)
        except ValueError as err:
            raise APIError(400, str(err), param=param, code="invalid_value") from None
        grammar = lambda: GrammarMask(compiled)  # noqa: E731 - a fresh matcher per call
    if grammar is None and not bias and not presence and not frequency:
        return None

    def make(prompt_len: int) -> list:
        out = [grammar()] if grammar is not None else []
        if bias:
            out.append(LogitBias(bias))
        if presence or frequency:
            out.append(OpenAIPenalties(presence, frequency, prompt_len))
        return out

    return make
