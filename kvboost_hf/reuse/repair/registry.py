"""The repair strategies by name: the protocol a strategy implements, and the registry ``enable_chunk_reuse``
builds one from (``recompute_strategy=NAME``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from kvboost_hf.reuse.repair.base import RepairContext, RepairOutcome


@dataclass(frozen=True)
class RepairSettings:
    """The knobs of ``enable_chunk_reuse`` a strategy may read (each reads its own)."""

    recompute_ratio: float = 0.15
    seam_tokens: int = 16
    check_layer: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio!r}")
        if isinstance(self.seam_tokens, bool) or not isinstance(self.seam_tokens, int) or self.seam_tokens < 0:
            raise ValueError(f"seam_tokens must be a non-negative int, got {self.seam_tokens!r}")


class RepairStrategy(Protocol):
    """Places a prompt's content hits (chunks stored at other positions) into the request's cache."""

    name: ClassVar[str]
    attention: ClassVar[str | None]  # the attention implementation the strategy needs (None: any)

    @classmethod
    def from_settings(cls, settings: RepairSettings) -> RepairStrategy: ...

    def repair(self, ctx: RepairContext) -> RepairOutcome: ...


_strategies: dict[str, type] = {}


def register_strategy(cls: type) -> type:
    """Class decorator: make ``cls`` available as ``recompute_strategy=cls.name``."""
    _strategies[cls.name] = cls
    return cls


def strategy_names() -> tuple[str, ...]:
    return tuple(_strategies)


def make_strategy(name: str, recompute_ratio: float = 0.15, seam_tokens: int = 16,
                  check_layer: int = 1) -> RepairStrategy:
    """The strategy called ``name`` with its settings; ``ValueError`` for unknown names or bad settings."""
    if name not in _strategies:
        raise ValueError(f"recompute_strategy must be None (exact reuse only) or one of {strategy_names()}, "
                         f"got {name!r}")
    return _strategies[name].from_settings(RepairSettings(recompute_ratio, seam_tokens, check_layer))
