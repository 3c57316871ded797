"""A fast-loop call's rotary ``(cos, sin)``, read from a block of positions the decoder's own rotary module computed.

A decode step asks the rotary module for one position: ~10 ATen calls per call, ~0.25 ms each on Gemma-3-270M
(two calls a step, one per layer type) once a step's weights have evicted the interpreter's objects: 3.6% of a
head-draft request. The module's arithmetic is elementwise per position (position times inverse frequency, a cat,
cos, sin, a scale, a cast), so the rows of one call over :data:`BLOCK` positions are the rows each one-position call
gives: the same functions on the same values. Where it could matter: a vectorized cos/sin (ATen's vector code, or
MKL's where torch has it) may leave a scalar tail computed another way; with a head size that is a multiple of 32
no call has one (AVX-512's pairs of vectors are 32 floats). Measured (session 21's review): identical rows for head
sizes 8 to 512 under ``ATEN_CPU_CAPABILITY`` default, avx2 and avx512 and 1 to 16 threads; the gate keeps the
sizes the argument covers, and every block is checked against a one-position call anyway.

So a block is taken only where the module is transformers' own, without hooks or a ``forward`` of its own (as
accelerate sets), of a rope type that never changes its frequencies with the length (not dynamic, not longrope),
with such a head size and a Python float scale; it is checked against a one-position call at its first row when
made, and used while the module, its class's ``forward``, its inverse frequencies' values (compared with a copy at
every call: an edit through ``.data`` or the storage moves no version counter), its scale's bits and the call's
dtype and device stay those it was made with. Otherwise the module is called as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvboost_hf.kernels.layer import _hooked, global_hooks
from kvboost_hf.models.rope import STATIC_ROPE_TYPES

BLOCK = 64  # positions per block: a decode step moves one position, so a block is made every 64 steps
BLOCKS_ATTR = "_kvboost_rotary_blocks"  # a fused decoder's attribute: {layer type: _Block or _Refused}
_VECTOR_PAIR = 32  # floats in ATen's widest pair of vectors (AVX-512): head sizes it divides run all-vector


@dataclass(frozen=True)
class _Block:
    start: int
    cos: torch.Tensor  # [1, BLOCK, head_dim]
    sin: torch.Tensor
    module: nn.Module  # the rotary module that computed it
    forward: object  # its class's forward then
    frequencies: torch.Tensor  # a copy of its inverse frequencies then
    scaling: str  # its scale's bits then (float.hex)
    dtype: torch.dtype
    device: torch.device

    def serves(self, module: nn.Module, frequencies: torch.Tensor, scaling: str, hidden: torch.Tensor, first: int,
               count: int) -> bool:
        return (self.module is module and type(module).forward is self.forward and self.scaling == scaling
                and self.dtype == hidden.dtype and self.device == hidden.device
                and self.start <= first and first + count <= self.start + BLOCK
                and frequencies.dtype == self.frequencies.dtype and torch.equal(frequencies, self.frequencies))


@dataclass(frozen=True)
class _Refused:
    module: nn.Module  # a module whose rows depended on the call's shape: called as it is from then on


def rotary_rows(decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor,
                layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``decoder.rotary_emb(hidden, positions[, layer_type])`` for ``positions`` (``[1, n]``, consecutive: the fast
    loop's), as views of a block; None where no block may serve (then the caller calls the module)."""
    module = decoder._modules.get("rotary_emb")
    source = _static_source(module, layer_type)
    if source is None or positions.dim() != 2 or positions.shape[0] != 1 or not 0 < positions.shape[1] <= BLOCK:
        return None
    frequencies, scaling = source
    blocks = decoder.__dict__.setdefault(BLOCKS_ATTR, {})
    block = blocks.get(layer_type)
    if isinstance(block, _Refused) and block.module is module:
        return None
    first, count = int(positions[0, 0]), positions.shape[1]
    if not isinstance(block, _Block) or not block.serves(module, frequencies, scaling, hidden, first, count):
        block = _new_block(module, hidden, first, layer_type, frequencies, scaling)
        blocks[layer_type] = block
        if isinstance(block, _Refused):
            return None
    offset = first - block.start
    return block.cos[:, offset: offset + count], block.sin[:, offset: offset + count]


def module_rope_type(module: nn.Module, layer_type: str | None):
    """``module``'s ``rope_type`` for ``layer_type`` (a rotary module of several layer types keeps a dict of them)."""
    rope = getattr(module, "rope_type", None)
    return rope if layer_type is None or not isinstance(rope, dict) else rope.get(layer_type)


def _static_source(module: nn.Module | None, layer_type: str | None) -> tuple[torch.Tensor, str] | None:
    """The inverse frequencies and the scale's bits a block is made from, where ``module`` may take blocks (module
    doc)."""
    if module is None or not type(module).__module__.startswith("transformers.") or _hooked(module) or global_hooks():
        return None
    rope = module_rope_type(module, layer_type)
    prefix = "" if layer_type is None else f"{layer_type}_"
    frequencies = module._buffers.get(f"{prefix}inv_freq")
    scaling = getattr(module, f"{prefix}attention_scaling", None)
    if (rope not in STATIC_ROPE_TYPES or not isinstance(frequencies, torch.Tensor) or frequencies.dim() != 1
            or (2 * frequencies.shape[0]) % _VECTOR_PAIR or type(scaling) not in (float, int)):
        return None
    return frequencies, float(scaling).hex()


def _new_block(module: nn.Module, hidden: torch.Tensor, first: int, layer_type: str | None,
               frequencies: torch.Tensor, scaling: str) -> _Block | _Refused:
    """The module's rows for positions ``first .. first + BLOCK - 1``, or a refusal where its first row differs from
    a one-position call's (then this module never takes blocks on this decoder)."""
    extra = () if layer_type is None else (layer_type,)
    ids = torch.arange(first, first + BLOCK, device=hidden.device).unsqueeze(0)
    copy = frequencies.detach().clone()  # before the calls: a block holds only rows of the values it was made from
    cos, sin = module(hidden, ids, *extra)
    one_cos, one_sin = module(hidden, ids[:, :1], *extra)
    if (cos.shape[:2] != (1, BLOCK) or one_cos.shape[:2] != (1, 1) or cos.dtype != one_cos.dtype
            or not torch.equal(cos[:, :1], one_cos) or not torch.equal(sin[:, :1], one_sin)):
        return _Refused(module)
    return _Block(first, cos, sin, module, type(module).forward, copy, scaling, hidden.dtype, hidden.device)
