"""The transformers model behind what a user hands us."""

from __future__ import annotations

import torch


def target_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose forward generate calls (unwraps torch.compile and peft wrappers)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    if not hasattr(model, "generate") or not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a transformers generative model, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError("chunk reuse supports decoder-only models; this model is an encoder-decoder")
    return model
