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


def test_a_samples_own_replica_label_is_kept_as_exported_replica():
    merged = merge_expositions({"a1": '# TYPE up gauge\nup{replica="upstream"} 1\n'}).decode()
    assert samples(merged) == {("up", (("exported_replica", "upstream"), ("replica", "a1"))): 1.0}


def test_only_the_timestamps_of_counters_and_histograms_are_left_out():
    text = ('# TYPE jobs_total counter\njobs_total 2\n# TYPE jobs_created gauge\njobs_created 1.7e9\n'
            '# TYPE batch_created gauge\nbatch_created 4\n')  # a real gauge of its own, no `batch` family
    assert samples(merge_expositions({"a1": text}).decode()) == {
        ("jobs_total", (("replica", "a1"),)): 2.0, ("batch_created", (("replica", "a1"),)): 4.0}


def test_a_family_whose_type_differs_between_replicas_keeps_the_first_type():
    merged = merge_expositions({"a1": "# TYPE depth gauge\ndepth 3\n",
                                "b2": "# TYPE depth_total counter\ndepth_total 5\n"}).decode()
    assert samples(merged) == {("depth", (("replica", "a1"),)): 3.0}  # one valid family, b2's left out


def test_an_exposition_that_does_not_parse_costs_only_its_replica():
    merged = merge_expositions({"a1": "# TYPE x gauge\nx 1\n", "b2": "x{ 1\n"}).decode()
    assert samples(merged) == {("x", (("replica", "a1"),)): 1.0}


def test_a_replica_that_stops_pushing_drops_out():
    now = [0.0]
    board = MetricsBoard(stale_s=10, clock=lambda: now[0])
    assert board.put("a1", "x 1\n") is False  # nobody scraped yet: the replica may push slowly
    now[0] = 6.0
    board.put("b2", "x 2\n")
    body, merged = board.merged()
    assert merged == ["a1", "b2"] and samples(body.decode()) == {("x", (("replica", "a1"),)): 1.0,
                                                                  ("x", (("replica", "b2"),)): 2.0}
    assert board.put("b2", "x 2\n") is True  # scraped: push every second
    now[0] = 12.0
    assert board.merged()[1] == ["b2"]  # a1 silent for 12 s
    board.put("a1", "x 3\n")  # a replica that comes back is merged again
    assert board.current() == {"a1": "x 3\n", "b2": "x 2\n"}
    board.forget("a1")  # stopped gracefully: out at once
    assert board.merged()[1] == ["b2"]
    now[0] = 12.0 + 61
    assert board.put("b2", "x 4\n") is False  # nobody scraped for a minute
