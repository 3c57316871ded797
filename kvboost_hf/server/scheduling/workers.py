"""A bounded FIFO of jobs and the worker threads that run them (``model.generate``, ``warm``).

Each worker runs one request at a time through ``model.generate`` (kvboost reuse works inside
generate, on identical batch rows, so requests are not batched together). On a CPU the best
set-up measured is one worker per core with one torch thread each: with reuse the prefill of
a shared prefix is a lookup, and batch-1 decoding gains little from a second thread but a lot
from a second request in parallel. docs/server.md has the measurement, including transformers'
continuous batching.

A :class:`Job` carries the work (a callable run on the worker thread), a cancel flag the work
polls (a ``StoppingCriteria`` during generation), and an ``asyncio.Queue`` of events that the
worker fills through ``loop.call_soon_threadsafe``: ``("started", t)``, whatever the work
emits, then ``("done", result)``, ``("error", exception)`` or ``("cancelled", None)``. What the
job holds (its memory reservation) is given back through its :meth:`Job.on_end` callbacks, once,
just before its last event is posted, or when it is cancelled before it starts.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

END_EVENTS = ("done", "error", "cancelled")


class QueueFullError(Exception):
    """The queue already holds ``max_queue`` waiting jobs."""


class Job:
    """One unit of work for the worker thread, created on the event loop that awaits it."""

    def __init__(self, work: Callable[[Job], Any], loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.work = work
        self.request: Any = None  # what the batch scheduler runs (a RowsRequest); the worker scheduler runs work
        self.cancelled = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()
        self.enqueued_at = time.perf_counter()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._loop = loop or asyncio.get_running_loop()
        self._state = threading.Lock()
        self._on_end: list[Callable[[], None]] = []

    def on_end(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the job ends (its last event), or when it is cancelled before starting."""
        with self._state:
            self._on_end.append(callback)

    def end(self) -> None:
        """Run the ``on_end`` callbacks now (idempotent: each runs once)."""
        with self._state:
            callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a job's end callback failed")

    def begin(self) -> bool:
        """Mark the job started; False when it was cancelled first (the scheduler then skips it)."""
        with self._state:
            if self.cancelled.is_set():
                return False
            self.started_at = time.perf_counter()
            return True

    def emit(self, kind: str, value: Any = None) -> None:
        """Post an event to the awaiting coroutine (thread safe; dropped when the loop is closed); a last
        event (``done``, ``error``, ``cancelled``) ends the job first."""
        if kind in END_EVENTS:
            self.end()
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            pass

    def cancel(self) -> None:
        """Ask the work to stop (or never start); generation ends at the next decoding step. A job that has
        not started ends now (what it holds is given back; the scheduler skips it)."""
        with self._state:
            self.cancelled.set()
            started = self.started_at is not None
        if not started:
            self.end()


class GenerationQueue:
    """A FIFO of at most ``max_queue`` waiting jobs in front of ``workers`` worker threads."""

    def __init__(self, max_queue: int, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.max_queue = max_queue
        self.workers = workers
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._running: set[Job] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.completed = 0
        self.skipped = 0

    @property
    def waiting(self) -> int:
        """Jobs queued behind the running one."""
        return self._waiting

    @property
    def running(self) -> int:
        """Jobs running now."""
        return len(self._running)

    @property
    def depth(self) -> int:
        """Jobs waiting plus the ones running."""
        return self._waiting + len(self._running)

    def start(self) -> None:
        if not self._threads:
            self._threads = [
                threading.Thread(target=self._run, name=f"kvboost-generate-{i}", daemon=True)
                for i in range(self.workers)
            ]
            for thread in self._threads:
                thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel running and waiting jobs; the workers exit."""
        with self._lock:
            running = list(self._running)
        for job in running:
            job.cancel()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout)
        self._threads = []
        while True:  # jobs still queued never run: they end here
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("cancelled")

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`QueueFullError` when ``max_queue`` jobs already wait."""
        with self._lock:
            if self.depth >= self.workers + self.max_queue:  # every worker busy and max_queue waiting
                raise QueueFullError(f"{self._waiting} requests are already waiting (max_queue={self.max_queue})")
            self._waiting += 1
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                if not job.begin():
                    self.skipped += 1
                    job.emit("cancelled")
                    continue
                self._running.add(job)
            job.emit("started", job.started_at)
            try:
                outcome = ("done", job.work(job))
            except Exception as exc:  # reported to the request; the worker keeps serving
                logger.exception("job failed")
                outcome = ("error", exc)
            finally:
                job.finished_at = time.perf_counter()
                # Counted before the reply goes out (as the batch queue ends a row before its event): a client that
                # has its reply reads a depth and a count that include it.
                with self._lock:
                    self._running.discard(job)
                    self.completed += 1
            job.emit(*outcome)
