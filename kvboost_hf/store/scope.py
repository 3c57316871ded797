"""Whose entries a request reads and writes: :class:`CacheScope` (``generate(..., cache_salt=...)``).

A scope maps to chain roots (:mod:`.keys`): entries under one salt, or of one owner, are unreachable
from another.
``shared_salt`` names entries every scope may read as a leading prefix (a system prompt warmed on
purpose); after the last stored shared chunk, a request's chain continues under a root of its own
(:func:`~.keys.switch_root`), so what follows a shared prefix is never shared. ``owner`` is who the
store charges: its quota (:meth:`~kvboost_hf.store.ChunkStore.set_quota`) and what
:meth:`~kvboost_hf.store.ChunkStore.purge` forgets.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvboost_hf.store.keys import Key, owned, salted


@dataclass(frozen=True)
class CacheScope:
    """The salt a request's chains are rooted at, the owner its new entries are charged to, and the
    salt of shared entries it may start from (None: none of each). ``epoch``: the owner's
    :meth:`~kvboost_hf.store.ChunkStore.epoch` when the request arrived (None: when its forward
    starts), so a purge after that drops what it stores."""

    salt: str | None = None
    owner: str | None = None
    shared_salt: str | None = None
    epoch: int | None = None

    def __post_init__(self) -> None:
        for name in ("salt", "owner", "shared_salt"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise TypeError(f"CacheScope.{name} must be a string or None, got {type(value).__name__}")
            if not value:
                raise ValueError(f"CacheScope.{name} must not be empty: pass None for none")
        if self.epoch is not None and (type(self.epoch) is not int or self.epoch < 0):
            raise ValueError(f"CacheScope.epoch must be a non-negative int or None, got {self.epoch!r}")
        if self.shared_salt is not None and self.shared_salt == self.salt:
            raise ValueError("CacheScope.shared_salt equals its salt: leave shared_salt None to read and write one chain")

    def root(self, namespace: Key) -> Key:
        """The root of this scope's own chains under the model's ``namespace`` (its salt's, and its owner's)."""
        return owned(salted(namespace, self.salt), self.owner)

    def shared_root(self, namespace: Key) -> Key | None:
        """The root of the shared chains this scope reads first (None without ``shared_salt``)."""
        return None if self.shared_salt is None else salted(namespace, self.shared_salt)


def as_scope(value: str | CacheScope | None) -> CacheScope | None:
    """``cache_salt`` as a scope: a string is ``CacheScope(salt=value)``, a scope itself, None none;
    TypeError / ValueError for anything else (an empty string included)."""
    if value is None or isinstance(value, CacheScope):
        return value
    if not isinstance(value, str):
        raise TypeError(f"cache_salt must be a string or a CacheScope, got {type(value).__name__}")
    if not value:
        raise ValueError("cache_salt must not be empty: pass None for no salt")
    return CacheScope(salt=value)
