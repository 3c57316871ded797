"""A fast-loop call's rotary ``(cos, sin)``, read from a block of positions the decoder's own rotary module computed.

A decode step asks the rotary module for one position: ~10 ATen calls per call, ~0.25 ms each on Gemma-3-270M
(two calls a step, one per layer type) once a step's weights have evicted the interpreter's objects: 3.6% of a
head-draft request. The module's arithmetic is elementwise per position (position times inverse frequency, a cat,
cos, sin, a scale, a cast), so the rows of one call over :data:`BLOCK` positions are the rows each one-position call
gives: the same functions on the same values. Where it matters: ATen runs cos and sin through its vector code in
pairs of vectors and the rest through libm's scalar functions, whose bits may differ; with a head size that is a
multiple of 32 every element of either call is vector code (AVX-512's pairs are 32 floats, AVX2's 16).

So a block is taken only where the module is transformers' own, without hooks, of a rope type that never changes
its frequencies with the length (not dynamic, not longrope), with such a head size; it is checked against a
one-position call at its first row when made, and used while the module's frequency tensor (object and version),
its scale and the call's dtype and device stay those it was made with. Otherwise the module is called as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

BLOCK = 64  # positions per block: a decode step moves one position, so a block is made every 64 steps
BLOCKS_ATTR = "_kvboost_rotary_blocks"  # a fused decoder's attribute: {layer type: _Block, or None once refused}
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # frequencies fixed at the module's init
_VECTOR_PAIR = 32  # floats in ATen's widest pair of vectors (AVX-512): head sizes it divides run all-vector


@dataclass(frozen=True)
class _Block:
    start: int
    cos: torch.Tensor  # [1, BLOCK, head_dim]
    sin: torch.Tensor
    frequencies: torch.Tensor  # the module's inverse frequencies when the block was made
    version: int  # ... and their version counter then
    scaling: float
    dtype: torch.dtype
    device: torch.device

    def serves(self, frequencies: torch.Tensor, scaling, hidden: torch.Tensor, first: int, count: int) -> bool:
        return (self.frequencies is frequencies and self.version == frequencies._version and self.scaling == scaling
                and self.dtype == hidden.dtype and self.device == hidden.device
                and self.start <= first and first + count <= self.start + BLOCK)


def rotary_rows(decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor,
                layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``decoder.rotary_emb(hidden, positions[, layer_type])`` for ``positions`` (``[1, n]``, consecutive: the fast
    loop's), as views of a block; None where no block may serve (then the caller calls the module)."""
    module = decoder._modules.get("rotary_emb")
    source = _static_source(module, layer_type)
    if source is None or positions.dim() != 2 or positions.shape[0] != 1 or positions.shape[1] > BLOCK:
        return None
    frequencies, scaling = source
    blocks = decoder.__dict__.setdefault(BLOCKS_ATTR, {})
    block = blocks.get(layer_type, False)
    if block is None:  # refused once: this module's rows depend on the call's shape
        return None
    first, count = int(positions[0, 0]), positions.shape[1]
    if block is False or not block.serves(frequencies, scaling, hidden, first, count):
        block = _new_block(module, hidden, first, layer_type, frequencies, scaling)
        blocks[layer_type] = block
        if block is None:
            return None
    offset = first - block.start
    return block.cos[:, offset: offset + count], block.sin[:, offset: offset + count]


def _static_source(module: nn.Module | None, layer_type: str | None) -> tuple[torch.Tensor, object] | None:
    """The inverse frequencies and scale a block is made from, where ``module`` may take blocks (module doc)."""
    if (module is None or not type(module).__module__.startswith("transformers.") or module._forward_hooks
            or module._forward_pre_hooks):
        return None
    rope = getattr(module, "rope_type", None)
    rope = rope if layer_type is None or not isinstance(rope, dict) else rope.get(layer_type)
    prefix = "" if layer_type is None else f"{layer_type}_"
    frequencies = module._buffers.get(f"{prefix}inv_freq")
    if rope not in STATIC_ROPE_TYPES or frequencies is None or frequencies.dim() != 1 \
            or (2 * frequencies.shape[0]) % _VECTOR_PAIR:
        return None
    return frequencies, getattr(module, f"{prefix}attention_scaling", None)


def _new_block(module: nn.Module, hidden: torch.Tensor, first: int, layer_type: str | None,
               frequencies: torch.Tensor, scaling) -> _Block | None:
    """The module's rows for positions ``first .. first + BLOCK - 1``, or None where its first row differs from a
    one-position call's (the module then never takes blocks on this decoder)."""
    extra = () if layer_type is None else (layer_type,)
    ids = torch.arange(first, first + BLOCK, device=hidden.device).unsqueeze(0)
    cos, sin = module(hidden, ids, *extra)
    one_cos, one_sin = module(hidden, ids[:, :1], *extra)
    if (cos.shape[:2] != (1, BLOCK) or one_cos.shape[:2] != (1, 1) or cos.dtype != one_cos.dtype
            or not torch.equal(cos[:, :1], one_cos) or not torch.equal(sin[:, :1], one_sin)):
        return None
    return _Block(first, cos, sin, frequencies, frequencies._version, scaling, hidden.dtype, hidden.device)
