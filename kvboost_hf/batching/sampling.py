"""Per-row sampling: the row's own settings, logits warpers and ``torch.Generator``.

A seeded request draws from its own generator, so its tokens do not depend on the other rows
of the batch (no global RNG, no lock). Temperature and top-p are transformers' own warpers,
applied in generate's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper


@dataclass
class RowSampling:
    """How one row picks its next token: greedy when ``temperature`` is 0."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    generator: torch.Generator = field(init=False, repr=False)
    warpers: LogitsProcessorList = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.generator = torch.Generator()
        if self.seed is not None:
            self.generator.manual_seed(self.seed)
        else:
            self.generator.seed()
        warpers = LogitsProcessorList()
        if self.temperature > 0:
            if self.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(self.temperature))
            if self.top_p < 1.0:
                warpers.append(TopPLogitsWarper(self.top_p))
        self.warpers = warpers

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_token(logits: torch.Tensor, sampling: RowSampling, input_ids: torch.Tensor | None = None) -> int:
    """The next token of one row from its last-position ``logits`` (``[vocab]``), fp32.

    Greedy rows take the argmax; sampling rows apply their warpers and draw with their own
    generator (``input_ids``, the row's tokens so far, are what the warpers may look at).
    """
    scores = logits.float().reshape(1, -1)
    if sampling.greedy:
        return int(scores.argmax(dim=-1))
    ids = input_ids.reshape(1, -1) if input_ids is not None else torch.zeros((1, 0), dtype=torch.long)
    scores = sampling.warpers(ids, scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=sampling.generator))
