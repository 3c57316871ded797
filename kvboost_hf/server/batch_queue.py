"""The continuous-batching scheduler of the server (``--scheduler batch``).

One thread owns the model. Each step it frees rows whose client left or timed out, admits
waiting requests (store lookup on their own cache), decodes every decoding row in one batched
forward, and forwards prompt chunks within ``max_batched_tokens``, so a long prompt never stops
the running streams for more than one chunk. A finished row commits its confirmed K/V to the
store and its job gets ``("done", Reply)``. Jobs without a row request (``/v1/warm``) run on the
same thread between steps.

Jobs and events are those of :mod:`~kvboost_hf.server.scheduler` (``started``, ``delta``,
``done``, ``error``, ``cancelled``), so the routes serve both schedulers alike.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..batching import BatchLimits, BatchRunner, RowSampling, Sequence, plan_step
from .admission import Admitted, MemoryAdmission
from .batch_metrics import BatchMetrics
from .generation import Reply, ReplyText, SamplingParams
from .scheduler import Job, QueueFullError

logger = logging.getLogger(__name__)


@dataclass
class RowRequest:
    """What a generation job asks of the batch: its prompt, sampling settings and plan."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    admitted: Admitted | None = None


class _Row:
    """A job in the running batch: its sequence, visible text and memory accounting."""

    def __init__(self, job: Job, request: RowRequest, eos_ids: list[int], tokenizer) -> None:
        params = request.params
        self.job, self.request = job, request
        self.text = ReplyText(tokenizer, params.stop)
        sampling = RowSampling(temperature=params.temperature, top_p=params.top_p, seed=params.seed)
        self.seq = Sequence(request.prompt_ids, params.max_tokens, sampling, eos_ids, self.text, params.ignore_eos)
        self.resources = contextlib.ExitStack()

    def emit_delta(self, final: bool = False) -> None:
        if self.request.stream:
            piece = self.text.delta(final=final)
            if piece:
                self.job.emit("delta", piece)

    def reply(self) -> Reply:
        seq, stats = self.seq, getattr(self.seq.cache, "stats", None)
        finish = None if seq.finish_reason == "cancelled" else seq.finish_reason
        return Reply(text=self.text.text, prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.generated),
                     cached_tokens=stats.reused_tokens if stats is not None else 0, finish_reason=finish,
                     first_token_at=seq.first_token_at, token_ids=list(seq.generated))


class BatchingQueue:
    """A FIFO of at most ``max_queue`` waiting jobs in front of a batch of ``limits.max_batch_size`` rows.

    Same surface as :class:`~kvboost_hf.server.scheduler.GenerationQueue` (``submit``,
    ``waiting``, ``running``, ``depth``, ``start``, ``stop``). ``admission`` returns the
    server's memory admission (or None): each row's K/V is accounted while it runs.
    """

    workers = 1

    def __init__(self, model, tokenizer, store, eos_ids: list[int], limits: BatchLimits, max_queue: int,
                 admission: Callable[[], MemoryAdmission | None] = lambda: None,
                 metrics: BatchMetrics | None = None) -> None:
        self.runner = BatchRunner(model, store)
        self.tokenizer, self.eos_ids, self.limits = tokenizer, eos_ids, limits
        self.max_queue = max_queue
        self.admission = admission
        self.metrics = metrics or BatchMetrics()
        self._incoming: deque[Job] = deque()
        self._rows: list[_Row] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.completed = 0
        self.skipped = 0

    # ------------------------------------------------------------------ surface
    @property
    def waiting(self) -> int:
        return len(self._incoming)

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def depth(self) -> int:
        return self.waiting + self.running

    def stats(self) -> dict:
        return {"max_batch_size": self.limits.max_batch_size, "max_batched_tokens": self.limits.max_batched_tokens,
                **self.metrics.snapshot()}

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`QueueFullError` when the batch is full and ``max_queue`` jobs wait."""
        with self._cond:
            if self.depth >= self.limits.max_batch_size + self.max_queue:
                raise QueueFullError(f"{self.waiting} requests are already waiting (max_queue={self.max_queue})")
            self._incoming.append(job)
            self._cond.notify()

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="kvboost-batch", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel running and waiting jobs; the scheduler thread exits."""
        with self._cond:
            self._stopping = True
            for job in list(self._incoming) + [row.job for row in self._rows]:
                job.cancel()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._incoming and not self._rows:
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                self._step()
            except Exception as exc:  # a failed forward: every row of the step fails, the server keeps serving
                logger.exception("batch step failed")
                for row in list(self._rows):
                    self._end(row, error=exc)
        for row in list(self._rows):
            row.seq.cancel()
            self._end(row)
        self._rows = []
        while self._incoming:
            self._incoming.popleft().emit("cancelled")

    def _step(self) -> None:
        self._drop_cancelled()
        decoding = [row for row in self._rows if row.seq.decoding]
        prefilling = [row for row in self._rows if row.seq.prefilling]
        plan = plan_step(len(self._rows), self.waiting, len(decoding), [], self.limits)
        for _ in range(plan.admit):
            row = self._admit()
            if row is not None and row.seq.prefilling:
                prefilling.append(row)
        chunks = plan_step(len(self._rows), 0, len(decoding), [r.seq.prefill.remaining for r in prefilling],
                           self.limits).chunks
        logits, ends = self.runner.step([row.seq for row in decoding], [row.seq for row in prefilling], chunks)
        for row, row_logits in zip(decoding, logits if logits is not None else ()):
            self._take(row, row_logits)
        for row, end in zip(prefilling, ends):
            if end is not None:
                self._take(row, end)
        self.metrics.observe_step(len(decoding), [n for n in chunks if n])
        for row in [r for r in self._rows if r.seq.finished]:
            self._end(row)

    def _drop_cancelled(self) -> None:
        for row in list(self._rows):
            if row.job.cancelled.is_set():
                row.seq.cancel()
                self._end(row)
        with self._cond:
            kept = deque()
            for job in self._incoming:
                if job.cancelled.is_set():
                    self.skipped += 1
                    job.emit("cancelled")
                else:
                    kept.append(job)
            self._incoming = kept

    def _admit(self) -> _Row | None:
        """Start the oldest waiting job: a row (lookup done) or, for other work, run it now."""
        with self._cond:
            job = self._incoming.popleft()
        job.started_at = time.perf_counter()
        self.metrics.observe_wait(job.started_at - job.enqueued_at)
        request = getattr(job, "request", None)
        job.emit("started", job.started_at)
        if not isinstance(request, RowRequest):
            self._run_work(job)
            return None
        try:
            row = _Row(job, request, self.eos_ids, self.tokenizer)
        except Exception as exc:
            job.emit("error", exc)
            return None
        self._rows.append(row)
        try:
            admission = self.admission()
            if admission is not None and request.admitted is not None and request.admitted.plan is not None:
                row.resources.enter_context(admission.in_batch(request.admitted))
            self.runner.start(row.seq)
        except Exception as exc:
            logger.exception("starting a request failed")
            self._end(row, error=exc)
            return None
        return row

    def _run_work(self, job: Job) -> None:
        try:
            result = job.work(job)
        except Exception as exc:
            logger.exception("job failed")
            job.emit("error", exc)
        else:
            job.emit("done", result)
        finally:
            job.finished_at = time.perf_counter()
            self.completed += 1

    def _take(self, row: _Row, logits) -> None:
        row.seq.sample(logits)
        row.emit_delta()

    def _end(self, row: _Row, error: Exception | None = None) -> None:
        """Commit the row's confirmed K/V, hand its reply (or error) to the job, release its accounting."""
        if row in self._rows:
            self._rows.remove(row)
        try:
            if error is None:
                self.runner.finish(row.seq)
        except Exception:
            logger.exception("storing a finished request's K/V failed")
        finally:
            row.resources.close()
            row.job.finished_at = time.perf_counter()
            self.completed += 1
        if error is not None:
            row.job.emit("error", error)
            return
        row.emit_delta(final=True)
        row.job.emit("done", row.reply())
