"""How a chunk's K/V are held at rest (dense, or KIVI-quantized with full-precision sink tokens), and a hit on one."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from kvboost_hf.store.keys import Key
from kvboost_hf.store.quant import QuantizedTensor, quantize_keys, quantize_values

Encoded = torch.Tensor | QuantizedTensor

# Bookkeeping bytes per entry beyond its tensors and token ids (key, dict slots, dataclass).
logger = logging.getLogger(__name__)

ENTRY_OVERHEAD_BYTES = 256
# Per token: its id (8) and its logprob (4, float32), counted from the start although a logprob is
# attached later (``store.logprobs``), so attaching one never takes a store past its budget.
TOKEN_BYTES = 12


def _nbytes(piece: Encoded) -> int:
    return piece.nbytes if isinstance(piece, QuantizedTensor) else piece.numel() * piece.element_size()


def _dense(piece: Encoded) -> torch.Tensor:
    return piece.dequantize() if isinstance(piece, QuantizedTensor) else piece


@dataclass
class StoredChunk:
    """One chunk of a prefix chain: the prefill K/V of ``token_ids`` at positions ``start...``.

    Per layer, ``keys[i]`` / ``values[i]`` hold tokens ``[dense_tokens:]`` (dense tensors, or
    quantized) and ``sink_keys[i]`` / ``sink_values[i]`` the first ``dense_tokens`` tokens in
    full precision. Tensors are ``[num_kv_heads, num_tokens, head_dim]``.
    """

    key: Key
    parent: Key
    namespace: Key
    start: int
    token_ids: tuple[int, ...]
    keys: list[Encoded]
    values: list[Encoded]
    dense_tokens: int = 0
    sink_keys: list[torch.Tensor] = field(default_factory=list)
    sink_values: list[torch.Tensor] = field(default_factory=list)
    pinned: bool = False
    hits: int = 0
    last_used: int = 0
    nbytes: int = 0
    # float32 [num_tokens]: each token's logprob given every token before it (NaN for a chain's first
    # token); None until a forward that computed them attached them (``store.logprobs``).
    logprobs: torch.Tensor | None = None
    owner: str | None = None  # who the store charges it to (CacheScope.owner): quotas and purges
    generation: int = 0  # the owner's purges (as Redis counted them) when it was stored: older ones are stale

    def __post_init__(self) -> None:
        pieces = (*self.keys, *self.values, *self.sink_keys, *self.sink_values)
        self.nbytes = sum(_nbytes(p) for p in pieces) + TOKEN_BYTES * len(self.token_ids) + ENTRY_OVERHEAD_BYTES

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def is_exact(self) -> bool:
        """Whether every token is held in the model's own precision."""
        return self.bits is None

    @property
    def bits(self) -> int | None:
        """Storage precision: None when every token is held in the model's own dtype, else the fewest bits used."""
        return min((p.bits for p in (*self.keys, *self.values) if isinstance(p, QuantizedTensor)), default=None)

    def exact_tokens(self, n: int) -> int:
        """How many of the first ``n`` tokens load bit for bit."""
        return n if self.is_exact else min(n, self.dense_tokens)

    def layer_states(self, layer: int, n: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values of tokens ``[offset, offset + n)`` of layer ``layer``."""
        k, v = _dense(self.keys[layer]), _dense(self.values[layer])
        if self.sink_keys:
            k = torch.cat([self.sink_keys[layer], k], dim=1)
            v = torch.cat([self.sink_values[layer], v], dim=1)
        return k[:, offset : offset + n, :], v[:, offset : offset + n, :]


@dataclass(frozen=True)
class ChunkHit:
    """Tokens ``[offset, offset + num_tokens)`` of ``chunk`` reused at prompt position ``start``.

    ``exact`` hits sit behind exactly the tokens they were computed after (prefix hits);
    content hits (``exact=False``) were computed elsewhere and must be moved and repaired.
    """

    chunk: StoredChunk
    start: int
    num_tokens: int
    offset: int = 0
    exact: bool = True

    @property
    def exact_tokens(self) -> int:
        return self.chunk.exact_tokens(self.num_tokens) if self.exact else 0

    @property
    def source_start(self) -> int:
        """Position at which the reused tokens were computed."""
        return self.chunk.start + self.offset

    def layer_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chunk.layer_states(layer, self.num_tokens, self.offset)


def encode_chunk(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    bits: int | None,
    group_size: int | None,
    dense_tokens: int,
) -> dict:
    """StoredChunk fields for dense per-layer K/V: quantized past the first ``dense_tokens``."""
    if bits is None:
        return dict(keys=keys, values=values, dense_tokens=0, sink_keys=[], sink_values=[])
    n = keys[0].shape[1]
    d = max(0, min(dense_tokens, n))
    if d == n:
        return dict(keys=keys, values=values, dense_tokens=0, sink_keys=[], sink_values=[])
    return dict(
        keys=[quantize_keys(k[:, d:].contiguous(), bits) for k in keys],
        values=[quantize_values(v[:, d:].contiguous(), bits, group_size) for v in values],
        dense_tokens=d,
        sink_keys=[k[:, :d].contiguous() for k in keys] if d else [],
        sink_values=[v[:, :d].contiguous() for v in values] if d else [],
    )


# ---------------------------------------------------------------------- safetensors form
def _put(tensors: dict, meta: dict, name: str, piece: Encoded) -> None:
    if isinstance(piece, QuantizedTensor):
        tensors[f"{name}.codes"] = piece.codes
        tensors[f"{name}.scale"] = piece.scale
        tensors[f"{name}.zero"] = piece.zero
        meta[name] = [piece.bits, list(piece.shape), list(piece.out_shape), str(piece.dtype).removeprefix("torch.")]
    else:
        tensors[name] = piece


def _get(tensors: dict, meta: dict, name: str) -> Encoded:
    if name in meta:
        bits, shape, out_shape, dtype = meta[name]
        return QuantizedTensor(
            tensors[f"{name}.codes"], tensors[f"{name}.scale"], tensors[f"{name}.zero"],
            bits, tuple(shape), tuple(out_shape), getattr(torch, dtype),
        )
    return tensors[name]


def to_tensors(entry: StoredChunk) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Flat tensors and string metadata of ``entry`` for a safetensors file."""
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, list] = {}
    for i in range(entry.num_layers):
        _put(tensors, quantized, f"k{i}", entry.keys[i])
        _put(tensors, quantized, f"v{i}", entry.values[i])
        if entry.sink_keys:
            tensors[f"sk{i}"], tensors[f"sv{i}"] = entry.sink_keys[i], entry.sink_values[i]
    if entry.logprobs is not None:  # covered by the blob's checksum like every tensor
        tensors["logprobs"] = entry.logprobs
    metadata = {
        "parent": entry.parent.hex(),
        "namespace": entry.namespace.hex(),
        "start": str(entry.start),
        "tokens": json.dumps(list(entry.token_ids)),
        "layers": str(entry.num_layers),
        "dense_tokens": str(entry.dense_tokens),
        "quantized": json.dumps(quantized),
        "kv_bits": "none" if entry.bits is None else str(entry.bits),
        "pinned": "1" if entry.pinned else "0",
    }
    if entry.owner is not None:
        metadata["owner"] = entry.owner
    if entry.generation:
        metadata["generation"] = str(entry.generation)
    return {k: v.detach().to("cpu") for k, v in tensors.items()}, metadata


def from_tensors(key: Key, tensors: dict[str, torch.Tensor], metadata: dict[str, str], device=None) -> StoredChunk:
    """Inverse of :func:`to_tensors` (tensors moved to ``device`` when given)."""
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    quantized = json.loads(metadata["quantized"])
    layers = int(metadata["layers"])
    has_sink = "sk0" in tensors
    return StoredChunk(
        key=key,
        parent=bytes.fromhex(metadata["parent"]),
        namespace=bytes.fromhex(metadata["namespace"]),
        start=int(metadata["start"]),
        token_ids=tuple(json.loads(metadata["tokens"])),
        keys=[_get(tensors, quantized, f"k{i}") for i in range(layers)],
        values=[_get(tensors, quantized, f"v{i}") for i in range(layers)],
        dense_tokens=int(metadata["dense_tokens"]),
        sink_keys=[tensors[f"sk{i}"] for i in range(layers)] if has_sink else [],
        sink_values=[tensors[f"sv{i}"] for i in range(layers)] if has_sink else [],
        pinned=metadata.get("pinned") == "1",
        logprobs=_logprobs_of(tensors, len(json.loads(metadata["tokens"]))),
        owner=metadata.get("owner"),
        generation=int(metadata.get("generation", 0)),
    )


def _logprobs_of(tensors: dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor | None:
    """The blob's per-token logprobs; None in blobs written before they existed or of the wrong shape."""
    value = tensors.get("logprobs")
    if value is None or value.dtype != torch.float32 or tuple(value.shape) != (num_tokens,):
        return None
    return value


def chunk_from_blob(key: Key, blob: tuple[dict[str, torch.Tensor], dict[str, str]] | None) -> StoredChunk | None:
    """A verified blob's chunk; None for no blob, or when its (checksummed but forged) layout does not decode."""
    if blob is None:
        return None
    try:
        return from_tensors(key, *blob)
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError) as err:
        logger.warning("a stored entry passed its checksum but does not decode (%s); not used", err)
        return None
