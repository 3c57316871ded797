"""The worker scheduler's queue (kvboost_hf/server/scheduling/workers.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvboost_hf.server.scheduling.workers import END_EVENTS, GenerationQueue, Job


def _fails(job: Job) -> None:
    raise RuntimeError("the forward failed")


@pytest.mark.parametrize(("work", "last"), [(lambda job: "text", "done"), (_fails, "error")])
def test_a_job_is_counted_before_its_last_event_goes_out(work, last):
    """A client holding its reply (or its error) reads a queue depth and a completed count that include its job:
    the count is taken before the job's end callbacks and its last event, not after."""
    queue = GenerationQueue(max_queue=2)
    queue.start()
    seen = []

    async def one_job() -> None:
        job = Job(work)
        job.on_end(lambda: seen.append(("on_end", queue.completed, queue.depth)))
        queue.submit(job)
        while (event := await job.events.get())[0] not in END_EVENTS:
            pass
        seen.append((event[0], queue.completed, queue.depth))

    try:
        asyncio.run(one_job())
    finally:
        queue.stop()
    assert seen == [("on_end", 1, 0), (last, 1, 0)]
