"""One forward over several requests packed into one sequence, each attending to its own cache.

The new tokens of every row (one for a decoding request, a prompt chunk for a prefilling one)
are concatenated into a single ``[1, tokens]`` input with per-token positions, so decode steps
and prompt chunks share one pass over the weights and nothing is padded.
``PackedRowsCache.update`` appends each row's slice of the new K/V to that row's own cache layer
(so sliding layers trim, and reuse layers capture for the store, exactly as in a batch-1
``generate``) and keeps what the layer returned; :func:`packed_rows_attention` then runs
transformers' own SDPA attention once per row, over that row's keys only: a decoding row gets
exactly the call a batch-1 decode step makes (no mask, or the all-True one transformers passes
once a sliding window is full), a prompt chunk gets its causal (and sliding-window) mask.
Transformers' model code is untouched: the attention function is ``kvboost_sdpa`` (registered
through ``AttentionInterface``), which is stock SDPA outside a packed forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvboost_hf.models import attention

PACKED_ATTENTION = attention.SDPA_IMPLEMENTATIONS  # implementations a packed forward runs on


@dataclass(frozen=True)
class Segment:
    """Row ``row``'s ``length`` new tokens sit at ``start`` in the packed sequence."""

    row: int
    start: int
    length: int


def segments_of(new: list[int]) -> list[Segment]:
    """Consecutive segments for rows forwarding ``new[b]`` tokens each."""
    out, start = [], 0
    for row, n in enumerate(new):
        if n < 1:
            raise ValueError(f"row {row} forwards {n} tokens: every packed row forwards at least one")
        out.append(Segment(row, start, n))
        start += n
    return out


class PackedRowsCache:
    """Duck-typed ``Cache`` for one packed forward over ``rows`` (each a per-request cache).

    ``update`` returns its inputs unchanged: the keys attention needs are each row's own, kept
    in :attr:`layer_states` for :func:`packed_rows_attention` of the same layer.
    """

    is_compileable = False

    def __init__(self, rows: list, new: list[int]) -> None:
        if not rows or len(rows) != len(new):
            raise ValueError(f"{len(rows)} row caches for {len(new)} rows of new tokens")
        self.rows = rows
        self.segments = segments_of(new)
        self.layer_idx: int | None = None
        self.layer_states: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.rows[0].layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(row.get_seq_length(layer_idx) for row in self.rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append each row's new K/V (``[1, heads, tokens, dim]``, packed) to its own cache layer."""
        if key_states.shape[0] != 1 or key_states.shape[-2] != self.segments[-1].start + self.segments[-1].length:
            raise RuntimeError(f"packed forward: got K/V of shape {tuple(key_states.shape)} for "
                               f"{len(self.segments)} rows of {self.segments[-1].start + self.segments[-1].length} tokens")
        states = []
        for seg, row in zip(self.segments, self.rows):
            end = seg.start + seg.length
            states.append(row.layers[layer_idx].update(key_states[:, :, seg.start : end],
                                                       value_states[:, :, seg.start : end]))
        self.layer_idx, self.layer_states = layer_idx, states
        return key_states, value_states


@contextlib.contextmanager
def packed_forward(cache: PackedRowsCache) -> Iterator[None]:
    """Route this thread's ``kvboost_sdpa`` attention calls to :func:`packed_rows_attention` for ``cache``."""
    if attention.attention_route() is not None:
        raise RuntimeError("a packed forward is already running on this thread")
    attention.set_attention_route(lambda *args, **kwargs: packed_rows_attention(cache, *args, **kwargs))
    try:
        yield
    finally:
        attention.set_attention_route(None)


def chunk_mask(before: int, new: int, window: int | None, device) -> torch.Tensor:
    """``[1, 1, new, before + new]`` bool: new token i sees keys up to itself (within ``window``)."""
    query = before + torch.arange(new, device=device)[:, None]
    key = torch.arange(before + new, device=device)[None, :]
    keep = key <= query
    if window is not None:
        keep &= (query - key) < window
    return keep[None, None]


def packed_rows_attention(cache: PackedRowsCache, module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask, *, scaling: float | None = None,
                          sliding_window: int | None = None, **kwargs):
    """Attention of a packed forward: each row's queries against that row's keys (stock SDPA per row).

    ``key``/``value``/``attention_mask`` are the packed forward's placeholders and are not used.
    Returns ``([1, tokens, heads, dim], None)`` like every transformers attention function.
    """
    if cache.layer_idx != module.layer_idx:
        raise RuntimeError(f"packed attention for layer {module.layer_idx} without that layer's row K/V")
    window = attention.layer_window(module, sliding_window)
    outputs = []
    kwargs.pop("is_causal", None)
    for seg, (keys, values) in zip(cache.segments, cache.layer_states):
        q = query[:, :, seg.start : seg.start + seg.length]
        mask = None
        if seg.length == 1:
            if window is not None and keys.shape[-2] > window:  # a full layer with a window
                keys, values = keys[:, :, -window:], values[:, :, -window:]
            mask = attention.decode_step_mask(window, keys.shape[-2], query.device)
        else:
            mask = chunk_mask(keys.shape[-2] - seg.length, seg.length, window, query.device)
        out, _ = attention.sdpa_forward(module, q, keys, values, mask, scaling=scaling, is_causal=False, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0], None
