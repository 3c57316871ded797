"""``--draft``: speculative decoding for every request, and its counters on ``/v1/stats`` and ``/metrics``.

``build_draft`` turns the flag into what ``model.generate(draft=...)`` accepts;
``attach_speculation`` makes it the served model's default draft (greedy and sampling requests
alike), registers a Prometheus collector of the model's running speculation totals, and adds
them under ``"speculation"`` to ``/v1/stats``. It leaves :mod:`~kvboost_hf.server.routes.app` as is: the
service's ``stats`` is wrapped on the app instance.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from torch import nn

from kvboost_hf.speculative import (
    ControllerSettings,
    make_draft,
    make_head_draft,
    set_default_draft,
    speculation_totals,
)
from kvboost_hf.speculative.totals import metric_fields

DRAFT_CHOICES = ("int4", "int8", "head", "prompt-lookup", "store")
# --draft head's FR-Spec head without --draft-vocab, where the model's vocabulary is larger: each drafted token reads
# the head, and a full one (Gemma 3: 262,144 rows, 168 MB in int8) costs a decode step's worth of memory reads.
# Gemma-3-270M int4 on a Xeon with AMX: 2.21x chat / 2.06x documents against 2.16x / 1.93x for 32,768, with the same
# acceptance (docs/kernels.md, session 21). A smaller head only lowers acceptance: replies are the model's own.
HEAD_DRAFT_VOCAB = 16384



def build_draft(spec: str, model: nn.Module, tokenizer, vocab: int | None = None, layers: int | None = None):
    """What ``--draft SPEC`` names: ``int4`` / ``int8`` (a self-draft), ``head`` (a head draft), ``prompt-lookup``,
    ``store``, or the path (or HF id) of an assistant model sharing the tokenizer. Raises ValueError naming the flag."""
    if spec in ("int4", "int8"):
        return make_draft(model, bits=int(spec[3]), vocab=vocab, layers=layers, tokenizer=tokenizer)
    if spec == "head" and layers is None:
        if vocab is None and tokenizer is not None:
            vocab = head_draft_vocab(model)
        return make_head_draft(model, vocab, tokenizer=tokenizer)
    if vocab is not None or layers is not None:
        raise ValueError("--draft-vocab / --draft-layers shape a self-draft (--draft-vocab a head draft too): use them "
                         "with --draft int4 or int8 (--draft-vocab also with --draft head)")
    if spec in ("prompt-lookup", "store"):
        return spec
    from kvboost_hf.models import load_model  # noqa: PLC0415 - only for an assistant checkpoint

    try:
        assistant, _ = load_model(spec)
    except (OSError, ValueError) as err:
        raise ValueError(f"--draft {spec!r}: not one of {', '.join(DRAFT_CHOICES)} and not a loadable model ({err})")
    return assistant


def head_draft_vocab(model: nn.Module) -> int | None:
    """``--draft head``'s head size without ``--draft-vocab``: :data:`HEAD_DRAFT_VOCAB` where the model's vocabulary
    is larger, else None (the whole vocabulary)."""
    size = model.config.get_text_config(decoder=True).vocab_size
    return HEAD_DRAFT_VOCAB if size > HEAD_DRAFT_VOCAB else None


def attach_speculation(app, model: nn.Module, draft, settings: ControllerSettings | None = None) -> None:
    """Serve every request of ``app`` with ``draft``; report its counters. Needs reuse enabled."""
    set_default_draft(model, draft, settings)
    app.state.metrics.registry.register(SpeculationCollector(model))
    service = app.state.service
    stats = service.stats
    name = draft if isinstance(draft, str) else getattr(draft, "draft_name", type(draft).__name__)

    def stats_with_speculation() -> dict:
        return {**stats(), "speculation": {"draft": name, **speculation_totals(model).to_dict()}}

    service.stats = stats_with_speculation


class SpeculationCollector(Collector):
    """Reads the model's running speculation totals at every scrape."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def collect(self) -> Iterator:
        totals = speculation_totals(self.model).to_dict()
        for key, doc in metric_fields():
            if key.endswith("_ms"):
                yield CounterMetricFamily(f"kvboost_spec_{key[:-3]}_seconds", doc, value=totals[key] / 1000)
            else:
                yield CounterMetricFamily(f"kvboost_spec_{key}", doc, value=totals[key])
        yield GaugeMetricFamily("kvboost_spec_acceptance_rate", "Accepted / drafted tokens",
                                value=totals["acceptance_rate"])
        histogram = CounterMetricFamily("kvboost_spec_accepted_per_round", "Speculative rounds by accepted tokens",
                                        labels=["accepted"])
        for accepted, rounds in enumerate(totals["accepted_histogram"]):
            histogram.add_metric([str(accepted)], rounds)
        yield histogram
