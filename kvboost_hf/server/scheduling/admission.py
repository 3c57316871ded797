"""Memory admission for the server: plan each request before it runs, refuse or truncate what cannot fit,
hold every admitted request's planned bytes until it ends, and measure real peaks.

The planner only decides (:class:`~kvboost_hf.planner.memory.MemoryPlanner`); this module applies its
decision to a request (413 with the figures, or the longest prompt prefix that fits with
``--auto-truncate``) and keeps the ledger of what is admitted: a request's :class:`Reservation` (its
predicted peak beside what was already admitted) is taken when it is admitted and held while it waits
in the queue and while it runs, until its job ends, fails or is cancelled, under either scheduler. A
request is planned against every reservation held, so the planned total never exceeds the budget. A
request that could not fit even alone is refused (413) before it is queued; one that fits alone but not
beside what is admitted now waits for memory, first come first admitted, as a request waits for a free
slot in vLLM's scheduler (the server bounds the wait by the request timeout, 504, and the line by
``max_waiting``, 503). Measured peaks go to the :class:`~.calibration.Calibration`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from kvboost_hf.planner.memory import MIB, SCORE_SLICES, MemoryPlanner, RequestPlan
from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.scheduling.calibration import Calibration, MemoryCollector, PeakMeter, residual_summary

__all__ = ["Admitted", "Ask", "MemoryAdmission", "MemoryCollector", "Reservation", "plan_headers", "residual_summary"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ask:
    """One prompt of a request to plan: ``copies`` generations of it (``n``, ``best_of``: each holds its own
    K/V) of up to ``max_new_tokens``, and with ``score_prompt`` the scoring of the prompt (``echo`` with
    ``logprobs``)."""

    prompt_ids: list[int]
    max_new_tokens: int
    copies: int = 1
    score_prompt: bool = False


def too_large_error(plan: RequestPlan) -> APIError:
    """413 for a request whose plan does not fit even with nothing else admitted."""
    what = (f"lower max_tokens to {plan.suggested_max_tokens}" if plan.suggested_max_tokens
            else "shorten the prompt")
    return APIError(
        413,
        f"this request would need about {plan.predicted_peak_bytes / MIB:,.0f} MiB at its peak; "
        f"{plan.free_bytes / MIB:,.0f} MiB are free for requests: {what}",
        param="messages/prompt", code="request_too_large", details=plan.error_payload(),
    )


class Reservation:
    """The bytes one admitted request holds in the plan, from admission until :meth:`release` (idempotent)."""

    def __init__(self, owner: MemoryAdmission, nbytes: int, prompt_tokens: int) -> None:
        self.owner, self.nbytes, self.prompt_tokens = owner, nbytes, prompt_tokens
        self.started = False

    def release(self) -> None:
        self.owner._drop(self)


@dataclass(frozen=True)
class Admitted:
    """A request the planner let in: its (possibly truncated) prompt, its plan and its reservation."""

    prompt_ids: list[int]
    plan: RequestPlan | None
    truncated_from: int | None = None  # the original prompt length when --auto-truncate cut it
    reservation: Reservation | None = field(default=None, compare=False, repr=False)

    @property
    def reserved_bytes(self) -> int:
        return self.reservation.nbytes if self.reservation is not None else 0

    def release(self) -> None:
        """Give the request's planned bytes back (when it ended, or was never queued); idempotent."""
        if self.reservation is not None:
            self.reservation.release()


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


class MemoryAdmission:
    """Plans, admits (reserves), releases and measures requests for one server."""

    def __init__(self, planner: MemoryPlanner, auto_truncate: bool = False, device: str = "cpu",
                 max_waiting: int = 64) -> None:
        self.planner, self.auto_truncate, self.device = planner, auto_truncate, device
        self.calibration = Calibration()
        self._lock = threading.Lock()
        self._reservations: set[Reservation] = set()
        self._in_flight: dict[object, int] = {}  # one key per running generation -> its K/V bytes (a figure only)
        self._highs: list[list[int]] = []  # open trackers: highest [bytes, prompt tokens] of started reservations
        self._runs: dict[object, bool] = {}  # calls inside running() now -> whether another overlapped them
        self._period: tuple[PeakMeter, list[int]] | None = None  # while any runs: its meter and high-water tracker
        self._period_overlapped = False
        self._waiters: collections.deque[object] = collections.deque()  # tickets of requests waiting for memory
        self.max_waiting = max_waiting
        self.refused = self.truncated = self.waited = 0

    # ------------------------------------------------------------------ the ledger
    def reserved_bytes(self) -> int:
        """Planned bytes of every admitted request not ended yet, queued or running."""
        with self._lock:
            return sum(r.nbytes for r in self._reservations)

    def batch_kv_bytes(self) -> int:
        """K/V bytes of the generations running now (rows, workers): a figure for ``/v1/stats``; planning uses
        :meth:`reserved_bytes`, which covers them."""
        with self._lock:
            return sum(self._in_flight.values())

    def _drop(self, reservation: Reservation) -> None:
        with self._lock:
            self._reservations.discard(reservation)

    def mark_started(self, admitted: Admitted) -> None:
        """The request began to run (its first row, or its job): its bytes count in the calibration of what
        runs at once."""
        reservation = admitted.reservation
        if reservation is None:
            return
        with self._lock:
            if reservation in self._reservations:
                reservation.started = True
            self._raise_highs()

    def open_high(self) -> list[int]:
        """A tracker of the highest ``[planned bytes, prompt tokens]`` of the started requests from now on."""
        with self._lock:
            return self._open_high()

    def close_high(self, tracker: list[int]) -> tuple[int, int]:
        """What ``tracker`` saw (it stops)."""
        with self._lock:
            return self._close_high(tracker)

    def _open_high(self) -> list[int]:
        tracker = self._started_total()
        self._highs.append(tracker)
        return tracker

    def _close_high(self, tracker: list[int]) -> tuple[int, int]:
        self._raise_highs()
        self._highs = [t for t in self._highs if t is not tracker]
        return tracker[0], tracker[1]

    def _raise_highs(self) -> None:
        now = self._started_total()
        for tracker in self._highs:
            if now[0] > tracker[0]:
                tracker[:] = now

    def _started_total(self) -> list[int]:
        started = [r for r in self._reservations if r.started]
        return [sum(r.nbytes for r in started), sum(r.prompt_tokens for r in started)]

    # ------------------------------------------------------------------ admission
    def admit(self, prompt_ids: list[int], max_new_tokens: int, copies: int = 1, alongside: int = 0,
              score_prompt: bool = False) -> Admitted:
        """One prompt admitted now, without waiting: :meth:`try_admit` of one :class:`Ask`, and APIError 503
        (``memory_busy``) when it fits alone but not beside what is admitted."""
        got = self.try_admit([Ask(prompt_ids, max_new_tokens, copies, score_prompt)], alongside=alongside)
        if got is None:
            raise self.busy_error()
        return got[0]

    def try_admit(self, asks: list[Ask], ticket: object | None = None, alongside: int = 0) -> list[Admitted] | None:
        """Every prompt of one request planned and reserved together (all or none), or None when they fit
        alone but not beside the requests admitted now, or when an earlier waiter (see :meth:`wait_turn`)
        is ahead of ``ticket``: retry when a request ends. APIError 413 (with the planner's figures) when
        they could not fit even alone; with ``auto_truncate``, a prompt is cut to what fits alone instead.

        ``alongside``: further bytes that count as running beside them. The reservation of each prompt is
        its plan's peak less what is held before it, so the reserved total stays within the budget.
        """
        with self._lock:
            asks = self._fit_alone(asks, alongside)
            if self._waiters and self._waiters[0] is not ticket:
                return None
            admitted: list[Admitted] = []
            for ask, truncated_from in asks:
                others = sum(r.nbytes for r in self._reservations) + alongside
                batch = others + (ask.copies - 1) * self.planner.kv_bytes(len(ask.prompt_ids) + ask.max_new_tokens)
                plan = self.planner.plan(len(ask.prompt_ids), ask.max_new_tokens, batch_kv_bytes=batch,
                                         score_prompt=ask.score_prompt)
                if not plan.fits:
                    for got in admitted:
                        self._reservations.discard(got.reservation)
                    return None
                admitted.append(self._reserve(ask.prompt_ids, plan, others, truncated_from))
            self.truncated += sum(truncated_from is not None for _, truncated_from in asks)
            return admitted

    def _fit_alone(self, asks: list[Ask], alongside: int) -> list[tuple[Ask, int | None]]:
        """``asks`` as they fit with nothing else admitted (each with its original prompt length when
        ``auto_truncate`` cut it); APIError 413 when one cannot (call with the lock held)."""
        out, held = [], alongside
        for ask in asks:
            n = len(ask.prompt_ids)
            batch = held + (ask.copies - 1) * self.planner.kv_bytes(n + ask.max_new_tokens)
            plan = self.planner.plan(n, ask.max_new_tokens, batch_kv_bytes=batch, score_prompt=ask.score_prompt)
            truncated_from = None
            if not plan.fits and self.auto_truncate:
                keep = self.planner.truncated_prompt(n, ask.max_new_tokens, batch, score_prompt=ask.score_prompt)
                if keep > 0:
                    ask, truncated_from = replace(ask, prompt_ids=ask.prompt_ids[:keep]), n
                    plan = self.planner.plan(keep, ask.max_new_tokens, batch_kv_bytes=batch,
                                             score_prompt=ask.score_prompt)
            if not plan.fits:
                self.refused += 1
                raise too_large_error(plan)
            out.append((ask, truncated_from))
            held = plan.predicted_peak_bytes
        return out

    def wait_turn(self) -> object | None:
        """A place in the line of requests waiting for memory (first come, first admitted), or None when
        ``max_waiting`` already wait; give it back with :meth:`leave`."""
        with self._lock:
            if len(self._waiters) >= self.max_waiting:
                return None
            ticket = object()
            self._waiters.append(ticket)
            self.waited += 1
            return ticket

    def leave(self, ticket: object) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self._waiters.remove(ticket)

    def busy_error(self, retry_after: str = "1") -> APIError:
        """503 for a request that fits alone but not beside the requests admitted now."""
        held = self.reserved_bytes()
        return APIError(503, f"the memory this request needs is held by requests already admitted "
                             f"({held / MIB:,.0f} MiB of {self.planner.budget_bytes / MIB:,.0f} MiB); retry later",
                        code="memory_busy", headers={"Retry-After": retry_after},
                        details={"admitted_mb": round(held / MIB, 1)})

    def _reserve(self, prompt_ids: list[int], plan: RequestPlan, others: int,
                 truncated_from: int | None = None) -> Admitted:
        """Hold ``plan``'s peak less ``others`` (call with the lock held)."""
        reservation = Reservation(self, max(0, plan.predicted_peak_bytes - others), plan.prompt_tokens)
        self._reservations.add(reservation)
        return Admitted(prompt_ids, plan, truncated_from, reservation)

    def kv_bytes(self, admitted: Admitted) -> int:
        """K/V bytes one generation of ``admitted`` holds at its end."""
        plan = admitted.plan
        return self.planner.kv_bytes(plan.prompt_tokens + plan.max_new_tokens, plan.kv_bits) if plan else 0

    # ------------------------------------------------------------------ while requests run
    @contextlib.contextmanager
    def in_batch(self, admitted: Admitted) -> Iterator[None]:
        """Count one generation's K/V in :meth:`batch_kv_bytes` while it runs (a batch row: rows share every
        forward, so its own peak is not observable; the batch scheduler measures windows of steps)."""
        key = object()
        with self._lock:
            self._in_flight[key] = self.kv_bytes(admitted)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.pop(key, None)

    @contextlib.contextmanager
    def running(self, admitted: Admitted, scoring: bool = False) -> Iterator[None]:
        """One generation of ``admitted`` (or, with ``scoring``, the scoring of its prompt) runs on this thread:
        count it as started and running, and record the planner's peak for that call against the measured
        one when no other such call overlapped it. Calls that overlap (several workers) share the process's
        memory: their busy period is recorded instead (``concurrent``: the planned total of the started
        requests against the process's peak above its level when the period began)."""
        plan = admitted.plan
        self.mark_started(admitted)
        if plan is None:
            yield
            return
        if scoring:
            predicted = self.planner.score_bytes(plan.prompt_tokens, plan.score_slice_tokens or SCORE_SLICES[0])
        else:
            predicted = self.planner.peak_bytes(plan.prompt_tokens, plan.max_new_tokens, plan.reused_tokens,
                                                plan.prefill_chunk_size, 0, plan.kv_bits)
        key = object()
        with contextlib.ExitStack() as stack:
            if not scoring:
                stack.enter_context(self.in_batch(admitted))
            self._enter_run(key)
            meter = PeakMeter(self.device).start()
            try:
                yield
            finally:
                measured = meter.stop()
                overlapped = self._leave_run(key)
            if not overlapped:
                self.calibration.record("scoring" if scoring else "generation", plan.prompt_tokens, predicted,
                                        measured)

    def _enter_run(self, key: object) -> None:
        with self._lock:
            if self._runs:
                self._period_overlapped = True
                for other in self._runs:
                    self._runs[other] = True
            else:
                self._period = (PeakMeter(self.device).start(), self._open_high())
            self._runs[key] = bool(self._period_overlapped)

    def _leave_run(self, key: object) -> bool:
        """Whether the run overlapped another; the busy period is recorded when the last run leaves."""
        with self._lock:
            overlapped = self._runs.pop(key, False)
            if self._runs or self._period is None:
                return overlapped
            (meter, tracker), self._period = self._period, None
            recorded, self._period_overlapped = self._period_overlapped, False
            planned, tokens = self._close_high(tracker)
        measured = meter.stop()
        if recorded and planned > 0:
            self.calibration.record("concurrent", tokens, planned, measured)
        return overlapped

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict:
        """Free memory, margin, refusals, what is admitted now, and the calibration's residuals."""
        step = self.planner.decode_step_s
        with self._lock:
            reserved, admitted = sum(r.nbytes for r in self._reservations), len(self._reservations)
        out = {"free_mb": round(self.planner.free_bytes / MIB, 1), "margin": self.planner.margin,
               "budget_mb": round(self.planner.budget_bytes / MIB, 1),
               "decode_step_ms": None if step is None else round(step * 1000, 2),
               "refused": self.refused, "truncated": self.truncated, "waited": self.waited,
               "waiting": len(self._waiters),
               "admitted": admitted, "reserved_mb": round(reserved / MIB, 1),
               "in_flight_kv_mb": round(self.batch_kv_bytes() / MIB, 1)}
        out.update(self.calibration.stats())
        return out
