"""The cache of one batched decode step: each row's K/V lives in that row's own cache.

``PaddedRowsCache.update`` appends row ``b``'s new K/V to ``rows[b]``'s layer (so sliding
layers trim and reuse layers capture exactly as in a batch-1 ``generate``) and returns the rows
right-padded to the longest one; :func:`decode_masks` built the matching attention masks before
the forward (a row attends to its own visible keys only). The model code is untouched: the
masks are passed as a 4D ``attention_mask`` (or one per layer type), which transformers uses
as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASKED_ATTENTION = ("sdpa", "eager", "kvboost_sdpa")  # implementations that take a 4D mask as is


def visible_length(layer) -> int:
    """Keys the layer's ``update`` returns when one more token is appended (its window when sliding)."""
    if getattr(layer, "is_sliding", False):
        window = layer.sliding_window
        return min(layer.cumulative_length, window - 1) + 1
    return layer.get_seq_length() + 1


@dataclass(frozen=True)
class StepMasks:
    """Per-row visible key lengths for each layer kind, and the ``attention_mask`` argument to pass."""

    lengths: dict[bool, list[int]]  # is_sliding -> one length per row
    attention_mask: torch.Tensor | dict[str, torch.Tensor]


def _mask(lengths: list[int], dtype: torch.dtype, implementation: str, device) -> torch.Tensor:
    keep = torch.arange(max(lengths), device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    keep = keep[:, None, None, :]  # [batch, 1, query=1, keys]
    if implementation == "eager":  # eager adds the mask to the scores
        return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)
    return keep


def decode_masks(config, rows: list, dtype: torch.dtype, device) -> StepMasks:
    """Masks for one decode step of ``rows`` (per-request caches, one new token each).

    Raises ``ValueError`` for attention implementations that do not take a prepared 4D mask,
    and for layer kinds other than full and sliding attention.
    """
    implementation = config._attn_implementation
    if implementation not in MASKED_ATTENTION:
        raise ValueError(f"batched decoding needs attn_implementation in {MASKED_ATTENTION}, got {implementation!r}")
    first = rows[0].layers
    kinds = [bool(getattr(layer, "is_sliding", False)) for layer in first]
    lengths: dict[bool, list[int]] = {}
    for kind in set(kinds):
        index = kinds.index(kind)
        lengths[kind] = [visible_length(row.layers[index]) for row in rows]
    masks = {kind: _mask(n, dtype, implementation, device) for kind, n in lengths.items()}
    if len(masks) == 1:
        return StepMasks(lengths, next(iter(masks.values())))
    layer_types = getattr(config, "layer_types", None)
    if not layer_types or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"batched decoding supports full and sliding attention layers, got {layer_types!r}")
    return StepMasks(lengths, {"full_attention": masks[False], "sliding_attention": masks[True]})


class PaddedRowsCache:
    """Duck-typed ``Cache`` for one decode forward over ``rows`` (``[batch, 1]`` input ids).

    ``expected`` (from :func:`decode_masks`) is checked against what each row's layer
    returns, so a mask can never disagree with the keys it masks.
    """

    is_compileable = False

    def __init__(self, rows: list, masks: StepMasks) -> None:
        self.rows = rows
        self.masks = masks
        self._kinds = [bool(getattr(layer, "is_sliding", False)) for layer in rows[0].layers]

    def __len__(self) -> int:
        return len(self._kinds)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(row.get_seq_length(layer_idx) for row in self.rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append row ``b``'s K/V to its own cache; return every row's keys/values right-padded."""
        lengths = self.masks.lengths[self._kinds[layer_idx]]
        batch, heads, _, dim = key_states.shape
        width = max(lengths)
        keys = key_states.new_zeros(batch, heads, width, dim)
        values = value_states.new_zeros(batch, heads, width, dim)
        for b, row in enumerate(self.rows):
            k, v = row.layers[layer_idx].update(key_states[b : b + 1], value_states[b : b + 1])
            if k.shape[-2] != lengths[b]:
                raise RuntimeError(f"row {b} layer {layer_idx}: {k.shape[-2]} keys, mask expects {lengths[b]}")
            keys[b, :, : lengths[b]] = k[0]
            values[b, :, : lengths[b]] = v[0]
        return keys, values
