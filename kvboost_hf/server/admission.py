"""Memory admission for the server: plan each request before it runs, refuse or truncate what cannot fit,
and keep the calibration of predicted against measured peaks.

The planner only decides (:class:`~kvboost_hf.planner.memory.MemoryPlanner`); this module
applies its decision to a request (413 with the figures, or the longest prompt prefix that fits
with ``--auto-truncate``), accounts the K/V of requests in flight, and measures each request's
real peak: CUDA ``max_memory_allocated``; on CPU the resident set sampled every few
milliseconds by a thread while the request runs (with several workers, concurrent requests
share that figure, which the per-cohort errors make visible).
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from ..planner.memory import MIB, MemoryPlanner, RequestPlan, process_rss_bytes
from .errors import APIError

COHORTS = (512, 2048, 8192)  # prompt-length buckets for per-cohort calibration errors
SAMPLE_S = 0.005
MAX_RECORDS = 1000


@dataclass(frozen=True)
class Admitted:
    """A request the planner let in: its (possibly truncated) prompt and its plan."""

    prompt_ids: list[int]
    plan: RequestPlan
    truncated_from: int | None = None  # the original prompt length when --auto-truncate cut it


def plan_headers(admitted: list[Admitted]) -> dict[str, str]:
    """Response headers for the prompts of one request (comma-separated when several say something)."""
    truncated = [str(a.truncated_from) for a in admitted if a.truncated_from is not None]
    bits = [str(a.plan.kv_bits) for a in admitted if a.plan is not None and a.plan.kv_bits is not None]
    out = {}
    if truncated:
        out["X-Kvboost-Truncated-From"] = ",".join(truncated)
    if bits:
        out["X-Kvboost-KV-Bits"] = ",".join(bits)
    return out


class _PeakSampler:
    """The highest resident set of this process while the ``with`` block runs, above its start."""

    def __init__(self) -> None:
        self.start = self.peak = process_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvboost-rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, process_rss_bytes())

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, process_rss_bytes())

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.start)


class MemoryAdmission:
    """Plans, admits and measures requests for one server."""

    def __init__(self, planner: MemoryPlanner, auto_truncate: bool = False, device: str = "cpu") -> None:
        self.planner, self.auto_truncate, self.device = planner, auto_truncate, device
        self._lock = threading.Lock()
        self._in_flight: dict[object, int] = {}  # one key per running generation -> its predicted K/V bytes
        self._records: list[tuple[int, int, int]] = []  # (prompt tokens, predicted, measured)
        self.refused = self.truncated = 0

    def batch_kv_bytes(self) -> int:
        with self._lock:
            return sum(self._in_flight.values())

    def admit(self, prompt_ids: list[int], max_new_tokens: int, copies: int = 1, alongside: int = 0) -> Admitted:
        """The plan for this request; APIError 413 (with the planner's figures) when nothing fits.

        ``copies`` generations of this prompt run at once (``n``, ``best_of``: each holds its own
        K/V), beside ``alongside`` bytes of K/V of the same request's other prompts: both count as
        running K/V when planning it.
        """
        siblings = (copies - 1) * self.planner.kv_bytes(len(prompt_ids) + max_new_tokens, None)
        batch = self.batch_kv_bytes() + alongside + siblings
        plan = self.planner.plan(len(prompt_ids), max_new_tokens, batch_kv_bytes=batch)
        if plan.fits:
            return Admitted(prompt_ids, plan)
        if self.auto_truncate:
            keep = self.planner.truncated_prompt(len(prompt_ids), max_new_tokens, batch)
            if keep > 0:
                self.truncated += 1
                kept = self.planner.plan(keep, max_new_tokens, batch_kv_bytes=batch)
                return Admitted(prompt_ids[:keep], kept, truncated_from=len(prompt_ids))
        self.refused += 1
        what = (f"lower max_tokens to {plan.suggested_max_tokens}" if plan.suggested_max_tokens
                else "shorten the prompt")
        raise APIError(
            413,
            f"this request would need about {plan.predicted_peak_bytes / MIB:,.0f} MiB at its peak, "
            f"{plan.free_bytes / MIB:,.0f} MiB are free for requests: {what} (or retry when fewer requests run)",
            param="messages/prompt", code="request_too_large", details=plan.error_payload(),
        )

    def kv_bytes(self, admitted: Admitted) -> int:
        """K/V bytes one generation of ``admitted`` holds at its end."""
        plan = admitted.plan
        return self.planner.kv_bytes(plan.prompt_tokens + plan.max_new_tokens, plan.kv_bits) if plan else 0

    @contextmanager
    def in_batch(self, admitted: Admitted):
        """Account the request's K/V while it runs (``batch_kv_bytes``). A batch row gets only this:
        rows share every forward, so a request's own peak is not observable. Each entry counts on
        its own: the rows of one request (``n``, ``best_of``) enter with the same ``admitted``,
        and each holds its own K/V."""
        key = object()
        with self._lock:
            self._in_flight[key] = self.kv_bytes(admitted)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.pop(key, None)

    @contextmanager
    def running(self, admitted: Admitted):
        """Account the request's K/V while it runs (as :meth:`in_batch`), and record its predicted and
        measured peak."""
        plan = admitted.plan
        with self.in_batch(admitted):
            if self.device == "cuda":
                import torch

                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                yield
                measured = torch.cuda.max_memory_allocated() - before
            else:
                with _PeakSampler() as sampler:
                    yield
                measured = sampler.delta
            with self._lock:
                self._records.append((plan.prompt_tokens, plan.predicted_peak_bytes, measured))
                del self._records[:-MAX_RECORDS]

    def stats(self) -> dict:
        """Calibration: residuals (measured / predicted - 1) overall and per prompt-length cohort."""
        with self._lock:
            records = list(self._records)
        step = self.planner.decode_step_s
        out = {"free_mb": round(self.planner.free_bytes / MIB, 1), "margin": self.planner.margin,
               "decode_step_ms": None if step is None else round(step * 1000, 2),
               "refused": self.refused, "truncated": self.truncated, "requests": len(records),
               "in_flight_kv_mb": round(self.batch_kv_bytes() / MIB, 1)}
        out.update(residual_summary([(m / p - 1.0) for _, p, m in records if p > 0]))
        cohorts = {}
        bounds = (0, *COHORTS, float("inf"))
        for lo, hi in zip(bounds, bounds[1:]):
            errors = [(m / p - 1.0) for n, p, m in records if lo < n <= hi and p > 0]
            if errors:
                cohorts[f"{lo + 1}-{hi if hi != float('inf') else 'inf'}"] = residual_summary(errors)
        out["cohorts"] = cohorts
        return out


def residual_summary(errors: list[float]) -> dict:
    """Median, p95 and max of relative errors, and the margin that would have covered the p95."""
    if not errors:
        return {"residual_median": None, "residual_p95": None, "residual_max": None, "suggested_margin": None}
    ordered = sorted(errors)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {"residual_median": statistics.median(ordered), "residual_p95": p95, "residual_max": ordered[-1],
            "suggested_margin": max(0.0, p95)}


class MemoryCollector:
    """Prometheus view of the admission's calibration and refusals, read at every scrape."""

    def __init__(self, admission: Callable[[], MemoryAdmission | None]) -> None:
        self.admission = admission  # read at every scrape: the service may swap its admission

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        admission = self.admission()
        if admission is None:
            return
        stats = admission.stats()
        yield CounterMetricFamily("kvboost_memory_refused", "Requests refused with 413 by the memory planner",
                                  value=stats["refused"])
        yield CounterMetricFamily("kvboost_memory_truncated", "Prompts cut to fit by --auto-truncate",
                                  value=stats["truncated"])
        yield GaugeMetricFamily("kvboost_memory_free_bytes", "Memory the planner plans requests into",
                                value=admission.planner.free_bytes)
        for key in ("residual_median", "residual_p95", "residual_max", "suggested_margin"):
            if stats[key] is not None:
                yield GaugeMetricFamily(f"kvboost_memory_{key}", "Measured / predicted peak - 1 " + key,
                                        value=stats[key])
