"""The continuous-batching scheduler of the server (``--scheduler batch``).

One thread owns the model. Each step it frees rows whose client left or timed out, admits
waiting rows (store lookup on their own cache), decodes every decoding row in one batched
forward, and forwards prompt chunks within ``max_batched_tokens``, so a long prompt never stops
the running streams for more than one chunk. A row whose prompt shares a prefix with a prompt
being prefilled waits until that prefill ends and its K/V is in the store, then reuses it: a
burst of requests on one new system prompt computes it once. A job asks for one row per generation
(:mod:`~kvboost_hf.server.scheduling.rows`: ``n``, ``best_of`` and list prompts give several, each
with its own logits processors and logprobs); its rows join as the batch has room, a finished
row commits its confirmed K/V to the store, and when the job's last row ends the job gets
``("done", result)``. Jobs without rows (``/v1/warm``, prompt scoring, quantized-K/V plans) run
whole on the same thread between steps.

Jobs and events are those of :mod:`~kvboost_hf.server.scheduling.workers` (``started``, ``delta``,
``done``, ``error``, ``cancelled``), so the routes serve both schedulers alike. A job's memory
reservation is held from admission (before it is queued) until its last event; the memory
planner's calibration gets a record per window of steps (:class:`~.calibration.BatchCalibration`:
the planned total of the started requests against the process's peak), and one per job run whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvboost_hf.batching import BatchLimits, BatchRunner, plan_step
from kvboost_hf.batching.scheduler import waits_for_prefill
from kvboost_hf.server.observability.batch_metrics import BatchMetrics
from kvboost_hf.server.scheduling.admission import MemoryAdmission
from kvboost_hf.server.scheduling.calibration import BatchCalibration
from kvboost_hf.server.scheduling.rows import BatchRow, JobRows, RowRequest, RowsRequest
from kvboost_hf.server.scheduling.workers import Job, QueueFullError

__all__ = ["BatchingQueue", "RowRequest", "RowsRequest"]

logger = logging.getLogger(__name__)


class BatchingQueue:
    """A FIFO of at most ``max_queue`` waiting jobs in front of a batch of ``limits.max_batch_size`` rows.

    Same surface as :class:`~kvboost_hf.server.scheduling.workers.GenerationQueue` (``submit``,
    ``waiting``, ``running``, ``depth``, ``start``, ``stop``); ``running`` counts rows and
    ``waiting`` counts waiting jobs plus the rows of started jobs still waiting for room.
    ``admission`` returns the server's memory admission (or None): each row's K/V is accounted
    while it runs.
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
        self.calibration = BatchCalibration(admission)
        self._incoming: deque[Job] = deque()
        self._partial: deque[JobRows] = deque()  # started jobs with rows still waiting for room, oldest first
        self._rows: list[BatchRow] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.completed = 0
        self.skipped = 0
        self._deferred: list[int] | None = None  # the prompt of the row waiting for a shared prefill

    # ------------------------------------------------------------------ surface
    @property
    def waiting(self) -> int:
        return len(self._incoming) + sum(len(group.pending) for group in list(self._partial))

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
            for job in [*self._incoming, *(g.job for g in self._partial), *(row.job for row in self._rows)]:
                job.cancel()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._incoming and not self._rows and not self._partial:
                    self._cond.wait()
                if self._stopping:
                    break
            self.calibration.before_step()
            try:
                self._step()
            except Exception as exc:  # a failed forward: every row of the step fails, the server keeps serving
                logger.exception("batch step failed")
                for row in list(self._rows):
                    self._end(row, error=exc)
            with self._cond:
                idle = not self._incoming and not self._rows and not self._partial
            self.calibration.after_step(idle)
        self.calibration.close()
        for row in list(self._rows):
            row.seq.cancel()
            self._end(row)
        self._rows = []
        while self._partial:
            self._drop_pending(self._partial[0])
        while self._incoming:
            self._incoming.popleft().emit("cancelled")

    def _step(self) -> None:
        self._drop_cancelled()
        decoding = [row for row in self._rows if row.seq.decoding]
        prefilling = [row for row in self._rows if row.seq.prefilling]
        plan = plan_step(len(self._rows), self._waiting_rows(), len(decoding), [], self.limits)
        for _ in range(plan.admit):
            if self._waits_for_prefill([row.seq for row in prefilling]):
                break  # first come, first served: the rows behind it wait too (a few steps at most)
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
                self._publish(row)
                self._take(row, end)
        self.metrics.observe_step(len(decoding), [n for n in chunks if n])
        for row in [r for r in self._rows if r.seq.finished]:
            self._end(row)

    def _waits_for_prefill(self, prefilling: list) -> bool:
        """Whether the next row to admit shares a prefix with a prompt being prefilled that the store does
        not hold yet: it waits for that prefill to be published and then reuses it (a burst of chats on a
        new system prompt computes it once)."""
        if not prefilling or not self.runner.shares_prefills:
            return False
        nxt = self._next_row()
        if nxt is None:
            return False
        prompt = nxt.prompt_ids
        # Only prefills under the same cache_salt can serve it: waiting on another salt's would show in
        # its TTFT that someone is sending this prefix (and would save nothing).
        scope = nxt.params.cache_scope
        same_salt = [seq for seq in prefilling if seq.scope == scope]
        if not same_salt or not waits_for_prefill(prompt, self.runner.in_flight(same_salt),
                                                  self.runner.store.chunk_size):
            return False
        if self._others_queued(scope):
            return False  # a row that waits holds back those behind it: never another salt's or tenant's
        if self._deferred is not prompt:  # count each row once, however many steps it waits
            self._deferred = prompt
            self.metrics.observe_shared_wait()
        return True

    def _others_queued(self, scope) -> bool:
        """Whether a row under another scope (salt, tenant) waits to be admitted."""
        rows = [row for group in self._partial for row in group.pending]
        with self._cond:
            jobs = list(self._incoming)
        for job in jobs:
            request = getattr(job, "request", None)
            if not isinstance(request, RowsRequest):
                return True  # work run whole: it would wait too
            rows.extend(request.rows)
        return any(getattr(row, "request", row).params.cache_scope != scope for row in rows)

    def _next_row(self) -> RowRequest | None:
        """The row :meth:`_admit` would start next (None: a job run whole, or nothing waits)."""
        for group in self._partial:
            if group.pending:
                return group.pending[0].request
        with self._cond:
            job = self._incoming[0] if self._incoming else None
        request = getattr(job, "request", None)
        if isinstance(request, RowsRequest) and request.rows:
            return request.rows[0]
        return None

    def _publish(self, row: BatchRow) -> None:
        try:
            self.runner.publish(row.seq)
        except Exception:  # the rows waiting on it compute the prefix themselves: slower, never wrong
            logger.exception("storing a prefilled prompt's K/V failed")

    def _waiting_rows(self) -> int:
        """Rows that could join now: every row of each waiting job (a job run whole counts one), then
        the pending rows of started jobs; so a job's rows join in one step when the batch has room."""
        with self._cond:
            jobs = list(self._incoming)
        rows = sum(len(job.request.rows) if isinstance(job.request, RowsRequest) else 1 for job in jobs)
        return rows + sum(len(group.pending) for group in self._partial)

    def _drop_cancelled(self) -> None:
        for group in [g for g in self._partial if g.job.cancelled.is_set()]:
            self._drop_pending(group)
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

    def _admit(self) -> BatchRow | None:
        """Start the next waiting row: a pending row of a started job first, else the oldest waiting
        job's first row (lookup done). A job without rows (other work) runs whole now."""
        while self._partial and not self._partial[0].pending:
            self._partial.popleft()
        if self._partial:
            group = self._partial[0]
        else:
            group = self._start_job()
            if group is None:
                return None
        row = group.pending.pop(0)
        if not group.pending and self._partial and self._partial[0] is group:
            self._partial.popleft()
        self._rows.append(row)
        try:
            admission = self.admission()
            admitted = row.request.admitted
            if admission is not None and admitted is not None and admitted.plan is not None:
                row.resources.enter_context(admission.in_batch(admitted))  # per row: each holds its own K/V
                admission.mark_started(admitted)
            self.runner.start(row.seq)
        except Exception as exc:
            logger.exception("starting a request failed")
            self._end(row, error=exc)
            return None
        return row

    def _start_job(self) -> JobRows | None:
        """Pop the oldest waiting job: its rows (pending, queued in ``_partial``), or None when it ran
        whole (or none waits: a failed row can drop pending rows the step planned to admit)."""
        with self._cond:
            if not self._incoming:
                return None
            job = self._incoming.popleft()
        if not job.begin():  # cancelled while it waited
            self.skipped += 1
            job.emit("cancelled")
            return None
        self.metrics.observe_wait(job.started_at - job.enqueued_at)
        request = getattr(job, "request", None)
        job.emit("started", job.started_at)
        if not isinstance(request, RowsRequest):
            self._run_work(job)
            return None
        try:
            group = JobRows(job, request, self.eos_ids, self.tokenizer)
        except Exception as exc:  # e.g. a processor factory that fails for this request
            logger.exception("preparing a request's rows failed")
            self._job_ended(job)
            job.emit("error", exc)
            return None
        if not group.pending:
            self._finish(group)
            return None
        self._partial.append(group)
        return group

    def _run_work(self, job: Job) -> None:
        try:
            result = job.work(job)
        except Exception as exc:
            logger.exception("job failed")
            job.emit("error", exc)
        else:
            job.emit("done", result)
        finally:
            self._job_ended(job)

    def _take(self, row: BatchRow, logits) -> None:
        if row.seq.finished:  # cancelled in this step (a sibling row failed): its token is not wanted
            return
        try:
            row.seq.sample(logits)
        except Exception as exc:  # the row's own sampling (e.g. a grammar that cannot continue): its job fails
            logger.exception("sampling a row failed")
            self._fail(row.group, exc)
            return
        row.emit_delta()

    def _fail(self, group: JobRows, error: Exception) -> None:
        """Fail ``group``'s job: its running rows are cancelled (ended at the end of the step), pending ones dropped."""
        group.fail(error)
        self._drop_pending(group)

    def _drop_pending(self, group: JobRows) -> None:
        """Forget ``group``'s rows not started yet; its job ends here when no row of it runs."""
        group.drop_pending()
        if group in self._partial:
            self._partial.remove(group)
        if group.open == 0:
            self._finish(group)

    def _end(self, row: BatchRow, error: Exception | None = None) -> None:
        """Commit the row's confirmed K/V, release its accounting; the job's result once its last row ended.
        The row leaves ``running`` only after its accounting is released, so an idle queue holds none."""
        try:
            if error is None:
                self.runner.finish(row.seq)
        except Exception:
            logger.exception("storing a finished request's K/V failed")
        finally:
            row.resources.close()
            if row in self._rows:
                self._rows.remove(row)
        group = row.group
        if error is not None:
            self._fail(group, error)
        elif group.error is None:
            row.emit_delta(final=True)
        if group.row_ended(row):
            self._finish(group)

    def _finish(self, group: JobRows) -> None:
        if not group.finished:
            self._job_ended(group.job)
            group.finish()

    def _job_ended(self, job: Job) -> None:
        job.finished_at = time.perf_counter()
        self.completed += 1
