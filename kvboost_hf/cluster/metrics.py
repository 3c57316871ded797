"""One ``/metrics`` for the whole application: every replica pushes its own Prometheus exposition to a
:class:`MetricsBoard` actor every :data:`PUSH_PERIOD_S`, and the ingress answers ``/metrics`` with all
of them merged, each sample labelled ``replica="<Serve replica id>"``.

Push, not pull: Serve routes a request to *some* replica, never to each, so the ingress cannot ask
them all. A replica that stops pushing (dead, or stopped) leaves the merge after :data:`STALE_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

logger = logging.getLogger(__name__)

PUSH_PERIOD_S = 1.0  # how often a replica pushes its exposition
STALE_S = 10.0  # a replica silent for this long is left out of the merge (and forgotten)
REPLICA_LABEL = "replica"


class MetricsBoard:
    """The latest exposition of each replica (a Ray actor: :func:`board_actor`)."""

    def __init__(self, stale_s: float = STALE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_s = stale_s
        self.clock = clock
        self.latest: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, exposition: str) -> None:
        self.latest[replica] = (self.clock(), exposition)

    def current(self) -> dict[str, str]:
        """Each live replica's latest exposition; replicas silent past ``stale_s`` are dropped."""
        now = self.clock()
        self.latest = {r: (t, text) for r, (t, text) in self.latest.items() if now - t <= self.stale_s}
        return {r: text for r, (_, text) in sorted(self.latest.items())}


def board_actor(name: str):
    """The application's :class:`MetricsBoard` actor called ``name`` (created by the first caller)."""
    import ray

    return ray.remote(num_cpus=0)(MetricsBoard).options(name=name, get_if_exists=True).remote()


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(expositions: dict[str, str]) -> bytes:
    """The expositions of several replicas as one, each sample labelled with its replica (a family that
    several replicas report is one family). Per-process ``*_created`` timestamps are left out."""
    merged: dict[str, Metric] = {}
    for replica, text in expositions.items():
        families = list(text_string_to_metric_families(text))
        names = {f.name for f in families}
        for family in families:
            if family.name.endswith("_created") and family.name[: -len("_created")] in names:
                continue
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples += [Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp, s.exemplar)
                             for s in family.samples if not s.name.endswith("_created")]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)


class MetricsPusher:
    """Pushes ``render()`` to ``board`` as ``replica`` every ``period_s`` from a daemon thread, until
    :meth:`stop`. A push that fails is logged once and retried next period (metrics never fail serving)."""

    def __init__(self, board, replica: str, render: Callable[[], bytes], period_s: float = PUSH_PERIOD_S) -> None:
        self.board, self.replica, self.render, self.period_s = board, replica, render, period_s
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvboost-metrics-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.board.put.remote(self.replica, self.render().decode())
            except Exception as err:  # noqa: BLE001 - the board may be gone (application stopping)
                if not self._warned:
                    logger.warning("replica %s could not push its metrics: %s", self.replica, err)
                    self._warned = True
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
