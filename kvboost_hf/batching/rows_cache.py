"""The cache of one padded forward over several requests, each keeping its K/V in its own cache.

The runner uses it for models on eager attention (SDPA models run packed forwards:
:mod:`.packed`).

Each row forwards ``new[b]`` tokens (1 for a decode step, a prompt chunk for a prefill), left-
padded to the widest row so every row's last token sits in the last column (``logits_to_keep=1``
serves them all). ``PaddedRowsCache.update`` appends row ``b``'s real K/V to ``rows[b]``'s layer
(so sliding layers trim, and reuse layers capture for the store, exactly as in a batch-1
``generate``) and returns the rows right-padded to the longest; :func:`row_masks` builds the
matching masks before the forward: causal by position inside each row, the sliding window for
sliding layers, nothing of the padding. The model code is untouched: the masks go in as a
prepared 4D ``attention_mask`` (one per layer type for models mixing sliding and full
attention), which transformers uses as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost_hf.models.attention import attention_implementation

MASKED_ATTENTION = ("sdpa", "eager", "kvboost_sdpa")  # implementations that take a 4D mask as is


def visible_before(layer) -> int:
    """Keys the layer returns besides the new ones at its next ``update`` (its window when sliding)."""
    if getattr(layer, "is_sliding", False):
        return min(layer.cumulative_length, layer.sliding_window - 1)
    return layer.get_seq_length()


@dataclass(frozen=True)
class StepMasks:
    """New tokens per row, visible keys per row before the step for each layer kind, and the mask argument."""

    new: list[int]
    before: dict[bool, list[int]]  # is_sliding -> one count per row
    attention_mask: torch.Tensor | dict[str, torch.Tensor]

    def keys(self, sliding: bool, row: int) -> int:
        return self.before[sliding][row] + self.new[row]


def _mask(before: list[int], new: list[int], window: int | None, dtype: torch.dtype, implementation: str,
          device) -> torch.Tensor:
    """``[rows, 1, width, keys]``: query column c of row b (left-padded) against that row's keys."""
    width, total = max(new), max(b + n for b, n in zip(before, new))
    b_t = torch.tensor(before, device=device)[:, None, None]
    n_t = torch.tensor(new, device=device)[:, None, None]
    i = torch.arange(width, device=device)[None, :, None] - (width - n_t)  # index among the row's new tokens
    j = torch.arange(total, device=device)[None, None, :]
    query = b_t + i  # the query's own index among the row's keys
    keep = (j <= query) & (j < b_t + n_t)
    if window is not None:
        keep &= (query - j) < window
    keep = torch.where(i < 0, j == 0, keep)  # padding columns look at one key (no NaN); their output is unused
    keep = keep[:, None]
    if implementation == "eager":  # eager adds the mask to the scores
        return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)
    return keep


def check_attention(config) -> None:
    """Raise ``ValueError`` when the model's attention cannot take prepared masks."""
    if attention_implementation(config) not in MASKED_ATTENTION:
        raise ValueError(f"batched decoding needs attn_implementation in {MASKED_ATTENTION} "
                         f"(load the model with attn_implementation='sdpa'), got {attention_implementation(config)!r}")


def row_masks(config, rows: list, new: list[int], dtype: torch.dtype, device) -> StepMasks:
    """Masks for one forward of ``new[b]`` tokens of each of ``rows`` (per-request caches).

    Raises ``ValueError`` for attention implementations that do not take a prepared 4D mask,
    and for layer kinds other than full and sliding attention.
    """
    check_attention(config)
    layers = rows[0].layers
    kinds = [bool(getattr(layer, "is_sliding", False)) for layer in layers]
    before, masks = {}, {}
    for kind in set(kinds):
        first = layers[kinds.index(kind)]
        before[kind] = [visible_before(row.layers[kinds.index(kind)]) for row in rows]
        window = first.sliding_window if kind else None
        masks[kind] = _mask(before[kind], new, window, dtype, attention_implementation(config), device)
    if len(masks) == 1:
        return StepMasks(new, before, next(iter(masks.values())))
    layer_types = getattr(config, "layer_types", None)
    if not layer_types or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"batched decoding supports full and sliding attention layers, got {layer_types!r}")
    return StepMasks(new, before, {"full_attention": masks[False], "sliding_attention": masks[True]})


class PaddedRowsCache:
    """Duck-typed ``Cache`` for one forward over ``rows`` (``[batch, width]`` left-padded input ids).

    The key counts of ``masks`` are checked against what each row's layer returns, so a mask
    can never disagree with the keys it masks.
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
        """Append row ``b``'s real K/V to its own cache; return every row's keys/values right-padded."""
        kind = self._kinds[layer_idx]
        batch, heads, width, dim = key_states.shape
        counts = [self.masks.keys(kind, b) for b in range(batch)]
        keys = key_states.new_zeros(batch, heads, max(counts), dim)
        values = value_states.new_zeros(batch, heads, max(counts), dim)
        for b, row in enumerate(self.rows):
            start = width - self.masks.new[b]
            k, v = row.layers[layer_idx].update(key_states[b : b + 1, :, start:], value_states[b : b + 1, :, start:])
            if k.shape[-2] != counts[b]:
                raise RuntimeError(f"row {b} layer {layer_idx}: {k.shape[-2]} keys, the mask expects {counts[b]}")
            keys[b, :, : counts[b]] = k[0]
            values[b, :, : counts[b]] = v[0]
        return keys, values
