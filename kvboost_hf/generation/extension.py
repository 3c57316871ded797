"""How a capability joins a ``generate`` call without the generation layer knowing it.

An extension (speculative decoding is one) registers under a name. For every generate call on a
model with reuse enabled, each extension's :meth:`GenerateExtension.open` may pop its own keyword
arguments and return a :class:`GenerateSession`; the session then wraps the call
(:meth:`~GenerateSession.around`), may replace transformers' candidate generator
(:meth:`~GenerateSession.candidate_generator`, reached through ``_get_candidate_generator``) and
sees the output and the request's reuse stats before the confirmed K/V is stored
(:meth:`~GenerateSession.finish`). The way transformers' candidate generators never import the
generation loop that drives them, this layer imports no extension: the package's entry point
(``kvboost_hf/__init__.py``) registers them, lazily.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from kvboost_hf.cache import ReuseStats


class GenerateSession(Protocol):
    """One generate call's share of an extension."""

    def around(self) -> AbstractContextManager:
        """A context entered around the whole generate call (after the request's cache is chosen)."""

    def candidate_generator(self, model: torch.nn.Module, generator: Any, generation_config: Any,
                            input_ids: torch.LongTensor, logits_processor: list | None, tokenizer: Any) -> Any:
        """The candidate generator assisted decoding uses (``generator`` is transformers' choice)."""

    def finish(self, output: Any, stats: ReuseStats | None) -> None:
        """After generate returned, before the request's K/V is stored; ``stats`` is the request's."""


class GenerateExtension(Protocol):
    """A capability that joins generate calls."""

    def open(self, model: torch.nn.Module, kwargs: dict, inputs: torch.Tensor | None) -> GenerateSession | None:
        """Pop this extension's arguments from generate's ``kwargs``; a session if the call uses it."""


_registry: dict[str, GenerateExtension | Callable[[], GenerateExtension]] = {}
_resolved: dict[str, GenerateExtension] = {}
_lock = threading.Lock()
_active: contextvars.ContextVar[tuple[GenerateSession, ...]] = contextvars.ContextVar("kvboost_sessions", default=())
_call_cache: contextvars.ContextVar[Any] = contextvars.ContextVar("kvboost_call_cache", default=None)


def register_extension(name: str, extension: GenerateExtension | Callable[[], GenerateExtension]) -> None:
    """Register ``extension`` (or a zero-argument factory, called on the first generate) under ``name``;
    a later registration under the same name replaces it."""
    with _lock:
        _registry[name] = extension
        _resolved.pop(name, None)


def unregister_extension(name: str) -> None:
    """Remove the extension registered under ``name`` (no error if there is none)."""
    with _lock:
        _registry.pop(name, None)
        _resolved.pop(name, None)


def extensions() -> list[GenerateExtension]:
    """The registered extensions, in registration order (factories resolved)."""
    with _lock:
        for name, entry in _registry.items():
            if name not in _resolved:
                _resolved[name] = entry if hasattr(entry, "open") else entry()
        return [_resolved[name] for name in _registry]


def open_sessions(model: torch.nn.Module, kwargs: dict, inputs: torch.Tensor | None) -> tuple[GenerateSession, ...]:
    """Every extension's session for this call (those that take part)."""
    sessions = (extension.open(model, kwargs, inputs) for extension in extensions())
    return tuple(s for s in sessions if s is not None)


def activate(sessions: tuple[GenerateSession, ...]) -> contextvars.Token:
    return _active.set(sessions)


def deactivate(token: contextvars.Token) -> None:
    _active.reset(token)


def active_sessions() -> tuple[GenerateSession, ...]:
    """The sessions of the generate call running in this context."""
    return _active.get()


def call_cache() -> Any:
    """While a session's :meth:`~GenerateSession.candidate_generator` is asked: the call's
    ``past_key_values`` (which the prompt prefill fills before assisted decoding's first round), or None."""
    return _call_cache.get()


def set_call_cache(cache: Any) -> contextvars.Token:
    return _call_cache.set(cache)


def reset_call_cache(token: contextvars.Token) -> None:
    _call_cache.reset(token)
