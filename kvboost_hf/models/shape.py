"""What K/V costs for a decoder-only transformers model: its shape, and the one set of byte formulas.

Live K/V follows the cache transformers builds (``DynamicCache``: every full-attention layer holds
every token, a sliding layer at most its window), in the model's dtype; stored (at-rest) K/V
follows the ChunkStore's entries (KIVI codes and scales when quantized, each token's id and
logprob slot, each entry's overhead). The planner, the store's budget checks and reuse all use
these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost_hf.store.codec import ENTRY_OVERHEAD_BYTES, TOKEN_BYTES

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def head_dim(config) -> int:
    """The attention head size of a transformers config (its text config for multimodal ones)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class ModelShape:
    """What the capacity model needs to know about a decoder-only model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    dtype_bytes: int = 4
    sliding_window: int | None = None
    sliding_layers: int = 0  # how many of num_layers are sliding-window layers
    tied_embeddings: bool = True
    weight_bytes_exact: int | None = None  # from the checkpoint's headers when available

    @classmethod
    def from_config(cls, config, dtype: str | None = None, weight_bytes: int | None = None) -> ModelShape:
        """The shape of a transformers config (its text config for multimodal ones)."""
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        layer_types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        if layer_types:
            sliding = sum(1 for t in layer_types if t == "sliding_attention")
        else:  # Mistral-style: one window for every layer
            sliding = config.num_hidden_layers if window else 0
        name = dtype or str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        name = name.removeprefix("torch.")
        if name not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim(config),
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            vocab_size=config.vocab_size,
            num_attention_heads=heads,
            dtype_bytes=DTYPE_BYTES[name],
            sliding_window=window if sliding else None,
            sliding_layers=sliding,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            weight_bytes_exact=weight_bytes,
        )

    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers


def kv_bytes_per_token(shape: ModelShape) -> dict[str, int]:
    """Live K/V bytes one token costs, per layer type (keys and values, all layers of that type)."""
    per_layer = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    return {"full": per_layer * shape.full_layers, "sliding": per_layer * shape.sliding_layers}


def kv_bytes_per_sequence(shape: ModelShape, context: int) -> int:
    """Live K/V bytes of one sequence of ``context`` tokens: sliding layers cap at their window."""
    per_type = kv_bytes_per_token(shape)
    sliding_tokens = min(context, shape.sliding_window) if shape.sliding_window else context
    return per_type["full"] * context + per_type["sliding"] * sliding_tokens


def quantized_kv_bytes_per_sequence(shape: ModelShape, context: int, kv_bits: int, residual_length: int = 128,
                                    group_size: int | None = None) -> int:
    """Live K/V bytes of one sequence in a ``KIVICache``: full-attention layers hold KIVI codes plus up to
    ``residual_length`` tokens at full precision; sliding layers stay full precision, capped at their window."""
    group = group_size or next((g for g in (128, 64, 32, 16, 8) if shape.head_dim % g == 0), shape.head_dim)
    per_head_token = 2 * shape.head_dim * kv_bits / 8 + (shape.head_dim // group) * 4  # codes + value scale/zero
    quantized = shape.full_layers * shape.num_kv_heads * (per_head_token * context + shape.head_dim * 4)
    residual = kv_bytes_per_token(shape)["full"] * min(context, residual_length)
    sliding_tokens = min(context, shape.sliding_window) if shape.sliding_window else context
    return int(quantized) + residual + kv_bytes_per_token(shape)["sliding"] * sliding_tokens


def stored_bytes_per_token(shape: ModelShape, kv_bits: int | None, chunk_size: int = 128,
                           group_size: int | None = None) -> float:
    """Bytes one token costs at rest in a ChunkStore (every layer; scales and token id included)."""
    elements = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    bookkeeping = TOKEN_BYTES + ENTRY_OVERHEAD_BYTES / chunk_size  # token id + logprob, each entry's overhead
    if kv_bits is None:
        return elements * shape.dtype_bytes + bookkeeping
    group = group_size or next((g for g in (128, 64, 32, 16, 8) if shape.head_dim % g == 0), shape.head_dim)
    codes = elements * kv_bits / 8
    # fp16 scale + zero: per value group of every token, per key channel of every chunk.
    value_scales = shape.num_layers * shape.num_kv_heads * (shape.head_dim // group) * 4
    key_scales = shape.num_layers * shape.num_kv_heads * shape.head_dim * 4 / chunk_size
    return codes + value_scales + key_scales + bookkeeping


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The shape of a loaded model, in the dtype its parameters have now."""
    first = next(model.parameters(), None)
    dtype = str(first.dtype).removeprefix("torch.") if first is not None else None
    return ModelShape.from_config(model.config, dtype=dtype if dtype in DTYPE_BYTES else "float32")


def chunk_entry_bytes(shape: ModelShape, chunk_size: int, kv_bits: int | None = None) -> int:
    """Bytes one full stored chunk of ``chunk_size`` tokens takes in a ChunkStore (its budget unit)."""
    return int(stored_bytes_per_token(shape, kv_bits, chunk_size) * chunk_size)
