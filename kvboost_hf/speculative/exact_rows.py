"""Verification forwards whose every row is computed exactly as a one-token decode step computes it.

Speculative decoding is exact only if the target's logits for ``k + 1`` verified positions equal
those of ``k + 1`` decode steps. On an AWQ int4 target the linears are row-independent (torch's
int4 kernel gives each row the same bits whatever the number of rows; tested), but attention is
not: one SDPA call over ``k + 1`` queries forms its query-key products as a matrix product, a
one-query decode step as a vector product, and the last bits differ (~1e-7). The int4 linears
round their activations to bf16, which turns such bits into visible differences (0.1 in a
Gemma-3-270M hidden state), and greedy tokens flipped in 3 of 12 benchmark requests.

So on such a target every forward after the prompt prefill (a verification, or a plain step of
the assisted loop) routes ``kvboost_sdpa`` to :func:`row_exact_attention`: one call for all rows
where the layer's own attention computes rows alone (``OwnedAttention.decode_rows``: kvboost_hf's
attention kernel), else one stock SDPA call per query row, over exactly the keys a decode step of
that row sees (the whole past, or the last ``sliding_window`` on a sliding layer), with the mask
the decode step passes (none, or an all-True one once a sliding window is full:
:func:`kvboost_hf.models.attention.decode_step_mask`). The LM head's rows are made exact separately
(:mod:`.verify_head`). Float targets keep the batched call: their float matmuls differ by row count
anyway (~1e-6, a near-tie caveat shared with transformers' own assisted decoding).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from kvboost_hf.models import attention
from kvboost_hf.models.attention import attention_implementation
from kvboost_hf.speculative.verify_head import row_blocked_head
from kvboost_hf.streaming.loader import RUNTIME_ATTR


def needs_exact_rows(model: nn.Module) -> bool:
    """Whether verification on ``model`` routes attention per row: an AWQ int4 model on SDPA."""
    config = getattr(model, "config", None)
    return (getattr(model, RUNTIME_ATTR, None) is not None and config is not None
            and attention_implementation(config) in attention.SDPA_IMPLEMENTATIONS)


def row_exact_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, *,
                        expected_rows: int | None = None, scaling: float | None = None,
                        sliding_window: int | None = None, **kwargs):
    """Attention of ``query``'s rows (the last rows of ``key``), each as its own decode step would run it.

    A forward of another row count than ``expected_rows`` (the last accepted token and the drafts:
    a round-0 draft rides on the prompt prefill, which plain decoding batches) keeps the batched call.
    One row is handled too: during assisted decoding a sliding layer may hold more than its window
    (a cache filled from the store keeps its past for cropping), where plain decoding holds exactly
    the window; and the call must carry the decode step's mask either way."""
    rows = query.shape[2]
    if query.shape[0] != 1 or (expected_rows is not None and rows != expected_rows):
        return attention.sdpa_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    window = attention.layer_window(module, sliding_window)
    owned = attention.owned_attention(module, query)
    rows_at_once = None if owned is None else owned.decode_rows(module, query, key, value, window=window,
                                                                scaling=scaling, **kwargs)
    if rows_at_once is not None:  # an attention whose rows are computed alone (kvboost's kernel)
        return rows_at_once, None
    kwargs.pop("is_causal", None)
    total = key.shape[-2]
    first = max(0, total - rows + 1 - window) if window is not None else 0  # the first key any row reads
    # Cast once for all rows (not per row), and only the keys some row reads.
    query, key, value, dtype = attention.float32_inputs(module, query, key[:, :, first:], value[:, :, first:])
    outputs = []
    for i in range(rows):
        end = total - rows + i + 1
        start = max(0, end - window) if window is not None else 0
        # Contiguous, as a decode step's cast keys are (with several key heads a slice is strided).
        keys = key[:, :, start - first : end - first].contiguous()
        values = value[:, :, start - first : end - first].contiguous()
        out, _ = attention.sdpa_forward(module, query[:, :, i : i + 1], keys, values,
                                        attention.decode_step_mask(window, end - start, query.device), scaling=scaling,
                                        is_causal=False, **kwargs)
        outputs.append(out)
    out = torch.cat(outputs, dim=1)
    return (out if dtype is None else out.to(dtype)), None


def route_rows(rows: int | None) -> None:
    """Route this thread's ``kvboost_sdpa`` calls to :func:`row_exact_attention` for forwards of ``rows``
    query rows (None: stop routing)."""
    route = None if rows is None else functools.partial(row_exact_attention, expected_rows=rows)
    if route is not None:
        setattr(route, attention.DECODE_EXACT, True)
    attention.set_attention_route(route)


@contextlib.contextmanager
def verifying(model: nn.Module) -> Iterator[bool]:
    """For one speculative generate call: the row-blocked LM head, and on a target that
    :func:`needs_exact_rows`, attention named ``kvboost_sdpa`` (stock SDPA until a verification
    forward on this thread routes it). Yields whether verification forwards must route attention
    per row. The attention switch is made once per model and kept (:func:`attention.use_kvboost_sdpa`):
    the config is shared by concurrent requests, so none puts it back."""
    exact = needs_exact_rows(model) and attention.use_kvboost_sdpa(model)
    try:
        with row_blocked_head(model):
            yield exact
    finally:
        route_rows(None)
