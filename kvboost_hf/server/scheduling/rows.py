"""The rows of the batch scheduler's jobs: what a job asks for, one row per generation, and the
group that turns a job's rows back into one result.

A job's :class:`RowsRequest` holds one :class:`RowRequest` per generation (``n``, ``best_of``
candidates and list prompts give several). Each row samples with its own settings and logits
processors, records raw logprobs when asked, and streams its deltas as ``(index, piece)``; the
job is done when its last row ends (``done`` with ``result(replies)``) and fails as a whole when
one row fails (its other rows are cancelled).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvboost_hf.batching import RowSampling, Sequence
from kvboost_hf.server.decoding.logprobs import TokenLogprob
from kvboost_hf.server.engine.generation import Reply, ReplyText, SamplingParams, visible_tokens
from kvboost_hf.server.scheduling.admission import Admitted
from kvboost_hf.server.scheduling.workers import Job


@dataclass
class RowRequest:
    """One generation run as a row: its prompt, sampling settings, memory plan, whether it streams
    and the choice ``index`` its deltas carry."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    admitted: Admitted | None = None
    index: int = 0


@dataclass
class RowsRequest:
    """What a generation job asks of the batch: its rows, and ``result``, which turns the rows'
    replies (in row order; None for a row that never started because the job was cancelled or
    failed first) into the value of the job's ``done`` event."""

    rows: list[RowRequest]
    result: Callable[[list[Reply | None]], Any]


class BatchRow:
    """One generation in the running batch: its sequence, visible text and memory accounting."""

    def __init__(self, group: JobRows, request: RowRequest, eos_ids: list[int], tokenizer) -> None:
        params = request.params
        self.group, self.request, self.tokenizer = group, request, tokenizer
        self.text = ReplyText(tokenizer, params.stop)
        processors = params.processors(len(request.prompt_ids)) if params.processors is not None else []
        sampling = RowSampling(temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                               processors=processors)
        self.seq = Sequence(request.prompt_ids, params.max_tokens, sampling, eos_ids, self.text, params.ignore_eos,
                            logprobs=params.logprobs)
        self.seq.scope = params.cache_scope
        self.resources = contextlib.ExitStack()

    @property
    def job(self) -> Job:
        return self.group.job

    def emit_delta(self, final: bool = False) -> None:
        if self.request.stream:
            piece = self.text.delta(final=final)
            if piece:
                self.job.emit("delta", (self.request.index, piece))

    def reply(self) -> Reply:
        """The row's reply; its logprobs stop where a stop string cut the text (as ``generate_reply``'s)."""
        seq, stats = self.seq, getattr(self.seq.cache, "stats", None)
        finish = None if seq.finish_reason == "cancelled" else seq.finish_reason
        generated = seq.generated[: self.text.completing_length(seq.generated)]  # up to the stop, as generate_reply
        entries = None
        if seq.top_logprobs is not None:
            shown = visible_tokens(self.tokenizer, generated, self.text.text) if self.text.stopped \
                else len(generated)
            entries = [TokenLogprob(e.token_id, e.logprob, list(e.top)) for e in seq.logprobs[:shown]]
        return Reply(text=self.text.text, prompt_tokens=len(seq.prompt_ids), completion_tokens=len(generated),
                     cached_tokens=stats.reused_tokens if stats is not None else 0, finish_reason=finish,
                     first_token_at=seq.first_token_at, token_ids=list(generated), logprobs=entries)


class JobRows:
    """The rows of one job. Rows start as the batch has room (``pending`` are not started yet);
    the job ends when every row has ended or been dropped."""

    def __init__(self, job: Job, request: RowsRequest, eos_ids: list[int], tokenizer) -> None:
        self.job, self.request = job, request
        self.rows = [BatchRow(self, row, eos_ids, tokenizer) for row in request.rows]
        self.pending: list[BatchRow] = list(self.rows)
        self.replies: list[Reply | None] = [None] * len(self.rows)
        self.open = len(self.rows)
        self.error: Exception | None = None
        self.finished = False

    def fail(self, error: Exception) -> None:
        """The job fails with the first error; its rows are cancelled (pending ones: see :meth:`drop_pending`)."""
        if self.error is None:
            self.error = error
        for row in self.rows:
            row.seq.cancel()

    def drop_pending(self) -> list[BatchRow]:
        """Forget the rows not started yet (job cancelled or failed); returns them."""
        dropped, self.pending = self.pending, []
        self.open -= len(dropped)
        return dropped

    def row_ended(self, row: BatchRow) -> bool:
        """Record an ended row's reply; True when it was the job's last open row."""
        self.replies[self.rows.index(row)] = row.reply()
        self.open -= 1
        return self.open == 0

    def finish(self) -> None:
        """Emit the job's last event (once): ``error`` when a row failed, else ``done`` with its result."""
        if self.finished:
            return
        self.finished = True
        if self.error is not None:
            self.job.emit("error", self.error)
        else:
            self.job.emit("done", self.request.result(self.replies))
