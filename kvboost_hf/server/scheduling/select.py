"""The scheduler a server runs: ``workers`` (one ``model.generate`` per worker thread) or ``batch``
(step-level continuous batching, :mod:`~kvboost_hf.server.scheduling.batch`)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from kvboost_hf.batching import BatchLimits
from kvboost_hf.server.engine.generation import stop_token_ids
from kvboost_hf.server.observability.batch_metrics import BatchMetrics
from kvboost_hf.server.scheduling.admission import MemoryAdmission
from kvboost_hf.server.scheduling.batch import BatchingQueue
from kvboost_hf.server.scheduling.workers import GenerationQueue
from kvboost_hf.server.settings import ServerSettings

SCHEDULERS = ("batch", "workers")


def make_queue(settings: ServerSettings, model, tokenizer, store, registry: CollectorRegistry,
               admission: Callable[[], MemoryAdmission | None]) -> GenerationQueue | BatchingQueue:
    """The queue ``settings.scheduler`` names; the batch scheduler's figures go to ``registry``."""
    if settings.scheduler == "workers":
        return GenerationQueue(settings.max_queue, workers=settings.workers)
    limits = BatchLimits(settings.max_batch_size, settings.max_batched_tokens)
    return BatchingQueue(model, tokenizer, store if settings.reuse else None, stop_token_ids(model, tokenizer),
                         limits, settings.max_queue, admission=admission, metrics=BatchMetrics(registry))
