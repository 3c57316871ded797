"""AWQ layer-streaming counters for ``/metrics`` (a Prometheus collector) and ``/v1/stats``."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from torch import nn

_COUNTERS = (
    ("hits", "kvboost_awq_prefetch_hits", "Streamed-layer forwards whose weights were already staged"),
    ("late", "kvboost_awq_prefetch_late", "Streamed-layer forwards that waited for an in-flight prefetch"),
    ("misses", "kvboost_awq_prefetch_misses", "Streamed-layer forwards that loaded their weights synchronously"),
    ("bytes_moved", "kvboost_awq_bytes_moved", "Bytes copied from the host source into staging slots"),
)


def streaming_snapshot(model: nn.Module) -> dict | None:
    """The model's streaming counters as a dict, or None when it is not an AWQ-streamed model."""
    if getattr(model, "_kvboost_streaming", None) is None:  # cheap check: no plugin import for float models
        return None
    from kvboost_hf.streaming import streaming_stats

    return streaming_stats(model).to_dict()


class StreamingCollector(Collector):
    """Reads the live counters of one streamed model at every scrape."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def collect(self) -> Iterator:
        stats = streaming_snapshot(self.model)
        if stats is None:
            return
        for key, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats[key])
        yield CounterMetricFamily("kvboost_awq_blocked_seconds", "Time compute waited for streamed weights",
                                  value=stats["blocked_ms"] / 1000)
        yield GaugeMetricFamily("kvboost_awq_prefetch_hit_rate", "Hits / streamed-layer forwards",
                                value=stats["hit_rate"])
        yield GaugeMetricFamily("kvboost_awq_staging_bytes", "Bytes of the staging slots",
                                value=stats["staging_bytes"])
        yield GaugeMetricFamily("kvboost_awq_streamed_layers", "Decoder layers whose weights stream",
                                value=stats["streamed_layers"])
