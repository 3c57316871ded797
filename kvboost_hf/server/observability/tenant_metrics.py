"""Per-tenant figures: Prometheus series labelled by tenant name (never by key) and the JSON of ``/v1/stats``."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


class TenantMetrics:
    """Counters of completed generations per tenant, and the store bytes each tenant's entries hold."""

    def __init__(self, registry: CollectorRegistry, store_bytes: Callable[[], dict], quotas: Callable[[], dict]) -> None:
        self._counters = {
            "requests": Counter("kvboost_tenant_generations", "Completed generations per tenant", ["tenant"],
                                registry=registry),
            "prompt_tokens": Counter("kvboost_tenant_prompt_tokens", "Prompt tokens per tenant", ["tenant"],
                                     registry=registry),
            "cached_tokens": Counter("kvboost_tenant_reused_prompt_tokens",
                                     "Prompt tokens per tenant whose K/V came from the store (cache hits)", ["tenant"],
                                     registry=registry),
            "completion_tokens": Counter("kvboost_tenant_completion_tokens", "Generated tokens per tenant", ["tenant"],
                                         registry=registry),
        }
        self._store_bytes, self._quotas = store_bytes, quotas
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, int]] = {}
        registry.register(_StoreBytesCollector(store_bytes, quotas))

    def observe(self, tenant: str, prompt: int, cached: int, completion: int) -> None:
        """Count one completed generation of ``tenant``."""
        values = {"requests": 1, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}
        for name, value in values.items():
            self._counters[name].labels(tenant=tenant).inc(value)
        with self._lock:
            totals = self._totals.setdefault(tenant, dict.fromkeys(_FIELDS, 0))
            for name, value in values.items():
                totals[name] += value

    def snapshot(self, tenant: str) -> dict:
        """``tenant``'s counts, its store bytes (RAM) and quota."""
        with self._lock:
            totals = dict(self._totals.get(tenant) or dict.fromkeys(_FIELDS, 0))
        return {**totals, "store_bytes": self._store_bytes().get(tenant, 0), "store_quota": self._quotas().get(tenant)}


class _StoreBytesCollector:
    """``kvboost_tenant_store_bytes`` and ``kvboost_tenant_store_quota_bytes``, read at scrape time."""

    def __init__(self, store_bytes: Callable[[], dict], quotas: Callable[[], dict]) -> None:
        self._store_bytes, self._quotas = store_bytes, quotas

    def collect(self):
        held = GaugeMetricFamily("kvboost_tenant_store_bytes", "Bytes of a tenant's entries in the store's RAM",
                                 labels=["tenant"])
        for tenant, n in sorted(self._store_bytes().items()):
            held.add_metric([tenant], n)
        quota = GaugeMetricFamily("kvboost_tenant_store_quota_bytes", "A tenant's store quota (store_bytes)",
                                  labels=["tenant"])
        for tenant, n in sorted(self._quotas().items()):
            quota.add_metric([tenant], n)
        return [held, quota]
