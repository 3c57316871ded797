"""KIVICache: a live K/V cache whose full-attention layers hold KIVI int8/int4 codes.

Approximate by construction: attention reads dequantized keys and values, so outputs drift from
a full-precision cache. It exists for one case, a request that does not fit in memory at full
precision (the memory planner's last rungs, ``kvboost-hf serve --kv-bits-fallback``), and says
so: a request run with it neither reads nor feeds the chunk store, which holds exact K/V only.

It reuses transformers' ``QuantizedLayer`` (a full-precision residual window flushed into the
quantized states every ``residual_length`` tokens) with this package's KIVI quantizer (keys per
channel, values per token in channel groups: :mod:`kvboost_hf.store.quant`) instead of the
optional quanto / HQQ backends. transformers' own ``QuantizedCache`` refuses models with sliding
layers (Gemma-3); here sliding layers stay ``DynamicSlidingWindowLayer`` (full precision, capped
at their window, so already small).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, QuantizedLayer

from kvboost_hf.store.quant import QuantizedTensor, check_bits, default_group_size, quantize_keys, quantize_values

DEFAULT_RESIDUAL_LENGTH = 128
KEY_AXIS, VALUE_AXIS = -2, -1  # the axis each quantizer reduces over: tokens (keys), channels (values)


class KIVILayer(QuantizedLayer):
    """Full-attention layer: KIVI codes for old tokens, full precision for the last ``residual_length``."""

    def __init__(self, nbits: int, residual_length: int = DEFAULT_RESIDUAL_LENGTH) -> None:
        check_bits(nbits)
        super().__init__(nbits=nbits, axis_key=KEY_AXIS, axis_value=VALUE_AXIS, residual_length=residual_length)

    def _quantize(self, tensor: torch.Tensor, axis: int) -> tuple[QuantizedTensor, int]:
        batch, heads, tokens, dim = tensor.shape
        flat = tensor.reshape(batch * heads, tokens, dim)  # every (row, head) gets its own scales
        if axis == KEY_AXIS:
            q = quantize_keys(flat, self.nbits)
        else:
            q = quantize_values(flat, self.nbits, default_group_size(dim))
        return q, batch

    def _dequantize(self, q_tensor: tuple[QuantizedTensor, int]) -> torch.Tensor:
        q, batch = q_tensor
        heads_times_batch, tokens, dim = q.out_shape
        return q.dequantize().reshape(batch, heads_times_batch // batch, tokens, dim)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (assisted decoding rolls back rejected candidates).

        Candidates usually sit in the full-precision residual window; when they reach into the
        quantized states, those are dequantized, cut and quantized again.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(0, self.cumulative_length + tokens_to_remove)
        if keep == 0:  # nothing left: the next update starts from scratch
            self.keys = self.values = self._quantized_keys = self._quantized_values = None
            self.is_initialized, self.cumulative_length, self._pending_beam_idx = False, 0, None
            return
        residual = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        quantized = self.cumulative_length - residual
        if keep >= quantized:
            self.keys, self.values = self.keys[..., : keep - quantized, :], self.values[..., : keep - quantized, :]
        else:
            keys = self._dequantize(self._quantized_keys)[..., :keep, :]
            values = self._dequantize(self._quantized_values)[..., :keep, :]
            keys, values = self._apply_pending_reorder(keys, values)
            self._pending_beam_idx = None
            self._quantized_keys = self._quantize(keys.contiguous(), axis=self.axis_key)
            self._quantized_values = self._quantize(values.contiguous(), axis=self.axis_value)
            self.keys = self.keys[..., :0, :] if residual else torch.tensor([], dtype=keys.dtype, device=keys.device)
            self.values = self.values[..., :0, :] if residual else torch.tensor([], dtype=keys.dtype, device=keys.device)
        self.cumulative_length = keep

    @property
    def quantized_bytes(self) -> int:
        """Bytes of the codes, scales and zero points held now."""
        held = [q for q in (self._quantized_keys, self._quantized_values) if q is not None]
        return sum(q.nbytes for q, _ in held)


class KIVICache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are :class:`KIVILayer` (``bits`` 8 or 4).

    ``model.generate(ids, past_key_values=KIVICache(model.config, bits=4))``; with chunk reuse
    enabled, ``model.generate(ids, kv_bits=4)`` builds one (and steps reuse aside for the call).
    """

    def __init__(self, config, bits: int, residual_length: int = DEFAULT_RESIDUAL_LENGTH) -> None:
        check_bits(bits)
        if residual_length < 1:
            raise ValueError(f"residual_length must be >= 1, got {residual_length}")
        super().__init__(config=config)
        self.bits = bits
        self.layers = [KIVILayer(bits, residual_length) if type(layer) is DynamicLayer else layer
                       for layer in self.layers]
        self.layer_class_to_replicate = None
