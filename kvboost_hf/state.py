"""Per-model reuse state, and the model's namespace key memoised per model state."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_hf.rope import RopeShifter
from kvboost_hf.segments import segment_starts
from kvboost_hf.store import ChunkStore
from kvboost_hf.store.keys import Key, model_namespace, model_state_token
from kvboost_hf.telemetry import ReuseStats

STATE_ATTR = "_kvboost_reuse"

# Namespace keys per model, kept across enable/disable: the fingerprint reads every weight byte.
_namespaces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_namespace_lock = threading.Lock()


@dataclass
class ReuseState:
    """What :func:`kvboost_hf.enable_chunk_reuse` installed on one model."""

    store: ChunkStore
    hooks: list = field(default_factory=list)
    last_stats: ReuseStats | None = None
    strategy: Any = None  # None: exact prefix reuse only
    shifter: RopeShifter | None = None
    approximate_refusal: str = ""  # why moved chunks are not reused on this model
    turn_tokens: tuple[int, ...] = ()
    separator: tuple[int, ...] = ()
    leading_special: tuple[int, ...] = ()
    original_attention: str | None = None
    default_draft: Any = None  # kvboost_hf.speculative.set_default_draft
    default_speculation: Any = None
    speculation_totals: Any = None
    speculation_costs: dict = field(default_factory=dict)  # draft key -> CostMemory of its last request

    def boundaries(self, token_ids: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
        return segment_starts(token_ids, self.turn_tokens, self.separator, extra, self.leading_special)


def reuse_state(model: torch.nn.Module) -> ReuseState | None:
    """The reuse state installed on ``model`` (the transformers model itself), or None."""
    return model.__dict__.get(STATE_ATTR)


def namespace(model: torch.nn.Module, refresh: bool = False) -> Key:
    """The model's namespace key, recomputed only when :func:`model_state_token` moves (or ``refresh``).

    Raises :class:`~kvboost_hf.store.keys.UnfingerprintableModel` when the weights cannot be read.
    """
    token = model_state_token(model)
    with _namespace_lock:
        memo = _namespaces.get(model)
        if not refresh and memo is not None and memo[0] == token:
            return memo[1]
    key = model_namespace(model)
    with _namespace_lock:
        _namespaces[model] = (token, key)
    return key


def refresh_namespace(model: torch.nn.Module) -> bytes:
    """Recompute ``model``'s namespace now, from every weight byte; returns the key.

    Call it after changing weights in a way the per-request check cannot see: writes through
    ``param.data`` / ``tensor.numpy()`` views or from another library's kernels that touch few
    elements. Everything done through the parameters themselves (optimizer steps,
    ``load_state_dict``, ``copy_``, merges, ``.to()``) is noticed on the next request.
    """
    from kvboost_hf.reuse import _target  # noqa: PLC0415 - reuse imports this module

    return namespace(_target(model), refresh=True)
