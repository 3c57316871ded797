"""One ``/metrics`` for the whole application: every replica pushes its own Prometheus exposition to
the :class:`MetricsBoard` deployment, and the ingress answers ``/metrics`` with all of them merged,
each sample labelled ``replica="<Serve replica id>"``.

Push, not pull: Serve routes a request to *some* replica, never to each, so the ingress cannot ask
them all. Replicas push every :data:`PUSH_PERIOD_S` while someone scrapes, every
:data:`IDLE_PUSH_PERIOD_S` otherwise; a replica silent for :data:`STALE_S` (dead) leaves the merge,
and one that stops gracefully leaves it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

logger = logging.getLogger(__name__)

PUSH_PERIOD_S = 1.0  # how often a replica pushes while /metrics is scraped
IDLE_PUSH_PERIOD_S = 10.0  # ... and while nobody scraped for SCRAPED_S
SCRAPED_S = 60.0
STALE_S = 3 * IDLE_PUSH_PERIOD_S  # a replica silent for this long is left out of the merge (and forgotten)
PUSH_TIMEOUT_S = 5.0
REPLICA_LABEL = "replica"
EXPORTED_LABEL = "exported_replica"  # where a sample's own `replica` label goes (as Prometheus does)
_CREATED_OF = ("counter", "histogram", "summary")  # the families whose `<name>_created` is a timestamp


def _merged_families(expositions: dict[str, str]) -> Iterator[Metric]:
    merged: dict[str, Metric] = {}
    for replica, text in expositions.items():
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as err:  # one bad exposition costs its replica's samples, not the page
            logger.warning("replica %s pushed an exposition that does not parse: %s", replica, err)
            continue
        timestamped = {f.name for f in families if f.type in _CREATED_OF}
        for family in families:
            if family.type == "gauge" and family.name.endswith("_created") and \
                    family.name[: -len("_created")] in timestamped:
                continue  # a per-process creation time: meaningless once merged
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            if into.type != family.type:  # replicas of two versions: keep the first's, never an invalid page
                logger.warning("metric %s is a %s on replica %s but a %s elsewhere: left out for it", family.name,
                               family.type, replica, into.type)
                continue
            into.samples += [_labelled(sample, replica) for sample in family.samples]
    return iter(merged.values())


def _labelled(sample: Sample, replica: str) -> Sample:
    labels = dict(sample.labels)
    if REPLICA_LABEL in labels:
        labels[EXPORTED_LABEL] = labels.pop(REPLICA_LABEL)
    labels[REPLICA_LABEL] = replica
    return sample._replace(labels=labels)


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(expositions: dict[str, str]) -> bytes:
    """The expositions of several replicas as one, each sample labelled with its replica (a family that
    several replicas report is one family). Per-process ``*_created`` timestamps are left out; a sample's
    own ``replica`` label becomes ``exported_replica``; an exposition that does not parse is skipped."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(_merged_families(expositions)))
    return generate_latest(registry)


class MetricsBoard:
    """The latest exposition of each replica, and their merge (a Serve deployment of one replica, so
    Serve starts, restarts and deletes it with the application)."""

    def __init__(self, stale_s: float = STALE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_s = stale_s
        self.clock = clock
        self.latest: dict[str, tuple[float, str]] = {}
        self.last_scrape = float("-inf")
        self._merged: tuple[bytes, list[str]] | None = None

    def put(self, replica: str, exposition: str) -> bool:
        """Keep ``replica``'s latest exposition; whether someone scraped in the last :data:`SCRAPED_S`."""
        self.latest[replica] = (self.clock(), exposition)
        self._merged = None
        self._prune()
        return self.clock() - self.last_scrape <= SCRAPED_S

    def forget(self, replica: str) -> None:
        """Leave ``replica`` out from now on (it stopped)."""
        self.latest.pop(replica, None)
        self._merged = None

    def current(self) -> dict[str, str]:
        """Each live replica's latest exposition, by replica id."""
        self._prune()
        return {r: text for r, (_, text) in sorted(self.latest.items())}

    def merged(self) -> tuple[bytes, list[str]]:
        """The live replicas' expositions merged (:func:`merge_expositions`), and the replicas merged."""
        self.last_scrape = self.clock()
        if self._prune() or self._merged is None:
            current = self.current()
            self._merged = merge_expositions(current), list(current)
        return self._merged

    def _prune(self) -> bool:
        now = self.clock()
        stale = [r for r, (t, _) in self.latest.items() if now - t > self.stale_s]
        for replica in stale:
            del self.latest[replica]
        return bool(stale)


async def push_metrics(board, replica: str, render: Callable[[], bytes]) -> None:
    """Push ``render()`` to ``board`` (a handle of :class:`MetricsBoard`) as ``replica``, forever: every
    :data:`PUSH_PERIOD_S` while it is scraped, every :data:`IDLE_PUSH_PERIOD_S` otherwise. A push that
    fails or times out is logged once and tried again next period: metrics never fail serving."""
    warned = False
    while True:
        period = IDLE_PUSH_PERIOD_S
        try:
            if await asyncio.wait_for(board.put.remote(replica, render().decode()), PUSH_TIMEOUT_S):
                period = PUSH_PERIOD_S
            warned = False
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the board restarting, or the application stopping
            if not warned:
                logger.warning("replica %s could not push its metrics: %s", replica, err)
                warned = True
        await asyncio.sleep(period)
