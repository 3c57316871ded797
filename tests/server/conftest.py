"""Helpers for the server tests: a real uvicorn server on a free 127.0.0.1 port in a thread,
tiny random models with a word-level tokenizer and a small chat template."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from openai import AsyncOpenAI, OpenAI

from kvboost_hf import ChunkStore, disable_chunk_reuse
from kvboost_hf.server import ServerSettings, create_app
from kvboost_hf.server.routes.background import free_port, serve_in_background
from kvboost_hf.server.scheduling.batch import BatchingQueue
from tests.conftest import make_tiny, make_tiny_tokenizer

# Roles are vocabulary words, so the word-level tokenizer keeps every template token.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }} "
    "{% for m in messages %}{{ {'system': 'w3', 'user': 'w4', 'assistant': 'w5'}[m['role']] }} {{ m['content'] }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}w5{% endif %}"
)
MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 30.0


def tiny_tokenizer():
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def words(*numbers: int) -> str:
    return " ".join(f"w{n}" for n in numbers)


def cycle_words(n: int, start: int = 0) -> str:
    """``n`` vocabulary words (w6..w95 cycling), a deterministic text of ``n`` tokens."""
    return " ".join(f"w{6 + (start + i) % 90}" for i in range(n))


@dataclass
class RunningServer:
    app: object
    base_url: str
    store: ChunkStore
    model: object
    tokenizer: object

    def client(self, api_key: str = "unused", **kw) -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def async_client(self, api_key: str = "unused") -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=120)

    @property
    def queue(self):
        return self.app.state.queue

    def wait_until(self, condition, what: str, timeout: float = 30.0) -> None:
        """Poll ``condition()`` (bounded); fail the test when it never holds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.01)


@contextlib.contextmanager
def serve(model, tokenizer, store: ChunkStore | None = None, **settings) -> Iterator[RunningServer]:
    """Run the app with uvicorn on 127.0.0.1 in a background thread; stop it and disable reuse after."""
    store = store if store is not None else ChunkStore(max_bytes=50_000_000, chunk_size=16)  # an empty store is falsy
    settings.setdefault("model_name", MODEL_NAME)
    app = create_app(model, tokenizer, store, ServerSettings(**settings))
    running = serve_in_background(app, startup_timeout=STARTUP_TIMEOUT_S)
    try:
        yield RunningServer(app, running.url, store, model, tokenizer)
    finally:
        running.stop(timeout=STARTUP_TIMEOUT_S)
        disable_chunk_reuse(model)


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[RunningServer]:
    """A server on a tiny Llama (context 512) shared by a test module."""
    with serve(make_tiny("llama", seed=3), tiny_tokenizer()) as running:
        yield running


@pytest.fixture(scope="module")
def gemma_server(gemma) -> Iterator[RunningServer]:
    """A server on the real embedded Gemma-3-270M, served as ``gemma``, shared by a test module."""
    model, tokenizer = gemma
    with serve(model, tokenizer, ChunkStore(max_bytes=400_000_000, chunk_size=32), model_name="gemma") as running:
        yield running


def save_tiny_model(directory, seed: int) -> None:
    """A tiny Llama and the word tokenizer (with chat template) saved as a checkpoint ``--model`` can load."""
    make_tiny("llama", seed=seed).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)


@contextlib.contextmanager
def server_process(model_dir, *flags: str, startup_s: float = 120.0) -> Iterator[str]:
    """``python -m kvboost_hf.server --model MODEL_DIR FLAGS`` on a free port; yields its base URL, stops it after."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    root = Path(__file__).resolve().parents[2]
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvboost_hf.server", "--model", str(model_dir), "--served-model-name", MODEL_NAME,
         "--port", str(port), "--log-level", "warning", *flags],
        cwd=model_dir, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def all_at_once(call, n: int, timeout_s: float = 180) -> dict:
    """``{i: call(i)}`` for ``i < n``, every call on its own thread, started together (a burst of clients)."""
    results: dict = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, call(i))) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(thread.is_alive() for thread in threads), f"a call did not return within {timeout_s} s"
    return results  # a call that raised fails the test (setup.cfg: thread exceptions)


class BurstGate:
    """Holds the batch scheduler's first step after a submission until ``burst`` requests are queued, so a burst
    sent together is decided on together however loaded the machine is. As the model's forward pre-hook it also
    holds the first forward and slows every forward a little, so rows that start in later steps still overlap.
    (Holding the forward alone let a loaded run admit the first request alone and the rest only after its prefill
    was published.) Make it after any request that is not part of the burst."""

    def __init__(self, burst: int, monkeypatch) -> None:
        self.burst, self.queued, self.all_queued, lock = burst, 0, threading.Event(), threading.Lock()
        submit = BatchingQueue.submit

        def counted(queue, job):
            submit(queue, job)
            with lock:
                self.queued += 1
                if self.queued >= self.burst:
                    self.all_queued.set()

        monkeypatch.setattr(BatchingQueue, "submit", counted)
        step = BatchingQueue._step

        def gated(queue):  # the scheduler's first decision after a submission sees the whole burst queued
            if self.queued:
                assert self.all_queued.wait(60), f"only {self.queued} of {self.burst} requests were queued"
            step(queue)

        monkeypatch.setattr(BatchingQueue, "_step", gated)

    def __call__(self, *_) -> None:
        if self.queued:  # forwards before any request (a server's start-up) pass
            assert self.all_queued.wait(60), f"only {self.queued} of {self.burst} requests were queued"
        time.sleep(0.01)
