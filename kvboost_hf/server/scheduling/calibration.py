"""Calibration of the memory planner: predicted against measured peaks, kept for ``/v1/stats`` and ``/metrics``.

Four kinds of record, each ``(kind, prompt tokens, predicted, measured)``:

- ``generation``: one ``model.generate`` call that ran with no other overlapping it (the worker
  scheduler, and the batch scheduler's whole-request jobs), predicted = the planner's peak for that call;
- ``scoring``: one prompt scored for ``echo`` + ``logprobs`` the same way, predicted = its scoring peak;
- ``concurrent``: a busy period in which such calls overlapped (several workers share the process's
  memory, so no call's own peak is observable): predicted = the highest planned total of the requests
  that had started, measured = the process's peak above its level when the period began;
- ``batch``: a window of batch steps (rows share every forward): predicted and measured as for
  ``concurrent``, the level taken when the batch was last idle.

Measured is CUDA's allocated memory on a GPU, else the resident set sampled every ``SAMPLE_S`` by one
thread while any :class:`PeakMeter` runs (with glibc's default allocator freed memory can stay resident:
see docs/capacity.md).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvboost_hf.planner.probe import process_rss_bytes


class MemoryAdmission(Protocol):
    """What calibration reads of the server's admission (:class:`kvboost_hf.server.scheduling.admission.MemoryAdmission`)."""

    calibration: Calibration

    def open_high(self) -> Any: ...

    def close_high(self, high: Any) -> tuple[int, int]: ...

    def stats(self) -> dict: ...


COHORTS = (512, 2048, 8192)  # prompt-length buckets for per-cohort calibration errors
SAMPLE_S = 0.005
MAX_RECORDS = 1000
WINDOW_STEPS = 64  # batch steps per calibration window while the batch stays busy
KINDS = ("generation", "scoring", "concurrent", "batch")


class _Meters:
    """The meters running now; on CPU one sampler thread raises their peaks while any runs; on CUDA the
    allocator's peak counter is folded into every running meter before each reset."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: set[PeakMeter] = set()
        self.thread: threading.Thread | None = None

    def add(self, meter: PeakMeter) -> None:
        with self.lock:
            self.active.add(meter)
            if meter.device != "cuda" and self.thread is None:
                self.thread = threading.Thread(target=self._sample, name="kvboost-rss-sampler", daemon=True)
                self.thread.start()

    def remove(self, meter: PeakMeter) -> None:
        with self.lock:
            self.active.discard(meter)

    def fold_cuda(self, reset: bool) -> None:
        """Raise every running CUDA meter's peak to the allocator's; then reset the counter (``reset``)."""
        import torch

        with self.lock:
            peak = torch.cuda.max_memory_allocated()
            for meter in self.active:
                if meter.device == "cuda":
                    meter.peak = max(meter.peak, peak)
            if reset:
                torch.cuda.reset_peak_memory_stats()

    def _sample(self) -> None:
        while True:
            rss = process_rss_bytes()
            with self.lock:
                cpu = [m for m in self.active if m.device != "cuda"]
                if not cpu:
                    self.thread = None
                    return
                for meter in cpu:
                    meter.peak = max(meter.peak, rss)
            time.sleep(SAMPLE_S)


_METERS = _Meters()


class PeakMeter:
    """The highest memory of this process (CUDA allocated on ``"cuda"``, else resident) above its level at
    :meth:`start`, until :meth:`stop`; meters may overlap (a request inside a batch window)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.base = self.peak = 0

    def level(self) -> int:
        if self.device == "cuda":
            import torch

            return torch.cuda.memory_allocated()
        return process_rss_bytes()

    def start(self) -> PeakMeter:
        self.base = self.peak = self.level()
        _METERS.add(self)
        if self.device == "cuda":
            _METERS.fold_cuda(reset=True)
        return self

    def lap(self) -> int:
        """The peak so far above the start level; the peak starts again from the level now (same base)."""
        measured = self._measure(reset=True)
        self.peak = self.level()
        return measured

    def stop(self) -> int:
        """The peak above the start level; the meter stops."""
        measured = self._measure(reset=False)
        _METERS.remove(self)
        return measured

    def _measure(self, reset: bool) -> int:
        if self.device == "cuda":
            _METERS.fold_cuda(reset)
        self.peak = max(self.peak, self.level())
        return max(0, self.peak - self.base)


def residual_summary(errors: list[float]) -> dict:
    """Median, p95 and max of relative errors, and the margin that would have covered the p95."""
    if not errors:
        return {"residual_median": None, "residual_p95": None, "residual_max": None, "suggested_margin": None}
    ordered = sorted(errors)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {"residual_median": statistics.median(ordered), "residual_p95": p95, "residual_max": ordered[-1],
            "suggested_margin": max(0.0, p95)}


class Calibration:
    """The last ``MAX_RECORDS`` records ``(kind, prompt tokens, predicted, measured)``; thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[tuple[str, int, int, int]] = []

    def record(self, kind: str, prompt_tokens: int, predicted: int, measured: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        with self._lock:
            self._records.append((kind, prompt_tokens, predicted, measured))
            del self._records[:-MAX_RECORDS]

    def records(self) -> list[tuple[str, int, int, int]]:
        with self._lock:
            return list(self._records)

    def stats(self) -> dict:
        """Residuals (measured / predicted - 1) overall, per kind and per prompt-length cohort; how many
        requests (generation and scoring records), concurrent periods and batch windows they come from."""
        records = [r for r in self.records() if r[2] > 0]
        out = {"requests": sum(1 for r in records if r[0] in ("generation", "scoring")),
               "concurrent_periods": sum(1 for r in records if r[0] == "concurrent"),
               "batch_windows": sum(1 for r in records if r[0] == "batch")}
        out.update(residual_summary([m / p - 1.0 for _, _, p, m in records]))
        out["kinds"] = {kind: {"records": len(errors), **residual_summary(errors)}
                        for kind in KINDS if (errors := [m / p - 1.0 for k, _, p, m in records if k == kind])}
        cohorts = {}
        bounds = (0, *COHORTS, float("inf"))
        for lo, hi in zip(bounds, bounds[1:]):
            errors = [m / p - 1.0 for _, n, p, m in records if lo < n <= hi]
            if errors:
                cohorts[f"{lo + 1}-{hi if hi != float('inf') else 'inf'}"] = residual_summary(errors)
        out["cohorts"] = cohorts
        return out


class BatchCalibration:
    """Windows of the batch scheduler's steps: call :meth:`before_step` and :meth:`after_step` around every
    step. A window opens at the first step after the batch was idle (the base level is taken there) and is
    recorded every ``steps`` steps and when the batch goes idle: predicted = the highest planned total of
    the requests that had started (:meth:`MemoryAdmission.open_high`), measured = the peak since the window
    opened above the base level."""

    def __init__(self, admission: Callable[[], MemoryAdmission | None], steps: int = WINDOW_STEPS) -> None:
        self.admission, self.steps = admission, steps
        self._meter: PeakMeter | None = None
        self._owner: MemoryAdmission | None = None
        self._high: list[int] | None = None
        self._count = 0

    def before_step(self) -> None:
        admission = self.admission()
        if admission is not self._owner:  # planning switched on, off or to another admission: start over
            self.close()
            self._owner = admission
        if admission is None or self._meter is not None:
            return
        self._meter = PeakMeter(admission.device).start()
        self._high = admission.open_high()
        self._count = 0

    def after_step(self, idle: bool) -> None:
        if self._meter is None or self._owner is None:
            return
        self._count += 1
        if not idle and self._count < self.steps:
            return
        predicted, tokens = self._owner.close_high(self._high)
        measured = self._meter.stop() if idle else self._meter.lap()
        if predicted > 0:
            self._owner.calibration.record("batch", tokens, predicted, measured)
        self._count = 0
        self._high = None if idle else self._owner.open_high()
        if idle:
            self._meter = None

    def close(self) -> None:
        """Stop the open window without recording it."""
        if self._meter is not None:
            self._meter.stop()
        if self._owner is not None and self._high is not None:
            self._owner.close_high(self._high)
        self._meter = self._high = None


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
        yield GaugeMetricFamily("kvboost_memory_reserved_bytes",
                                "Planned peak bytes of every admitted request, queued or running",
                                value=admission.reserved_bytes())
        for key in ("residual_median", "residual_p95", "residual_max", "suggested_margin"):
            if stats[key] is not None:
                yield GaugeMetricFamily(f"kvboost_memory_{key}", "Measured / predicted peak - 1 " + key,
                                        value=stats[key])
