"""RopeShifter: move cached (post-RoPE) keys to new positions with the model's own rotary embedding.

RoPE rotates each key by an angle proportional to its position, so a key computed at position
``p`` becomes the key at ``q`` by one more rotation by ``q - p``. The shifter asks the model's
rotary module for the cos/sin of that delta and applies them with the model's own
``apply_rotary_pos_emb``, so scaling variants (linear, llama3, yarn), per-layer-type bases
(Gemma 3), partial rotary and half-split or interleaved layouts are whatever the model does.
Families where a delta rotation is not exact (dynamic NTK, longrope, M-RoPE, MLA, absolute
positions) are refused with a reason; so is any model whose shift fails a self-check.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable

import torch

from kvboost_hf.models.shape import head_dim

logger = logging.getLogger(__name__)

# rope_types whose inverse frequencies are fixed when the rotary module is made (none depends on a forward's length or
# positions): a delta rotation between positions is then exact (RopeShifter), and the kernels' rotary blocks, made
# once per 64 positions, equal the module's own rows (kernels.rotary).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
SUPPORTED_ROPE_TYPES = tuple(sorted(STATIC_ROPE_TYPES))  # what RopeShifter moves, named in its errors


class UnsupportedRope(ValueError):
    """The model's positions cannot be moved exactly; approximate reuse is refused."""


def _rope_entries(config) -> list[dict]:
    """The text config's RoPE parameters: one dict, or one per layer type (Gemma 3; a type without RoPE, None, is
    left out)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return [{}]
    if "rope_type" not in params and "type" not in params and any(isinstance(v, dict) for v in params.values()):
        return [v for v in params.values() if isinstance(v, dict)]
    return [params]


def _rope_types(config) -> set[str]:
    types = set()
    for entry in _rope_entries(config):
        if "mrope_section" in entry:
            raise UnsupportedRope("multimodal RoPE (M-RoPE) positions are three-dimensional")
        types.add(entry.get("rope_type", entry.get("type", "default")))
    return types


def length_dependent_rope(config, tokens: int | None = None) -> str | None:
    """The model's RoPE type whose frequencies depend on the longest position a forward sees, where a call whose
    sequence may grow to ``tokens`` tokens (None: any length) can reach a length at which they change; else None.

    transformers recomputes them in each forward for "dynamic" (rescaled past the original length, and kept at the
    largest position seen until a forward shorter than the original length resets them) and "longrope" (the long
    factors for every row once a position passes the original length); every other type is a fixed rotation per
    position. Past that length a forward of positions that plain decoding does not reach together (a speculative
    verification's rows) or K/V stored by a forward of another length change the reply. Below it (every forward
    shorter than the smaller of ``max_position_embeddings`` and the type's ``original_max_position_embeddings``)
    the frequencies are the original ones whatever came before."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for entry in _rope_entries(config):
        kind = entry.get("rope_type", entry.get("type", "default"))
        if not isinstance(kind, str) or not length_dependent(kind):
            continue
        limits = [v for v in (getattr(config, "max_position_embeddings", None),
                              entry.get("original_max_position_embeddings")) if isinstance(v, int)]
        if tokens is None or not limits or tokens >= min(limits):
            return kind
    return None


def length_dependent(rope_type: str) -> bool:
    """Whether transformers' rotary module of ``rope_type`` recomputes its frequencies in each forward (its
    ``dynamic_rope_update`` tells them apart so)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def _find_rotary(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "model", None) or getattr(model, "base_model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedRope("no rotary embedding module (absolute or learned positions)")
    return rotary


def _find_apply(model: torch.nn.Module) -> Callable:
    module = sys.modules.get(type(model).__module__)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        raise UnsupportedRope(f"{type(model).__name__} has no apply_rotary_pos_emb to reuse")
    names = list(inspect.signature(apply).parameters)[:4]
    if names[:2] != ["q", "k"]:
        raise UnsupportedRope(f"unexpected apply_rotary_pos_emb signature {names}")
    return apply


class RopeShifter:
    """Re-rotates post-RoPE keys by a position delta, per layer. Build with :meth:`for_model`."""

    def __init__(self, rotary: torch.nn.Module, apply: Callable, layer_types: list[str] | None) -> None:
        self.rotary = rotary
        self.apply = apply
        self.layer_types = layer_types
        self.takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self._delta_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> RopeShifter:
        """A verified shifter for ``model``; raises :class:`UnsupportedRope` with the reason otherwise."""
        config = model.config.get_text_config(decoder=True)
        if getattr(config, "kv_lora_rank", None):
            raise UnsupportedRope("multi-head latent attention (MLA) caches compressed keys")
        unsupported = _rope_types(config) - set(SUPPORTED_ROPE_TYPES)
        if unsupported:
            raise UnsupportedRope(
                f"rope_type {sorted(unsupported)} is not a pure position rotation (supported: {SUPPORTED_ROPE_TYPES})"
            )
        layer_types = getattr(config, "layer_types", None)
        shifter = cls(_find_rotary(model), _find_apply(model), layer_types)
        shifter._self_check(config)
        return shifter

    def _cos_sin(self, positions: torch.Tensor, layer_idx: int, like: torch.Tensor):
        x = like.new_zeros((1, 1, 1))
        args = (x, positions.reshape(1, -1).to(like.device))
        if self.takes_layer_type:
            layer_type = self.layer_types[layer_idx] if self.layer_types else "full_attention"
            return self.rotary(*args, layer_type=layer_type)
        return self.rotary(*args)

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor, layer_idx: int, scaled: bool = True) -> torch.Tensor:
        """Apply the model's RoPE for ``positions`` (one per token) to ``keys`` ``[batch, heads, tokens, dim]``."""
        with torch.no_grad():
            cos, sin = self._cos_sin(positions, layer_idx, keys)
            if not scaled:  # a shift must not apply attention_scaling (yarn's mscale) a second time
                scale = self._cos_sin(torch.zeros(1, dtype=torch.long), layer_idx, keys)[0][..., :1]
                cos, sin = cos / scale, sin / scale
            return self.apply(keys, keys, cos.to(keys.dtype), sin.to(keys.dtype))[1]

    def shift(self, keys: torch.Tensor, delta: int | torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Keys computed at positions ``p`` as they would be at ``p + delta``."""
        n = keys.shape[-2]
        if not isinstance(delta, int):
            return self.rotate(keys, delta, layer_idx, scaled=False)
        if delta == 0:
            return keys
        # Layers of one type share their rotation: compute each (type, delta, length) once.
        layer_type = self.layer_types[layer_idx] if self.takes_layer_type and self.layer_types else None
        key = (layer_type, delta, n, keys.dtype, keys.device)
        cos_sin = self._delta_cache.get(key)
        if cos_sin is None:
            with torch.no_grad():
                positions = torch.full((n,), delta, dtype=torch.long)
                cos, sin = self._cos_sin(positions, layer_idx, keys)
                scale = self._cos_sin(torch.zeros(1, dtype=torch.long), layer_idx, keys)[0][..., :1]
                cos_sin = ((cos / scale).to(keys.dtype), (sin / scale).to(keys.dtype))
            if len(self._delta_cache) >= 256:
                self._delta_cache.clear()
            self._delta_cache[key] = cos_sin
        with torch.no_grad():
            return self.apply(keys, keys, *cos_sin)[1]

    def _self_check(self, config) -> None:
        size = head_dim(config)
        dtype = next(self.rotary.buffers(), torch.empty(0)).dtype
        if not dtype.is_floating_point:
            dtype = torch.float32
        g = torch.Generator().manual_seed(0)
        raw = torch.randn(1, 1, 4, size, generator=g).to(dtype)
        p = torch.tensor([0, 5, 31, 200])
        # One layer per layer type: layers of a type share their rotary parameters.
        layers = {t: i for i, t in reversed(list(enumerate(self.layer_types)))}.values() if self.layer_types else [0]
        for layer in layers:
            at_p = self.rotate(raw, p, layer)
            for delta in (37, -3):
                direct = self.rotate(raw, p + delta, layer)
                moved = self.shift(at_p, delta, layer)
                err = (moved - direct).abs().max().item() / max(direct.abs().max().item(), 1e-6)
                if not err <= 1e-4:
                    raise UnsupportedRope(f"re-rotation self-check failed on layer {layer} (relative error {err:.1e})")
