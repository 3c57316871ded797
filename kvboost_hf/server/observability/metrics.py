"""Server metrics: Prometheus collectors (``GET /metrics``) and the JSON figures of ``GET /v1/stats``.

Each app gets its own ``CollectorRegistry``, so several apps (tests, A/B runs) can live in one
process.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
WINDOW = 1000  # recent requests behind the p50 / p95 figures of /v1/stats


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"count": 0, "p50_s": None, "p95_s": None, "mean_s": None}
    if len(values) == 1:
        p50 = p95 = values[0]
    else:
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        p50, p95 = cuts[49], cuts[94]
    return {"count": len(values), "p50_s": p50, "p95_s": p95, "mean_s": statistics.fmean(values)}


class ServerMetrics:
    """Counters, histograms and gauges of one app; ``store_bytes`` and ``queue_depth`` are read live."""

    def __init__(self, store_bytes: Callable[[], float], queue_depth: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvboost_requests", "HTTP requests by route and status code", ["route", "status"], registry=r)
        self.ttft = Histogram(
            "kvboost_time_to_first_token_seconds", "Arrival to first generated token (queueing included)",
            ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.latency = Histogram(
            "kvboost_request_latency_seconds", "Arrival to last token of completed generations", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("kvboost_prompt_tokens", "Prompt tokens of completed generations", registry=r)
        self.reused_tokens = Counter(
            "kvboost_reused_prompt_tokens", "Prompt tokens whose K/V came from the store", registry=r
        )
        self.completion_tokens = Counter("kvboost_completion_tokens", "Generated tokens", registry=r)
        self.outcomes = Counter(
            "kvboost_generations", "Generations by outcome (completed, cancelled, timed_out, failed)", ["outcome"],
            registry=r,
        )
        self.store_bytes = Gauge("kvboost_store_bytes", "Bytes the chunk store holds in RAM", registry=r)
        self.store_bytes.set_function(store_bytes)
        self.queue_depth = Gauge("kvboost_queue_depth", "Requests waiting or running", registry=r)
        self.queue_depth.set_function(queue_depth)
        self._lock = threading.Lock()
        self._ttfts: deque[float] = deque(maxlen=WINDOW)
        self._latencies: deque[float] = deque(maxlen=WINDOW)
        self._totals = dict.fromkeys(("prompt_tokens", "reused_tokens", "completion_tokens"), 0)
        self._outcomes: dict[str, int] = {}

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_outcome(self, outcome: str) -> None:
        self.outcomes.labels(outcome=outcome).inc()
        with self._lock:
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1

    def observe_generation(
        self, route: str, ttft_s: float | None, latency_s: float, prompt: int, reused: int, completion: int
    ) -> None:
        """Record one completed generation (TTFT None when no token was generated)."""
        if ttft_s is not None:
            self.ttft.labels(route=route).observe(ttft_s)
        self.latency.labels(route=route).observe(latency_s)
        self.prompt_tokens.inc(prompt)
        self.reused_tokens.inc(reused)
        self.completion_tokens.inc(completion)
        with self._lock:
            if ttft_s is not None:
                self._ttfts.append(ttft_s)
            self._latencies.append(latency_s)
            self._totals["prompt_tokens"] += prompt
            self._totals["reused_tokens"] += reused
            self._totals["completion_tokens"] += completion

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """Reuse totals, outcome counts and TTFT / latency percentiles over the recent window."""
        with self._lock:
            totals = dict(self._totals)
            outcomes = dict(self._outcomes)
            ttfts, latencies = list(self._ttfts), list(self._latencies)
        prompt = totals["prompt_tokens"]
        return {
            "reuse": {**totals, "reuse_ratio": totals["reused_tokens"] / prompt if prompt else 0.0},
            "requests": outcomes,
            "ttft": _percentiles(ttfts),
            "latency": _percentiles(latencies),
        }
