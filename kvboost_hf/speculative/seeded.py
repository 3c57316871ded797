"""Sampling whose randomness belongs to a position, not to how many tokens a round drafted.

transformers' assisted decoding samples the verified positions of a round in one
``torch.multinomial`` call over ``k + 1`` rows (or, with draft logits, draws ``k`` uniforms for
the rejection test): which random numbers land on which position depends on ``k``. Our draft
length is chosen from measured wall-clock costs, so one seed gave different replies from run to run.

Here a sampled speculative request becomes greedy decoding of perturbed scores: after the usual
processors and warpers (temperature, top-k, top-p, ...), Gumbel noise drawn from a generator seeded
by ``(request seed, position)`` is added, and the argmax is taken (the Gumbel-max trick: the argmax
is an exact sample of ``softmax(scores)``). Verification is then exact greedy matching, every
position's token depends only on the request's seed and the tokens before it, whatever was drafted,
and a model draft shown the same noise proposes the same sample whenever it agrees with the target.
The request's seed is drawn once from torch's global generator, so ``torch.manual_seed(s)`` before
``generate`` fixes the reply.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for ``position`` of a request seeded ``seed`` (splitmix64 of their mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class PositionGumbel(LogitsProcessor):
    """Adds Gumbel noise keyed by the position being sampled (``input_ids.shape[1]``), on the CPU."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def noise(self, position: int, rows: int, width: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(position_seed(self.seed, position))
        uniform = torch.rand(rows, width, generator=generator, dtype=torch.float64)
        return -torch.log(-torch.log(uniform.clamp_(min=1e-300)))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        noise = self.noise(input_ids.shape[1], scores.shape[0], scores.shape[-1])
        return (scores.double() + noise.to(scores.device)).to(scores.dtype)


def request_seed() -> int:
    """One draw from torch's global generator: what ``torch.manual_seed`` before generate decides."""
    return int(torch.randint(0, 2**62, (1,)).item())
