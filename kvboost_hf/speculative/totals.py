"""Speculation counters summed over a model's requests (what a server reports)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from kvboost_hf.speculative.stats import SpeculationStats


def _total(help_text: str = "", summed: bool = True, default: float = 0):
    """A field of the totals: ``summed`` from each request's stats of the same name; ``help_text`` makes it a
    metric (the server's ``/metrics`` exports every field that has one: ``kvboost_spec_<name>``, ``_ms`` in s)."""
    return field(default=default, metadata={"help": help_text, "summed": summed})


@dataclass
class SpeculationTotals:
    """Sums of :class:`SpeculationStats` over requests. Thread safe."""

    requests: int = _total("Requests decoded with speculation", summed=False)
    switched_off: int = _total("Requests where the controller switched speculation off", summed=False)
    rounds: int = _total("Target forwards of speculative requests (plain rounds included)")
    speculative_rounds: int = _total("Target forwards that verified draft tokens")
    drafted_tokens: int = _total("Draft tokens verified by the target")
    accepted_tokens: int = _total("Draft tokens the target accepted")
    accepted_histogram: list[int] = field(default_factory=list)
    draft_ms: float = _total("Time spent drafting", default=0.0)
    verify_ms: float = _total("Target forward time of speculative rounds", default=0.0)
    plain_ms: float = _total(default=0.0)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, stats: SpeculationStats) -> None:
        with self.lock:
            self.requests += 1
            self.switched_off += bool(stats.off_reason)
            for f in fields(self):
                if f.metadata.get("summed"):
                    setattr(self, f.name, getattr(self, f.name) + getattr(stats, f.name))
            hist = self.accepted_histogram
            hist.extend([0] * (len(stats.accepted_histogram) - len(hist)))
            for i, n in enumerate(stats.accepted_histogram):
                hist[i] += n

    def to_dict(self) -> dict:
        with self.lock:
            out = {k: v for k, v in self.__dict__.items() if k != "lock"}
            out["accepted_histogram"] = list(self.accepted_histogram)
        out["acceptance_rate"] = out["accepted_tokens"] / out["drafted_tokens"] if out["drafted_tokens"] else 0.0
        return out


def metric_fields() -> list[tuple[str, str]]:
    """``(name, help)`` of every total exported as a metric, in field order."""
    return [(f.name, f.metadata["help"]) for f in fields(SpeculationTotals) if f.metadata.get("help")]
