"""Limits and errors: each one answers with an OpenAI error body and the server keeps serving."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer, words


def assert_serves(server, api_key: str = "unused") -> None:
    """A normal request still works."""
    out = server.client(api_key=api_key).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": words(11, 12)}], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3


def assert_error_body(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


class Gate:
    """A forward pre-hook that holds every forward of ``model`` until ``open()`` (bounded wait)."""

    def __init__(self, model, max_wait_s: float = 30.0) -> None:
        self.event = threading.Event()
        self.forwards = 0
        self.max_wait_s = max_wait_s
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.forwards += 1
        self.event.wait(self.max_wait_s)

    def open(self) -> None:
        self.event.set()

    def remove(self) -> None:
        self.event.set()
        self.handle.remove()


@pytest.fixture(scope="module")
def error_server():
    with serve(make_tiny("qwen2", seed=4), tiny_tokenizer(), max_prompt_tokens=100) as running:
        yield running


def test_malformed_json_is_400(error_server):
    response = httpx.post(f"{error_server.base_url}/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                          headers={"content-type": "application/json"}, timeout=10)
    error = assert_error_body(response, 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"
    assert_serves(error_server)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"temperature": 3.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true (a cross-field check names its field)
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "w5"}]}, "messages.0.role"),
        ({"stop": ["w5"] * 17}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"model": None}, "model"),
    ],
)
def test_bad_parameters_are_400_with_the_param(error_server, change, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}], **change}
    response = httpx.post(f"{error_server.base_url}/v1/chat/completions", json=body, timeout=10)
    error = assert_error_body(response, 400)
    assert error["param"] == param
    assert not error["message"].startswith("Value error")  # pydantic's prefix is stripped


def test_sdk_sees_bad_request_and_server_keeps_serving(error_server):
    client = error_server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "w5"}], n=40)
    assert err.value.status_code == 400 and err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="w5", max_tokens=600)  # beyond the 512-token context
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=[5, 96], max_tokens=2)  # id outside the vocabulary
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="", max_tokens=2)  # the word tokenizer adds no BOS
    assert err.value.body["code"] == "empty_prompt"
    assert_serves(error_server)


def test_prompt_over_max_prompt_tokens_is_413_before_it_runs(error_server):
    client = error_server.client()
    completed = error_server.queue.completed
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL_NAME, prompt=cycle_words(101), max_tokens=2)
    assert err.value.status_code == 413
    assert "101" in err.value.message and "100" in err.value.message
    assert err.value.body["code"] == "context_length_exceeded"
    assert error_server.queue.completed == completed  # refused before it was queued
    ok = client.completions.create(model=MODEL_NAME, prompt=cycle_words(100), max_tokens=2, temperature=0)
    assert ok.usage.prompt_tokens == 100
    assert_serves(error_server)


def test_prompt_over_the_model_context_is_413():
    with serve(make_tiny("llama", seed=6), tiny_tokenizer()) as server:  # no --max-prompt-tokens: context 512
        client = server.client()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": cycle_words(600)}])
        assert err.value.status_code == 413
        assert "603" in err.value.message and "512" in err.value.message  # <bos>, role word, 600 words, w5
        assert server.queue.completed == 0
        assert_serves(server)


def test_api_key_required_on_v1_routes():
    with serve(make_tiny("llama", seed=7), tiny_tokenizer(), api_key="s3cret") as server:
        for key in ("wrong", "s3cre"):
            with pytest.raises(openai.AuthenticationError) as err:
                server.client(api_key=key).models.list()
            assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        missing = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL_NAME}, timeout=10)
        assert assert_error_body(missing, 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{server.base_url}/v1/stats", timeout=10).status_code == 401
        basic = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Basic s3cret"}, timeout=10)
        assert basic.status_code == 401
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200  # probes need no key
        assert [m.id for m in server.client(api_key="s3cret").models.list().data] == [MODEL_NAME]
        assert_serves(server, api_key="s3cret")


def test_full_queue_is_503_with_retry_after():
    model = make_tiny("llama", seed=8)
    with serve(model, tiny_tokenizer(), max_queue=1, workers=1) as server:
        gate = Gate(model)
        results = {}

        def send(name):
            results[name] = server.client().chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": words(20 + len(results))}], max_tokens=2,
                temperature=0,
            )

        try:
            running = threading.Thread(target=send, args=("running",))
            running.start()
            server.wait_until(lambda: server.queue.running == 1, "the first request to run")
            waiting = threading.Thread(target=send, args=("waiting",))
            waiting.start()
            server.wait_until(lambda: server.queue.waiting == 1, "the second request to queue")
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
            response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=10)
            error = assert_error_body(response, 503)
            assert error["code"] == "queue_full"
            assert int(response.headers["retry-after"]) >= 1
        finally:
            gate.remove()
        running.join(30)
        waiting.join(30)
        assert results["running"].choices[0].finish_reason and results["waiting"].choices[0].finish_reason
        assert_serves(server)
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
        assert stats["requests"]["rejected"] == 1


def test_request_timeout_is_504_and_the_generation_is_cancelled():
    model = make_tiny("llama", seed=9)
    with serve(model, tiny_tokenizer(), request_timeout=2.0, workers=1) as server:
        gate = Gate(model)
        try:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 50,
                    "ignore_eos": True}
            response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
            error = assert_error_body(response, 504)
            assert error["code"] == "timeout"
        finally:
            gate.remove()
        # The timed-out generation stops at its next step instead of running to max_tokens.
        server.wait_until(lambda: server.queue.depth == 0, "the cancelled generation to stop")
        assert gate.forwards < 50
        assert_serves(server)
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
        assert stats["requests"]["timed_out"] == 1


def test_client_disconnect_mid_stream_cancels_generation():
    model = make_tiny("llama", seed=10)
    with serve(model, tiny_tokenizer(), workers=1) as server:
        forwards = []

        def slow_forward(module, args):  # 20 ms a step: 400 tokens would take 8 s
            forwards.append(1)
            time.sleep(0.02)

        handle = model.register_forward_pre_hook(slow_forward)
        try:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True, "temperature": 0}
            with httpx.Client(timeout=30) as http:
                with http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    lines = response.iter_lines()
                    received = [next(lines) for _ in range(3)]  # role chunk, then tokens are flowing
            assert all(line.startswith("data: ") or line == "" for line in received)
            server.wait_until(lambda: server.queue.depth == 0, "the generation to be cancelled")
        finally:
            handle.remove()
        assert len(forwards) < 400
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
        assert stats["requests"]["cancelled"] == 1
        assert_serves(server)


def test_warm_refused_when_reuse_is_off_and_unknown_route_is_404():
    with serve(make_tiny("llama", seed=12), tiny_tokenizer(), reuse=False) as server:
        response = httpx.post(f"{server.base_url}/v1/warm", json={"text": "w5 w6"}, timeout=10)
        assert assert_error_body(response, 400)["code"] == "reuse_disabled"
        assert assert_error_body(httpx.get(f"{server.base_url}/v1/nothing", timeout=10), 404)["code"] == "not_found"
        out = server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "w5"}],
                                                       max_tokens=2)
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert_serves(server)


def test_client_giving_up_on_a_non_streamed_request_cancels_it():
    model = make_tiny("llama", seed=16)
    with serve(model, tiny_tokenizer(), workers=1) as server:
        gate = Gate(model)
        try:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 50,
                    "ignore_eos": True}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=0.5)
            server.wait_until(lambda: server.app.state.metrics.snapshot()["requests"].get("cancelled") == 1,
                              "the server to notice the client left")
        finally:
            gate.remove()
        server.wait_until(lambda: server.queue.depth == 0, "the cancelled generation to stop")
        assert gate.forwards < 50
        assert_serves(server)
