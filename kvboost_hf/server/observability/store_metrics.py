"""Prometheus view of the chunk store's remote (Redis) tier, read live at every scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_COUNTERS = (
    ("reads", "kvboost_remote_reads", "Lookups that read chunk blobs from the remote tier"),
    ("hits", "kvboost_remote_hits", "Chunks served from the remote tier (verified, promoted to RAM)"),
    ("writes", "kvboost_remote_writes", "Chunks written to the remote tier"),
    ("write_errors", "kvboost_remote_write_errors", "Remote writes that failed (down, full, timeout)"),
    ("writes_dropped", "kvboost_remote_writes_dropped", "Remote writes dropped because the write queue was full"),
    ("corrupt_dropped", "kvboost_remote_corrupt_dropped", "Corrupt or foreign remote blobs deleted, never loaded"),
    ("errors", "kvboost_remote_errors", "Remote tier errors (each opens the circuit breaker)"),
    ("skipped", "kvboost_remote_skipped", "Remote operations skipped while the circuit breaker was open"),
)


class RemoteStoreCollector(Collector):
    """Reads ``store.stats()["remote"]`` of one store at every scrape."""

    def __init__(self, store) -> None:
        self.store = store

    def collect(self) -> Iterator:
        stats = self.store.stats().get("remote")
        if stats is None:
            return
        for key, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats[key])
        yield GaugeMetricFamily("kvboost_remote_pending_writes", "Chunks queued for the remote tier",
                                value=stats["pending_writes"])
        # "available" is the latest contact's outcome, refreshed by a PING while idle (see store.remote).
        yield GaugeMetricFamily("kvboost_remote_available",
                                "1 while the remote tier answers, 0 while it is down (or not reached yet)",
                                value=1.0 if stats["available"] else 0.0)
