"""Figures of the continuous-batching scheduler: ``/metrics`` histograms and the ``/v1/stats`` summary."""

from __future__ import annotations

import statistics
import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
WINDOW = 1000  # recent steps / requests behind the /v1/stats figures


class BatchMetrics:
    """Per-step batch size and tokens, per-request queue wait, prefill chunks."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.batch_size = Histogram("kvboost_batch_size", "Rows decoded per step", buckets=BATCH_BUCKETS, registry=r)
        self.step_tokens = Histogram("kvboost_step_tokens", "Tokens forwarded per step (decode + prefill)",
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.queue_wait = Histogram("kvboost_queue_wait_seconds", "Submission to joining the running batch",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.prefill_chunk = Histogram("kvboost_prefill_chunk_tokens", "Prompt tokens per prefill chunk forward",
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.steps = Counter("kvboost_batch_steps", "Scheduler steps that forwarded tokens", registry=r)
        self.shared_waits = Counter("kvboost_shared_prefill_waits",
                                    "Rows that waited for a prompt prefix being prefilled, to reuse it", registry=r)
        self._lock = threading.Lock()
        self._sizes: deque[int] = deque(maxlen=WINDOW)
        self._tokens: deque[int] = deque(maxlen=WINDOW)
        self._waits: deque[float] = deque(maxlen=WINDOW)
        self._chunks = 0
        self._steps = 0
        self._shared_waits = 0

    def observe_step(self, decoded: int, prefill_chunks: list[int]) -> None:
        """One step: ``decoded`` rows decoded, one prefill forward per entry of ``prefill_chunks``."""
        tokens = decoded + sum(prefill_chunks)
        if not tokens:
            return
        self.steps.inc()
        self.step_tokens.observe(tokens)
        if decoded:
            self.batch_size.observe(decoded)
        for n in prefill_chunks:
            self.prefill_chunk.observe(n)
        with self._lock:
            self._steps += 1
            self._chunks += len(prefill_chunks)
            self._tokens.append(tokens)
            if decoded:
                self._sizes.append(decoded)

    def observe_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)
        with self._lock:
            self._waits.append(seconds)

    def observe_shared_wait(self) -> None:
        """A row waited for another row's prefill of their shared prefix (then reused it)."""
        self.shared_waits.inc()
        with self._lock:
            self._shared_waits += 1

    def snapshot(self) -> dict:
        """Step and chunk counts, mean batch size and tokens per step, queue wait p50/p95 (recent window)."""
        with self._lock:
            sizes, tokens, waits = list(self._sizes), list(self._tokens), sorted(self._waits)
            steps, chunks, shared = self._steps, self._chunks, self._shared_waits
        return {
            "steps": steps,
            "prefill_chunks": chunks,
            "shared_prefill_waits": shared,
            "mean_batch_size": statistics.fmean(sizes) if sizes else None,
            "max_batch_size_seen": max(sizes) if sizes else None,
            "mean_tokens_per_step": statistics.fmean(tokens) if tokens else None,
            "queue_wait_p50_s": _quantile(waits, 0.5),
            "queue_wait_p95_s": _quantile(waits, 0.95),
        }


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
