"""OpenAI's sampling adjustments as standard transformers ``LogitsProcessor``s.

They work on any ``model.generate`` call (and so compose with reuse and with whatever scheduler
runs generate): ``logit_bias`` adds a bias to token ids, ``presence_penalty`` and
``frequency_penalty`` follow OpenAI's definition over the tokens generated so far::

    logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)

Temperature and top-p are applied after them (:func:`sampling_processors`), so a penalty moves
the raw logits exactly as OpenAI documents, whatever the temperature.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper


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
