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

from kvboost_hf.models.shape import (
    ModelShape,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    stored_bytes_per_token,
)

# Fraction of the memory kept free for activations, allocator slack and the runtime itself.
DEFAULT_MARGIN = 0.10


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
