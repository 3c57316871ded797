"""Content keys for stored K/V: token chunking, chained prefix hashes, model fingerprints.

A chunk key is ``H(parent_key, token_ids)``; the root of every chain is a namespace key that
covers everything that changes K/V besides the tokens themselves (model config and weights,
dtype, device type, active adapters). Same tokens under another namespace never collide.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import torch

Key = bytes

_DIGEST_SIZE = 16
# Elements sampled per parameter tensor for the weights fingerprint. Strided samples catch any
# realistic weight change (a different checkpoint, fine-tuning, merged adapters) without
# reading all weights on every request.
_SAMPLES_PER_TENSOR = 64


def _digest(*parts: bytes) -> Key:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Canonical byte form of a token id sequence (int64, little endian)."""
    return array("q", token_ids).tobytes()


def chunk_key(parent: Key, token_ids: Sequence[int]) -> Key:
    """Key of a chunk given the key of the chunk before it (or the namespace key)."""
    return _digest(b"chunk", parent, token_bytes(token_ids))


def chunk_spans(num_tokens: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each chunk of a sequence; the last one may be shorter."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    for start in range(0, num_tokens, chunk_size):
        yield start, min(start + chunk_size, num_tokens)


def namespace_key(parts: dict[str, Any]) -> Key:
    """Root key of a prefix chain from a JSON-serialisable description of the K/V producer."""
    return _digest(b"namespace", json.dumps(parts, sort_keys=True, default=str).encode())


def _config_description(model: torch.nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    if config is None:
        return {}
    description = config.to_dict()
    # Where the weights came from does not change K/V; what they are is covered by the weights fingerprint.
    for volatile in ("_name_or_path", "_model_name_or_path", "transformers_version", "_commit_hash"):
        description.pop(volatile, None)
    return description


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every parameter's name, shape, dtype and a strided sample of its values."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.float32)
            h.update(name.encode())
            h.update(str(tuple(param.shape)).encode())
            h.update(str(param.dtype).encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def active_adapters(model: torch.nn.Module) -> list[str]:
    """Names of the peft adapters that take part in the forward pass (empty without peft)."""
    names: set[str] = set()
    for module in model.modules():
        if not hasattr(module, "active_adapters") or not hasattr(module, "disable_adapters"):
            continue
        if module.disable_adapters or getattr(module, "merged", False):
            # Disabled adapters do not act; merged ones live in the base weights already.
            continue
        adapters = module.active_adapters
        names.update([adapters] if isinstance(adapters, str) else adapters)
    return sorted(names)


def model_state_token(model: torch.nn.Module) -> tuple:
    """A cheap token that changes whenever the model's K/V could change.

    Parameter ``_version`` counters move on every in-place write (optimizer steps,
    ``load_state_dict``, adapter merges), so this detects weight changes without hashing them.
    """
    params = list(model.parameters())
    first = params[0] if params else None
    return (
        len(params),
        sum(p._version for p in params),
        tuple(id(p) for p in params[:: max(1, len(params) // 16)]),
        str(first.dtype) if first is not None else "",
        first.device.type if first is not None else "",
        tuple(active_adapters(model)),
    )


def _attention_family(model: torch.nn.Module) -> str | None:
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    # kvboost's registered SDPA (same kernel, position-aware masks) computes the same K/V as SDPA.
    return "sdpa" if name == "kvboost_sdpa" else name


def model_namespace(model: torch.nn.Module, extra: dict[str, Any] | None = None) -> Key:
    """Namespace key for a model: config (incl. RoPE settings), weights, dtype, device type, adapters."""
    first = next(model.parameters(), None)
    parts: dict[str, Any] = {
        "config": _config_description(model),
        "weights": weights_fingerprint(model),
        "dtype": str(first.dtype) if first is not None else None,
        "device_type": first.device.type if first is not None else None,
        "adapters": active_adapters(model),
        "attn_implementation": _attention_family(model),
    }
    if extra:
        parts["extra"] = extra
    return namespace_key(parts)


def segment_spans(num_tokens: int, chunk_size: int, boundaries: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Chunk spans that start a new chunk at every boundary (segment start) and every ``chunk_size`` tokens inside a segment."""
    starts = sorted({b for b in boundaries if 0 < b < num_tokens} | {0}) if num_tokens else []
    spans: list[tuple[int, int]] = []
    for seg_start, seg_end in zip(starts, [*starts[1:], num_tokens]):
        spans.extend((seg_start + s, seg_start + e) for s, e in chunk_spans(seg_end - seg_start, chunk_size))
    return spans
