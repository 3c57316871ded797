"""The merged ``/metrics`` of several replicas: every sample keeps its value and gains its replica's
label, families reported by several replicas stay one family, and a silent replica drops out."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvboost_hf.cluster.metrics import MetricsBoard, merge_expositions


def exposition(requests: int, depth: float, ttfts: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("kvboost_requests", "Requests", ["route", "status"], registry=registry)
    counter.labels("/v1/completions", "200").inc(requests)
    Gauge("kvboost_queue_depth", "Queued", registry=registry).set(depth)
    histogram = Histogram("kvboost_ttft_seconds", "TTFT", registry=registry, buckets=(0.1, 1.0))
    for t in ttfts:
        histogram.observe(t)
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_each_replicas_samples_come_back_labelled_with_it():
    merged = merge_expositions({"a1": exposition(3, 2, [0.05]), "b2": exposition(5, 0, [0.5, 2.0])}).decode()
    got = samples(merged)
    route = (("route", "/v1/completions"), ("status", "200"))
    assert got[("kvboost_requests_total", tuple(sorted((*route, ("replica", "a1")))))] == 3
    assert got[("kvboost_requests_total", tuple(sorted((*route, ("replica", "b2")))))] == 5
    assert got[("kvboost_queue_depth", (("replica", "a1"),))] == 2
    assert got[("kvboost_ttft_seconds_count", (("replica", "b2"),))] == 2
    assert got[("kvboost_ttft_seconds_bucket", (("le", "1.0"), ("replica", "b2")))] == 1
    assert not any(name.endswith("_created") for name, _ in got)  # per-process timestamps left out
    assert merged.count("# TYPE kvboost_requests_total counter") == 1  # one family, both replicas' samples
    assert merged.count("# TYPE kvboost_ttft_seconds histogram") == 1
    one = [key for key in samples(exposition(1, 1, [0.5])) if not key[0].endswith("_created")]
    assert len(got) == 2 * len(one)  # nothing lost, nothing invented


def test_no_replica_is_an_empty_exposition():
    assert merge_expositions({}) == b""


def test_a_replica_that_stops_pushing_drops_out():
    now = [0.0]
    board = MetricsBoard(stale_s=10, clock=lambda: now[0])
    board.put("a1", "x 1\n")
    now[0] = 6.0
    board.put("b2", "x 2\n")
    assert board.current() == {"a1": "x 1\n", "b2": "x 2\n"}
    now[0] = 12.0
    assert board.current() == {"b2": "x 2\n"}
    board.put("a1", "x 3\n")  # a replica that comes back is merged again
    assert board.current() == {"a1": "x 3\n", "b2": "x 2\n"}
