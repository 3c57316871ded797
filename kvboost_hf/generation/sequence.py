"""How long a ``generate`` call's sequence may grow: what checks that depend on the positions a call reaches read."""

from __future__ import annotations

import torch


def longest_sequence(model: torch.nn.Module, inputs: torch.Tensor | None, kwargs: dict) -> int | None:
    """The most tokens (prompt and new ones) ``model.generate(inputs, **kwargs)`` can hold, as transformers bounds
    them: ``max_new_tokens`` past the prompt where set (the call's over its generation config's), else
    ``max_length``; None where the prompt's length or the bound is unknown."""
    embeds = kwargs.get("inputs_embeds")
    prompt = inputs if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else embeds
    if not isinstance(prompt, torch.Tensor) or prompt.dim() < 2:
        return None
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs["max_new_tokens"] if "max_new_tokens" in kwargs else getattr(config, "max_new_tokens", None)
    if new is not None:
        return int(prompt.shape[1]) + int(new)
    limit = kwargs["max_length"] if "max_length" in kwargs else getattr(config, "max_length", None)
    return None if limit is None else max(int(limit), int(prompt.shape[1]) + 1)
