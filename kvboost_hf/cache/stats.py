"""Per-request reuse statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    # kvboost_hf.speculative's SpeculationStats when the call decoded speculatively (any object with to_dict)
    speculation: Any = None

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
