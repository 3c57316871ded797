"""How reuse attaches to a model: a subclass of its own class whose ``generate`` goes through reuse.

``enable_chunk_reuse`` switches the instance's ``__class__`` to a subclass (same name, same
module) that overrides ``generate`` and nothing else that runs. Keeping the override on a class
rather than on the instance means nothing unpicklable sits in the instance ``__dict__``
besides the reuse state, and that is left out when the model is copied or pickled:
``copy.deepcopy(model)`` and ``torch.save(model)`` give (and store) the plain model, without
reuse hooks, state or store. Reuse is not inherited by a copy; enable it on the copy if wanted.
One exception: with ``recompute_strategy="cacheblend"`` (and, once they have run, on a model served in
batch rows or an int4 target of a speculative request) the model's config names the attention
implementation ``kvboost_sdpa`` (the config object is shared with every layer, so it cannot be
swapped for the pickle); such a pickle loads where ``kvboost_hf`` is imported, or disable reuse
before saving.
"""

from __future__ import annotations

import copyreg
from collections import OrderedDict

import torch

from kvboost_hf.generation.extension import active_sessions, reset_call_cache, set_call_cache
from kvboost_hf.generation.wrapper import generate_with_reuse
from kvboost_hf.reuse import STATE_ATTR

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)

_subclasses: dict[type, type] = {}
# GenerationMixin._get_candidate_generator's parameters after generation_config and input_ids
_CANDIDATE_ARGS = ("inputs_tensor", "logits_processor", "model_kwargs", "assistant_model", "target_tokenizer",
                   "assistant_tokenizer")


class ReuseGenerateMixin:
    """Put first in the MRO of a model's class by :func:`attach`: ``generate`` with chunk reuse."""

    _kvboost_base: type

    def generate(self, *args, **kwargs):
        return generate_with_reuse(self, super().generate, args, kwargs)

    def _get_candidate_generator(self, generation_config, input_ids, *args, **kwargs):
        """HF's choice of candidate generator, as the active generate sessions wrap or replace it
        (:mod:`kvboost_hf.generation.extension`); HF's own when none does."""
        generator = super()._get_candidate_generator(generation_config, input_ids, *args, **kwargs)
        named = {**dict(zip(_CANDIDATE_ARGS, args)), **kwargs}
        token = set_call_cache((named.get("model_kwargs") or {}).get("past_key_values"))
        try:
            for session in active_sessions():
                generator = session.candidate_generator(self, generator, generation_config, input_ids,
                                                        named.get("logits_processor"), named.get("target_tokenizer"))
        finally:
            reset_call_cache(token)
        return generator

    def __reduce_ex__(self, protocol):
        """Copy and pickle as the plain model class: no reuse state, hooks or store.

        ``copyreg._reconstructor`` is what protocol 0/1 pickles use for any object; unlike
        ``__newobj__`` it may build another class than ``type(self)``, and loading the pickle
        needs only the model's own class, not kvboost_hf (cacheblend aside: see the module doc).
        """
        return copyreg._reconstructor, (self._kvboost_base, object, None), plain_state(self)


def plain_state(model: torch.nn.Module) -> dict:
    """``model.__getstate__()`` without what reuse added (its state and its forward hooks)."""
    state = model.__getstate__()
    reuse = state.pop(STATE_ATTR, None)
    hook_ids = {handle.id for handle in reuse.hooks} if reuse is not None else set()
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if hooks and hook_ids & set(hooks):
            state[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in hook_ids)
    return state


def attach(model: torch.nn.Module) -> None:
    """Give ``model`` the reuse subclass of its class (its ``_kvboost_base`` is the original)."""
    base = type(model)
    if isinstance(model, ReuseGenerateMixin):
        return
    if base not in _subclasses:
        _subclasses[base] = type(
            base.__name__,
            (ReuseGenerateMixin, base),
            {"__module__": base.__module__, "__qualname__": base.__qualname__, "_kvboost_base": base},
        )
    model.__class__ = _subclasses[base]


def detach(model: torch.nn.Module) -> None:
    """Undo :func:`attach`."""
    if isinstance(model, ReuseGenerateMixin):
        model.__class__ = model._kvboost_base

