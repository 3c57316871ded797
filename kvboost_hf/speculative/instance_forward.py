"""A module's ``forward`` replaced for as long as any request needs it (re-entrant, thread-safe)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from torch import nn

_lock = threading.Lock()
_installed: dict[int, list] = {}  # id(module) -> [module, its instance forward before (or None), entries, ours]


@contextlib.contextmanager
def forward_installed(module: nn.Module, make_forward: Callable[[nn.Module, Callable], Callable]) -> Iterator[None]:
    """While inside, ``module``'s forward is ``make_forward(module, forward before)``, set on the instance by the
    first entry; the last exit puts back what was there (the class's forward, or an instance forward set before)."""
    with _lock:
        entry = _installed.get(id(module))
        if entry is None:
            entry = _installed[id(module)] = [module, module.__dict__.get("forward"), 0, None]
            module.forward = entry[3] = make_forward(module, module.forward)
        entry[2] += 1
    try:
        yield
    finally:
        with _lock:
            entry[2] -= 1
            if entry[2] == 0:
                del _installed[id(module)]
                if entry[1] is None:
                    del module.forward
                else:
                    module.forward = entry[1]


def installed_alone(module: nn.Module) -> bool:
    """Whether ``module``'s instance forward is the one :func:`forward_installed` set over its class's forward, and
    nothing else was set on it since (a call then runs that forward and, through it, the class's)."""
    entry = _installed.get(id(module))
    return entry is not None and entry[1] is None and module.__dict__.get("forward") is entry[3]
