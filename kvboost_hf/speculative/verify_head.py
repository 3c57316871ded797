"""A faster LM head for verification forwards on CPU: the same logits, computed in row blocks.

A verification forward asks the target's LM head for ``k + 1`` rows of logits at once. On CPU,
torch's float32 matmul is badly slow for a tall head (hundreds of thousands of vocabulary rows)
at a handful of input rows: measured on this project's CPUs, Gemma-3-270M's 262k x 640 head
costs 24 ms for 1 row, 52 ms for 4 and 82 ms for 8, but 44 ms for 8 when the weight is walked
in blocks of a few hundred vocabulary rows (each block's operands stay in cache). The blocked
product is the same computation split by output column, so it gives the same numbers; that is
checked, not assumed.

:func:`row_blocked_head` installs the blocked forward on a model's output embedding for the
duration of a speculative request. For each input row count it first computes both ways, once
per process, and keeps the blocked way only if it is **bitwise equal** to the plain product and
faster; otherwise that row count stays on ``F.linear``. So this can only change speed, never
output.

A multi-row product still differs from a one-row (decode) product in the last bits, whatever the
blocking, so a float32 row whose two best logits are too close to be ordered reliably is
recomputed the way a decode step computes it (:func:`redo_near_ties`, with a worst-case error
bound): the greedy token of every verified position is the one decoding would pick.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvboost_hf.speculative.instance_forward import forward_installed

logger = logging.getLogger(__name__)

MIN_VOCAB_ROWS = 16384  # smaller heads gain too little to be worth the first-call measurement
MAX_INPUT_ROWS = 64  # verification forwards carry at most a few dozen rows
BLOCK_BYTES = 1 << 20  # weight bytes per block: a few hundred rows of a typical head
MIN_SPEED_UP = 1.2  # the blocked way must beat the plain one by this much to be chosen

_choices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> {(rows, dtype): bool}
_row_norms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> ((ptr, version), max row norm)
_measuring = threading.local()  # .seconds: this thread's time spent measuring the second way


def block_rows(in_features: int, element_size: int) -> int:
    """Weight rows per block: about :data:`BLOCK_BYTES`, a multiple of 64."""
    return max(64, BLOCK_BYTES // (in_features * element_size) // 64 * 64)


def blocked_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x2, weight, bias)`` for 2-D ``x2``, walking ``weight`` in blocks of rows."""
    rows = block_rows(weight.shape[1], weight.element_size())
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
    for start in range(0, weight.shape[0], rows):
        torch.mm(x2, weight[start:start + rows].T, out=out[:, start:start + rows])
    return out if bias is None else out + bias


def _blockable(head: nn.Linear, x: torch.Tensor, rows: int) -> bool:
    """Whether a multi-row call without autograd (the forward checks both) may be computed in blocks."""
    w = head.weight
    return w.device.type == "cpu" and w.shape[0] >= MIN_VOCAB_ROWS and rows <= MAX_INPUT_ROWS and x.dtype == w.dtype


def _choose(head: nn.Linear, x2: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """Compute both ways once for this row count; keep blocked only if identical and faster."""
    start = time.perf_counter()
    plain = F.linear(x2, head.weight, head.bias)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    blocked = blocked_linear(x2, head.weight, head.bias)
    blocked_s = time.perf_counter() - start
    identical = torch.equal(plain, blocked)
    use = identical and blocked_s * MIN_SPEED_UP < plain_s
    _measuring.seconds = measuring_seconds() + time.perf_counter() - start
    logger.debug("LM head at %d rows: plain %.1f ms, row-blocked %.1f ms, identical=%s -> %s", x2.shape[0],
                 plain_s * 1e3, blocked_s * 1e3, identical, "blocked" if use else "plain")
    return use, plain


def measuring_seconds() -> float:
    """Time this thread has spent computing a head product a second way, to choose (a one-off per row
    count). Cost models subtract it: it is not what a round with that many rows costs from then on."""
    return getattr(_measuring, "seconds", 0.0)


def _forward(head: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        grad = torch.is_grad_enabled() and (head.weight.requires_grad or x.requires_grad)
        if rows < 2 or grad:
            return F.linear(x, head.weight, head.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if _blockable(head, x, rows):
            choices = _choices.setdefault(head, {})
            key = (rows, x.dtype)
            if key not in choices:
                choices[key], out = _choose(head, x2)
            elif choices[key]:
                out = blocked_linear(x2, head.weight, head.bias)
            else:
                out = F.linear(x2, head.weight, head.bias)
        else:
            out = F.linear(x2, head.weight, head.bias)
        if x.dtype == torch.float32 and head.weight.dtype == torch.float32:
            redo_near_ties(head, x2, out)
        return out.reshape(*x.shape[:-1], head.weight.shape[0])

    return forward


def near_tie_bound(head: nn.Linear, x2: torch.Tensor) -> torch.Tensor:
    """Per row of ``x2``, a bound on how far apart two float32 computations of one of its logits can
    be: each is within ``gamma_K * sum|x_k w_k| <= gamma_K * |x| * max_v |w_v|`` of the exact value."""
    k = head.in_features
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    return 2 * gamma * x2.norm(dim=-1) * _max_row_norm(head)


def redo_near_ties(head: nn.Linear, x2: torch.Tensor, out: torch.Tensor) -> int:
    """Recompute, one row at a time as a decode step computes it, every row of ``out`` whose top two
    logits are closer than twice :func:`near_tie_bound` (or 1e-4 of the top logit: soft-capping
    compresses gaps), so a multi-row call picks the same greedy token as decoding. Returns how many."""
    top = out.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    limit = torch.maximum(2 * near_tie_bound(head, x2), 1e-4 * top[:, 0].abs())
    rows = torch.nonzero(gap <= limit).flatten().tolist()
    for i in rows:
        out[i] = F.linear(x2[i : i + 1], head.weight, head.bias)[0]
    return len(rows)


def _max_row_norm(head: nn.Linear) -> float:
    w = head.weight
    version = (w.data_ptr(), w._version)
    cached = _row_norms.get(head)
    if cached is None or cached[0] != version:
        cached = (version, float(w.detach().norm(dim=1).max()))
        _row_norms[head] = cached
    return cached[1]


@contextlib.contextmanager
def row_blocked_head(model: nn.Module) -> Iterator[None]:
    """While inside, ``model``'s output embedding (a plain ``nn.Linear``) computes multi-row logits in
    row blocks where that was measured faster and bitwise identical. Re-entrant and thread-safe: the
    forward is installed by the first entry and removed by the last exit. A head of another class is
    left alone; one of fewer than :data:`MIN_VOCAB_ROWS` rows is never blocked, only its near ties
    are recomputed (:func:`redo_near_ties`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        yield
        return
    with forward_installed(head, lambda module, _before: _forward(module)):
        yield
