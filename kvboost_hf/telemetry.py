"""Per-request reuse statistics."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvboost_hf.speculative.stats import SpeculationStats


@dataclass
class ReuseStats:
    """What reuse did for one generate call (or one ``warm``).

    ``reused_tokens = exact_tokens + approximate_tokens``; ``recomputed_tokens`` prompt tokens
    went through every layer of the model. ``layer_tokens[i]`` is how many prompt tokens layer
    ``i`` processed (CacheBlend runs every token through its first layers). ``lookup_ms`` is the
    wall time of lookup, loading and repair, all included in the time to first token.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    exact_tokens: int = 0
    approximate_tokens: int = 0
    recomputed_tokens: int = 0
    lookup_ms: float = 0.0
    stored_chunks: int = 0
    strategy: str = "exact"
    layer_tokens: list[int] = field(default_factory=list)
    reason: str = ""
    speculation: SpeculationStats | None = None  # set when the call decoded speculatively

    @property
    def compute_fraction(self) -> float:
        """Token-layer work of this prompt relative to a full prefill (1.0 without reuse)."""
        if not self.layer_tokens or not self.prompt_tokens:
            return 1.0 if self.prompt_tokens else 0.0
        return sum(self.layer_tokens) / (self.prompt_tokens * len(self.layer_tokens))

    @property
    def kv_reuse_ratio(self) -> float:
        """Fraction of prompt tokens whose K/V came from the store."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["kv_reuse_ratio"] = self.kv_reuse_ratio
        out["compute_fraction"] = self.compute_fraction
        if self.speculation is not None:
            out["speculation"] = self.speculation.to_dict()
        return out


class FirstTokenTimer:
    """A generate ``streamer`` that records when the first new token arrives.

    ``generate`` hands a streamer the prompt first, then each new token; the second ``put``
    marks the first generated token. ``ttft`` is measured from ``start()`` (call it right
    before ``generate``), so it includes lookup, loading and the prefill.
    """

    def __init__(self) -> None:
        self.started_at = 0.0
        self._puts = 0
        self.first_token_at: float | None = None

    def start(self) -> FirstTokenTimer:
        self.started_at = time.perf_counter()
        self._puts = 0
        self.first_token_at = None
        return self

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    @property
    def ttft(self) -> float:
        """Seconds from ``start()`` to the first generated token."""
        if self.first_token_at is None:
            raise RuntimeError("no token was generated yet")
        return self.first_token_at - self.started_at
