"""Per-row sampling: the row's own logits processors, warpers and ``torch.Generator``.

A seeded request draws from its own generator, so its tokens do not depend on the other rows
of the batch (no global RNG, no lock). A row's custom ``processors`` (grammar masks, biases,
penalties: any transformers ``LogitsProcessor``) see its raw fp32 logits first; temperature and
top-p are transformers' own warpers, applied after them, the order the server's ``generate``
path uses. Logprobs are taken from the raw logits, before any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper


@dataclass
class RowSampling:
    """How one row picks its next token: greedy when ``temperature`` is 0.

    ``processors`` belong to this row alone (stateful ones, like a grammar matcher, must not be
    shared): each is called once per generated token with the row's ids so far, ``[1, L]``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    processors: list = field(default_factory=list)
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

    @property
    def needs_ids(self) -> bool:
        """Whether :func:`next_token` must be given the row's token ids."""
        return bool(self.processors) or bool(self.warpers)


def next_token(logits: torch.Tensor, sampling: RowSampling, input_ids: torch.Tensor | None = None) -> int:
    """The next token of one row from its last-position ``logits`` (``[vocab]``), fp32.

    The row's processors run first on the raw logits (``input_ids``, the row's tokens so far,
    required when it has any); then greedy rows take the argmax, and sampling rows apply their
    warpers (temperature, then top-p) and draw with their own generator.
    """
    scores = logits.float().reshape(1, -1)
    ids = (input_ids.reshape(1, -1).to(scores.device) if input_ids is not None
           else torch.zeros((1, 0), dtype=torch.long, device=scores.device))
    if sampling.processors:
        if input_ids is None:
            raise ValueError("a row with logits processors needs its token ids (input_ids)")
        for processor in sampling.processors:
            scores = processor(ids, scores)
    if sampling.greedy:
        return int(scores.argmax(dim=-1))
    scores = sampling.warpers(ids, scores)
    # The row's generator lives on the CPU: draw there (one row of probabilities), whatever the model's device.
    probs = torch.softmax(scores, dim=-1).cpu()
    return int(torch.multinomial(probs, num_samples=1, generator=sampling.generator))


@dataclass
class RawLogprob:
    """The model's own log-probability (fp32 log-softmax of the raw logits) of a generated token,
    and the ``top`` most likely (token id, logprob) pairs at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def raw_logprob(logprobs: torch.Tensor, token_id: int, top: int) -> RawLogprob:
    """``logprobs`` (``[vocab]``, a log-softmax) read at ``token_id``, with the ``top`` largest."""
    entry = RawLogprob(token_id, float(logprobs[token_id]))
    if top > 0:
        values, indices = logprobs.topk(top)
        entry.top = list(zip(indices.tolist(), values.tolist()))
    return entry
