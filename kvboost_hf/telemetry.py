"""Per-request reuse statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ReuseStats:
    """What reuse did for one generate call (or one ``warm``).

    ``reused_tokens = exact_tokens + approximate_tokens``; ``recomputed_tokens`` prompt tokens
    went through the model. ``lookup_ms`` is the wall time of lookup and loading, which is
    included in the request's time to first token.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    exact_tokens: int = 0
    approximate_tokens: int = 0
    recomputed_tokens: int = 0
    lookup_ms: float = 0.0
    stored_chunks: int = 0
    reason: str = ""

    @property
    def kv_reuse_ratio(self) -> float:
        """Fraction of prompt tokens whose K/V came from the store."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["kv_reuse_ratio"] = self.kv_reuse_ratio
        return out
