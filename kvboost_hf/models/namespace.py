"""A model's namespace key, memoised per model state (the fingerprint reads every weight byte)."""

from __future__ import annotations

import threading
import weakref

import torch

from kvboost_hf.models.fingerprint import model_namespace, model_state_token
from kvboost_hf.models.target import target_model
from kvboost_hf.store.keys import Key

# Namespace keys per model, kept across enable/disable of reuse.
_namespaces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_namespace_lock = threading.Lock()


def namespace(model: torch.nn.Module, refresh: bool = False) -> Key:
    """The model's namespace key, recomputed only when :func:`model_state_token` moves (or ``refresh``).

    Raises :class:`~kvboost_hf.models.fingerprint.UnfingerprintableModel` when the weights cannot be read.
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
    return namespace(target_model(model), refresh=True)
