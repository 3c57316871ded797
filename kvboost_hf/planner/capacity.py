"""The capacity model: from a model's config alone, how many sequences of length L fit, and how fast they decode.

Pure functions over a :class:`ModelShape`. K/V bytes follow the cache transformers builds
(``DynamicCache``: every full-attention layer holds every token, a sliding layer at most its
window), in the model's dtype; stored (at-rest) K/V follow the ChunkStore's KIVI layout. Decode
is modelled as memory bound: every step reads all weights once plus every running sequence's
K/V, so ``tokens/s per sequence = bandwidth / (weight bytes + batch x K/V bytes)``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Kept equal to kvboost_hf.store.codec's (tested): importing it would pull in torch.
ENTRY_OVERHEAD_BYTES = 256
TOKEN_BYTES = 12  # a stored token's id and its logprob slot
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# Fraction of the memory kept free for activations, allocator slack and the runtime itself.
DEFAULT_MARGIN = 0.10


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
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
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
            head_dim=head_dim,
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


def estimated_parameters(shape: ModelShape) -> int:
    """Parameters of a Llama-style decoder: embeddings, attention and gated MLP per layer, LM head if untied."""
    attention = shape.hidden_size * shape.head_dim * (2 * shape.num_attention_heads + 2 * shape.num_kv_heads)
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    per_layer = attention + mlp + 4 * shape.hidden_size  # norms
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tied_embeddings else 2)
    return shape.num_layers * per_layer + embeddings + shape.hidden_size


def weight_bytes(shape: ModelShape) -> int:
    """Bytes of the weights: exact from the checkpoint when known, else estimated from the config."""
    if shape.weight_bytes_exact is not None:
        return shape.weight_bytes_exact
    return estimated_parameters(shape) * shape.dtype_bytes


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


@dataclass
class CapacityReport:
    """Everything ``kvboost-hf plan`` prints."""

    memory_bytes: int
    context: int
    weight_bytes: int
    weights_exact: bool
    margin_bytes: int
    kv_pool_bytes: int
    kv_bytes_per_token: dict[str, int]
    kv_bytes_per_sequence: int
    max_sequences: int
    can_serve: bool
    bandwidth_gb_s: float
    decode_tok_s_one_sequence: float
    decode_tok_s_per_sequence_at_max: float
    decode_tok_s_aggregate_at_max: float
    stored_bytes_per_token: dict[str, float]
    shared_prefix: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    store_kv_bits: int | None = None  # the store precision the user plans with

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def capacity(shape: ModelShape, memory_bytes: int, context: int, bandwidth_gb_s: float,
             margin: float = DEFAULT_MARGIN, shared_prefix: int = 0, chunk_size: int = 128) -> CapacityReport:
    """How many sequences of ``context`` tokens fit in ``memory_bytes`` beside the weights, and how fast they decode.

    ``shared_prefix`` tokens common to every sequence (a system prompt) are prefilled once and
    stored once; the live K/V of each running sequence still holds them (the cache of a request
    is its own), so they change prefill work and store size, not the number of sequences.
    """
    if memory_bytes <= 0 or context <= 0 or bandwidth_gb_s <= 0:
        raise ValueError("memory, context and bandwidth must be positive")
    weights = weight_bytes(shape)
    margin_bytes = int(memory_bytes * margin)
    pool = max(0, memory_bytes - weights - margin_bytes)
    per_seq = kv_bytes_per_sequence(shape, context)
    max_seqs = pool // per_seq if per_seq else 0
    bandwidth = bandwidth_gb_s * 1e9

    def tok_s(batch: int) -> float:
        return bandwidth / (weights + batch * per_seq) if batch else 0.0

    stored = {name: stored_bytes_per_token(shape, bits, chunk_size)
              for name, bits in (("lossless", None), ("int8", 8), ("int4", 4))}
    prefix = {}
    if shared_prefix:
        shared = min(shared_prefix, context)
        prefix = {
            "tokens": shared,
            "prefill_tokens_saved_per_request": shared,
            "prefill_fraction_saved": shared / context,
            "store_bytes_once": {name: math.ceil(b * shared) for name, b in stored.items()},
        }
    return CapacityReport(
        memory_bytes=memory_bytes, context=context, weight_bytes=weights,
        weights_exact=shape.weight_bytes_exact is not None, margin_bytes=margin_bytes, kv_pool_bytes=pool,
        kv_bytes_per_token=kv_bytes_per_token(shape), kv_bytes_per_sequence=per_seq, max_sequences=int(max_seqs),
        can_serve=max_seqs >= 1, bandwidth_gb_s=bandwidth_gb_s, decode_tok_s_one_sequence=tok_s(1),
        decode_tok_s_per_sequence_at_max=tok_s(int(max_seqs)),
        decode_tok_s_aggregate_at_max=tok_s(int(max_seqs)) * max_seqs, stored_bytes_per_token=stored,
        shared_prefix=prefix,
    )


def checkpoint_weight_bytes(path: str | Path, dtype_bytes: int) -> int | None:
    """Exact bytes of a local checkpoint's tensors once loaded with floats of ``dtype_bytes``
    (read from the safetensors headers only), or None when there are no safetensors files."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    floats = {"F64", "F32", "F16", "BF16"}
    sizes = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                kind = piece.get_dtype()
                total += math.prod(piece.get_shape()) * (dtype_bytes if kind in floats else sizes.get(kind, 4))
    return total
