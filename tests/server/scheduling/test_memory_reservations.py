"""Every admitted request, queued or running, holds its planned bytes until it ends, under both schedulers;
prompt scoring (``echo`` + ``logprobs``) is planned and measured at its real cost; the batch scheduler
records calibration windows."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import pytest

from kvboost_hf.planner import ModelShape
from kvboost_hf.planner.memory import SCORE_SLICES, MemoryPlanner
from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.scheduling.admission import Ask, MemoryAdmission
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer

PROMPT = cycle_words(8, start=3)
NEW = 300


def shape_of(model) -> ModelShape:
    return ModelShape.from_config(model.config, dtype="float32")


def own_peak(shape: ModelShape, prompt_tokens: int, new: int) -> int:
    return MemoryPlanner(shape, 2**40, margin=0.0).plan(prompt_tokens, new).predicted_peak_bytes


def test_six_requests_that_each_fit_alone_never_take_the_plan_past_its_budget():
    shape = shape_of(make_tiny("llama", seed=1))
    one = own_peak(shape, 200, 64)
    admission = MemoryAdmission(MemoryPlanner(shape, one * 5 // 2, margin=0.0))
    budget = admission.planner.budget_bytes
    assert admission.planner.plan(200, 64).fits  # each one fits alone
    held, refused = [], []
    for _ in range(6):
        try:
            held.append(admission.admit(list(range(3, 203)), 64))
        except APIError as err:
            refused.append(err)
    assert len(held) == 2 and len(refused) == 4  # two fit together, a third does not
    # Each fits alone: not "too large" (413, not retryable) but busy (503 with Retry-After) for admit(),
    # which never waits; the server waits instead (try_admit with a ticket).
    assert all(err.status == 503 and err.code == "memory_busy" and "Retry-After" in err.headers
               and err.details["admitted_mb"] == round(2 * one / 2**20, 1) for err in refused)
    assert admission.refused == 0
    assert sum(a.plan.predicted_peak_bytes - a.reserved_bytes for a in held[:1]) == 0  # planned alone
    assert held[1].plan.predicted_peak_bytes == 2 * one <= budget  # planned beside the first
    assert admission.reserved_bytes() == sum(a.reserved_bytes for a in held) == 2 * one
    held[0].release()
    held[0].release()  # idempotent
    assert admission.reserved_bytes() == one
    held.append(admission.admit(list(range(3, 203)), 64))  # room again
    assert admission.reserved_bytes() <= budget
    for admitted in held:
        admitted.release()
    assert admission.reserved_bytes() == 0


def stream_until(base_url: str, body: dict, stop: threading.Event, lines: list) -> None:
    """Stream ``body`` until ``stop`` is set (then disconnect)."""
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                if stop.is_set():
                    break


def slow(model, seconds: float = 0.02):
    import time

    return model.register_forward_pre_hook(lambda *_: time.sleep(seconds))


def test_requests_wait_for_memory_first_come_first_admitted_and_a_group_is_all_or_nothing():
    shape = shape_of(make_tiny("llama", seed=1))
    one = own_peak(shape, 200, 64)
    admission = MemoryAdmission(MemoryPlanner(shape, one * 5 // 2, margin=0.0), max_waiting=2)
    ask = Ask(list(range(3, 203)), 64)
    first = admission.try_admit([ask])
    assert first is not None and admission.try_admit([ask, ask]) is None  # two more do not fit beside one
    assert admission.reserved_bytes() == one  # the group that did not fit holds nothing
    big, small = admission.wait_turn(), admission.wait_turn()
    assert admission.wait_turn() is None  # max_waiting already wait: the server answers 503
    assert admission.try_admit([ask], small) is None  # fits, but an earlier waiter is ahead of it
    assert admission.try_admit([ask]) is None  # so does a newcomer
    assert admission.try_admit([ask, ask], big) is None  # the head still does not fit
    first[0].release()
    group = admission.try_admit([ask, ask], big)
    assert group is not None and admission.reserved_bytes() == 2 * one
    admission.leave(big)
    assert admission.try_admit([ask], small) is None  # beside two: waits on
    admission.leave(small)
    kv = admission.planner.kv_bytes(200 + 64)
    copies = next(c for c in range(2, 64) if not admission.planner.plan(200, 64, batch_kv_bytes=(c - 1) * kv).fits)
    with pytest.raises(APIError) as err:  # so many copies never fit: 413 at once, whatever is admitted
        admission.try_admit([Ask(list(range(3, 203)), 64, copies=copies)])
    assert err.value.status == 413 and err.value.code == "request_too_large" and admission.refused == 1
    assert admission.stats()["waited"] == 2 and admission.stats()["waiting"] == 0
    for got in group:
        got.release()
    assert admission.reserved_bytes() == 0


@pytest.mark.parametrize("scheduler", ["workers", "batch"])
def test_a_queued_request_holds_its_plan_until_it_ends(scheduler):
    """One request runs, a second waits in the queue; a third that fits alone but not beside both waits for
    memory (neither queued nor refused) and runs once they end; nothing stays reserved after."""
    model = make_tiny("llama", seed=41)
    settings = {"workers": 1} if scheduler == "workers" else {"max_batch_size": 1}
    with serve(model, tiny_tokenizer(), scheduler=scheduler, **settings) as server:
        shape = shape_of(model)
        ids = server.tokenizer(PROMPT)["input_ids"]
        one = own_peak(shape, len(ids), NEW)
        admission = MemoryAdmission(MemoryPlanner(shape, one * 5 // 2, margin=0.0))
        server.app.state.service.admission = admission
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": NEW, "ignore_eos": True, "temperature": 0}
        handle = slow(model)
        stop, lines, replies = threading.Event(), [], {}

        def post(name: str, extra: dict) -> threading.Thread:
            thread = threading.Thread(target=lambda: replies.update({name: httpx.post(
                f"{server.base_url}/v1/completions", json={**body, **extra}, timeout=120)}), daemon=True)
            thread.start()
            return thread

        first = threading.Thread(target=stream_until, args=(server.base_url, {**body, "stream": True}, stop, lines),
                                 daemon=True)
        try:
            first.start()
            server.wait_until(lambda: server.queue.running == 1 and len(lines) > 2, "the first request to run")
            second = post("second", {})
            server.wait_until(lambda: server.queue.waiting == 1, "the second request to wait in the queue")
            third = post("third", {})
            server.wait_until(lambda: admission.stats()["waiting"] == 1, "the third request to wait for memory")
            assert server.queue.waiting == 1 and "third" not in replies
            assert admission.reserved_bytes() == 2 * one <= admission.planner.budget_bytes
            stats = httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()
        finally:
            stop.set()
            first.join(60)
            handle.remove()
        second.join(120)
        third.join(120)
        assert replies["second"].status_code == 200 and replies["third"].status_code == 200, replies
        assert replies["third"].json()["usage"]["completion_tokens"] == NEW
        server.wait_until(lambda: admission.reserved_bytes() == 0, "every reservation to be released")
        assert admission.refused == 0 and admission.waited == 1
        assert stats["memory"]["waiting"] == 1, stats["memory"]


@pytest.mark.parametrize("scheduler", ["workers", "batch"])
def test_a_request_waiting_for_memory_times_out_or_is_turned_away_when_the_line_is_full(scheduler):
    model = make_tiny("llama", seed=43)
    with serve(model, tiny_tokenizer(), scheduler=scheduler, request_timeout=1.0) as server:
        shape = shape_of(model)
        ids = server.tokenizer(PROMPT)["input_ids"]
        one = own_peak(shape, len(ids), NEW)
        admission = MemoryAdmission(MemoryPlanner(shape, one * 3 // 2, margin=0.0), max_waiting=1)
        server.app.state.service.admission = admission
        held = admission.admit(ids, NEW)  # as a running request would
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}
        late = {}
        waiter = threading.Thread(target=lambda: late.update(response=httpx.post(
            f"{server.base_url}/v1/completions", json=body, timeout=60)), daemon=True)
        waiter.start()
        server.wait_until(lambda: admission.stats()["waiting"] == 1, "a request to wait for memory")
        full = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert full.status_code == 503 and full.json()["error"]["code"] == "memory_busy", full.text
        assert int(full.headers["Retry-After"]) >= 1
        waiter.join(60)
        assert late["response"].status_code == 504, late["response"].text
        assert admission.stats()["waiting"] == 0 and admission.reserved_bytes() == held.reserved_bytes
        held.release()
        assert httpx.post(f"{server.base_url}/v1/completions", json={**body, "max_tokens": 2},
                          timeout=60).status_code == 200


@pytest.mark.parametrize("scheduler", ["workers", "batch"])
def test_a_request_refused_after_admission_gives_its_plan_back(scheduler):
    """A 400 found after the prompt was admitted (a bad logit_bias) and a cancelled queued request release
    what they reserved."""
    model = make_tiny("llama", seed=42)
    with serve(model, tiny_tokenizer(), scheduler=scheduler) as server:
        admission = MemoryAdmission(MemoryPlanner(shape_of(model), 2**30, margin=0.0))
        server.app.state.service.admission = admission
        bad = httpx.post(f"{server.base_url}/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": [PROMPT, PROMPT], "max_tokens": 2, "logit_bias": {"99999": 5}})
        assert bad.status_code == 400
        assert admission.reserved_bytes() == 0


def test_the_batch_scheduler_records_calibration_windows():
    model = make_tiny("llama", seed=43)
    with serve(model, tiny_tokenizer(), scheduler="batch") as server:
        server.app.state.service.admission = MemoryAdmission(MemoryPlanner(shape_of(model), 2**34, margin=0.0))
        client = server.client()

        def stats() -> dict:
            return httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["memory"]

        # A window closes at the step after which the batch is idle. That step may end after the reply reached
        # the client, and a request sent before it joins the open window (the batch never went idle). So each
        # request waits for the window before it to be recorded: two requests, two windows.
        for windows, n in enumerate((20, 200), start=1):
            client.completions.create(model=MODEL_NAME, prompt=cycle_words(n), max_tokens=4, temperature=0)
            server.wait_until(lambda: stats()["batch_windows"] >= windows, f"batch window {windows} to be recorded")
        memory = stats()
    assert memory["batch_windows"] == 2 and memory["requests"] == 0  # rows: windows, no per-request record
    assert memory["kinds"]["batch"]["records"] == memory["batch_windows"]
    assert memory["residual_median"] is not None and memory["cohorts"]
    assert memory["reserved_mb"] == 0 and memory["admitted"] == 0


# ---------------------------------------------------------------------------- prompt scoring
def test_scoring_is_planned_with_its_logits():
    shape = replace(shape_of(make_tiny("llama", seed=1)), vocab_size=262_144)
    planner = MemoryPlanner(shape, 2**40, margin=0.0)
    for n in (100, 1000):
        scored, generated = planner.plan(n, 1, score_prompt=True), planner.plan(n, 1)
        rows = min(n, SCORE_SLICES[0])
        assert scored.score_slice_tokens == SCORE_SLICES[0]
        assert scored.predicted_peak_bytes >= generated.predicted_peak_bytes + rows * shape.vocab_size * 4
    wide = MemoryPlanner(replace(shape, vocab_size=2 * 262_144), 2**40, margin=0.0)
    grown = wide.score_bytes(1000) - planner.score_bytes(1000)
    assert grown >= SCORE_SLICES[0] * 262_144 * 4  # the slice's logits scale with the vocabulary
    # A budget where the largest slice does not fit: a smaller one does, and it is the plan's.
    tight = MemoryPlanner(shape, planner.score_bytes(1000, 64), margin=0.0)
    assert tight.plan(1000, 1, score_prompt=True).score_slice_tokens == 64
    assert tight.plan(1000, 1).fits and tight.suggested_max_tokens(1000, score_prompt=True) > 0


@pytest.mark.parametrize("scheduler", ["workers", "batch"])
def test_echo_with_logprobs_is_planned_scored_in_slices_that_fit_and_measured(scheduler):
    model = make_tiny("llama", seed=44)
    with serve(model, tiny_tokenizer(), scheduler=scheduler) as server:
        shape = replace(shape_of(model), vocab_size=262_144)  # plan as if the LM head were Gemma's
        roomy = MemoryPlanner(shape, 2**40, margin=0.0)
        prompt = cycle_words(100, start=9)
        n = len(server.tokenizer(prompt)["input_ids"])
        budget = roomy.score_bytes(n, 32)
        assert roomy.plan(n, 1).predicted_peak_bytes < budget < roomy.score_bytes(n, 64)
        admission = MemoryAdmission(MemoryPlanner(shape, budget, margin=0.0))
        server.app.state.service.admission = admission
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
        forwarded: list[int] = []
        handle = model.register_forward_pre_hook(
            lambda module, args, kwargs: forwarded.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
        try:
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        finally:
            handle.remove()
        assert response.status_code == 200, response.text
        assert forwarded and max(forwarded) <= 32  # the planner's slice
        memory = admission.stats()
        assert memory["kinds"]["scoring"]["records"] == 1 and admission.reserved_bytes() == 0
        # Below the leanest slice's peak scoring cannot run: 413, while the same prompt without logprobs fits.
        admission = MemoryAdmission(MemoryPlanner(shape, roomy.score_bytes(n, SCORE_SLICES[-1]) - 1, margin=0.0))
        server.app.state.service.admission = admission
        refused = httpx.post(f"{server.base_url}/v1/completions", json={**body, "prompt": cycle_words(100, 2)},
                             timeout=60)
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
        plain = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                           json={**body, "prompt": cycle_words(100, 2), "logprobs": None, "max_tokens": 1})
        assert plain.status_code == 200


def test_overlapping_runs_are_calibrated_as_one_period_and_a_lone_run_on_its_own():
    """Two generations that overlap (two workers) share the resident set: no per-request record, one
    ``concurrent`` record with their planned total; a generation alone gets its own record."""
    shape = shape_of(make_tiny("llama", seed=1))
    admission = MemoryAdmission(MemoryPlanner(shape, 2**30, margin=0.0))
    a, b, c = (admission.admit(list(range(3, 3 + n)), 8) for n in (40, 60, 80))
    inside, leave = threading.Event(), threading.Event()

    def first() -> None:
        with admission.running(a):
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(30)
    with admission.running(b):
        pass
    leave.set()
    thread.join(30)
    records = admission.calibration.records()
    assert [(kind, tokens, predicted) for kind, tokens, predicted, _ in records] == [
        ("concurrent", 100, a.reserved_bytes + b.reserved_bytes)]
    with admission.running(c):
        pass
    kind, tokens, predicted, _ = admission.calibration.records()[-1]
    assert (kind, tokens) == ("generation", 80) and predicted == admission.planner.peak_bytes(80, 8)
    stats = admission.stats()
    assert stats["requests"] == 1 and stats["concurrent_periods"] == 1 and set(stats["kinds"]) == {
        "generation", "concurrent"}
    for admitted in (a, b, c):
        admitted.release()
    assert admission.reserved_bytes() == 0


def test_a_job_gives_back_what_it_holds_once_however_it_ends():
    import asyncio

    from kvboost_hf.server.scheduling.workers import Job

    loop = asyncio.new_event_loop()
    try:
        ended: list[str] = []
        waiting = Job(lambda job: None, loop=loop)
        waiting.on_end(lambda: ended.append("waiting"))
        waiting.cancel()  # cancelled before a scheduler started it: released now
        assert ended == ["waiting"] and not waiting.begin()
        waiting.emit("cancelled")  # the scheduler skips it later: nothing runs twice
        running = Job(lambda job: None, loop=loop)
        running.on_end(lambda: ended.append("running"))
        assert running.begin()
        running.cancel()  # started: what it holds stays until its last event
        assert ended == ["waiting"]
        running.emit("delta", "x")
        running.emit("done", [])
        running.emit("done", [])
        assert ended == ["waiting", "running"]
    finally:
        loop.close()
