"""``kvboost-hf serve --ray`` on a local Ray with 2 CPUs: two replicas of the real Gemma-3-270M keep a chat
together and reply as one process; on a tiny model, the same app as one process (routes, errors, auth,
streams), exact prefix routing keeps a conversation on the replica that holds it, tenants' keys route
apart, a replica killed mid-stream gives a clean error and comes back, and stopping drains a running
stream. One file: its tests run one Ray application at a time, on one pytest-xdist worker."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from kvboost_hf.cli import build_parser
from kvboost_hf.cluster.metrics import PUSH_PERIOD_S
from tests.cluster.conftest_ray import kill_replica, ray_server, replicas
from tests.server.conftest import cycle_words, save_tiny_model, serve

# ---------------------------------------------------------------- the real Gemma-3-270M: first, before the
# tiny model's module-scoped application starts (one Ray application at a time)
TURNS = ["Name three rivers in Europe.", "Which of them is the longest?", "And which country is it in?"]


def gemma_chat(base_url: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "gemma", "messages": messages, "max_tokens": 12, "temperature": 0}
    reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply


def test_two_gemma_replicas_keep_a_chat_together_and_reply_as_one_process(gemma):
    from kvboost_hf.store import ChunkStore

    replies, served_by, cached = [], [], []
    with ray_server("--replicas", "2", "--served-model-name", "gemma", "--chunk-size", "32",
                    "--max-cache-bytes", "400MB") as cluster:
        messages: list[dict] = []
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            reply = gemma_chat(cluster.url, messages)
            content = reply.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": content})
            replies.append(content)
            served_by.append(reply.headers["x-kvboost-replica"])
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(1.2)  # a routing-stats period: the replica has reported the turn
    assert len(set(served_by)) == 1, served_by
    assert all(c > 0 for c in cached[1:]), cached
    model, tokenizer = gemma
    with serve(model, tokenizer, ChunkStore(max_bytes=400_000_000, chunk_size=32), model_name="gemma") as local:
        messages = []
        for turn, expected in zip(TURNS, replies):
            messages.append({"role": "user", "content": turn})
            reply = gemma_chat(local.base_url, messages)
            assert reply.json()["choices"][0]["message"]["content"] == expected
            messages.append({"role": "assistant", "content": expected})


# ---------------------------------------------------------------- a tiny model's application
KEYS = {"key-alice": {"tenant": "alice"}, "key-bob": {"tenant": "bob"}, "key-admin": {"tenant": "ops", "admin": True}}
FLAGS = ("--chunk-size", "8", "--max-cache-bytes", "64MB")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-model")
    save_tiny_model(path, seed=11)
    keys = path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    return path


@pytest.fixture(scope="module")
def redis_url():
    from tests.conftest import start_redis

    process, url = start_redis()
    yield url
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def cluster(model_dir, redis_url):
    with ray_server("--replicas", "2", "--model", str(model_dir), "--api-keys", str(model_dir / "keys.json"),
                    "--remote-store", redis_url, "--remote-prefix", "ray-test", *FLAGS) as server:
        yield server


@pytest.fixture(scope="module")
def one_process(model_dir):
    from kvboost_hf.server.launch import build_app

    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--api-keys", str(model_dir / "keys.json"),
                                      *FLAGS])
    with TestClient(build_app(args)) as client:
        yield client


def timeless(value):
    """``value`` without what differs per call: ids and times."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [timeless(v) for v in value]
    return value


def comparable(response) -> tuple:
    """Status, media type and body of a response, without what differs per call (ids, times)."""
    kind = response.headers.get("content-type", "").split(";")[0]
    if kind == "application/json":
        body = timeless(response.json())
    elif kind == "text/event-stream":
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        body = [e if e == "[DONE]" else timeless(json.loads(e)) for e in events]
    else:
        body = response.text
    return response.status_code, kind, body


CHAT = {"model": "m", "messages": [{"role": "user", "content": cycle_words(30)}], "max_tokens": 6, "temperature": 0}
CASES = [
    ("POST", "/v1/completions", {"model": "m", "prompt": cycle_words(40), "max_tokens": 6, "temperature": 0}, "key-alice"),
    ("POST", "/v1/chat/completions", CHAT, "key-alice"),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, "key-bob"),
    ("POST", "/v1/completions", {"model": "m", "prompt": "w1 w2", "max_tokens": 2}, None),  # 401
    ("POST", "/v1/completions", {"model": "m", "prompt": "w1 w2", "max_tokens": -1}, "key-alice"),  # 400
    ("POST", "/v1/completions", {"model": "m", "prompt": "w1", "cache_salt": "a\x01b"}, "key-alice"),  # 400
    ("POST", "/v1/completions", {"model": "m", "prompt": "w1"}, "not-a-key"),  # 401
    ("POST", "/v1/warm", {"text": cycle_words(20), "shared": True}, "key-bob"),  # 403: not an admin
    ("GET", "/v1/models", None, "key-alice"),
    ("GET", "/v1/nothing", None, "key-alice"),
    ("GET", "/health", None, None),
    ("POST", "/tokenize", {"model": "m", "prompt": "w1 w2 w3"}, "key-alice"),
]


def merged_samples(url: str, name: str) -> tuple[list, set[str]]:
    """The samples called ``name`` in the merged ``/metrics``, and the replicas its header names."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(url + "/metrics", timeout=60)
    assert reply.status_code == 200
    samples = [s for f in text_string_to_metric_families(reply.text) for s in f.samples if s.name == name]
    return samples, set(reply.headers["x-kvboost-replica"].split(","))


def merged_metric(url: str, name: str) -> dict[str, float]:
    """One sample's value per replica in the merged ``/metrics``."""
    return {s.labels["replica"]: s.value for s in merged_samples(url, name)[0]}


def requests_served(url: str, replicas_expected: int) -> tuple[float, set[str]]:
    """The merged ``/metrics``' ``kvboost_requests_total`` over every replica, and the replicas it names
    (waits until ``replicas_expected`` replicas have pushed)."""
    deadline = time.monotonic() + 30
    while True:
        samples, header = merged_samples(url, "kvboost_requests_total")
        named = {s.labels["replica"] for s in samples}
        if len(named) >= replicas_expected or time.monotonic() > deadline:
            assert header >= named
            return sum(s.value for s in samples), named
        time.sleep(0.5)


def test_every_route_answers_as_in_one_process(cluster, one_process, model_dir):
    before, _ = requests_served(cluster.url, 0)  # no replica has counted a request yet: may be (0, set())
    for method, path, body, key in CASES:
        body = json.loads(json.dumps(body).replace('"m"', json.dumps(str(model_dir)))) if body else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        ray_reply = httpx.request(method, cluster.url + path, json=body, headers=headers, timeout=120)
        local = one_process.request(method, path, json=body, headers=headers)
        assert comparable(ray_reply) == comparable(local), (method, path)
        assert ray_reply.headers["x-kvboost-replica"] in replicas()  # every response names its replica
    # /metrics answers for the whole application: each replica's samples, labelled with its id
    deadline = time.monotonic() + 30
    while (merged := requests_served(cluster.url, 2))[0] - before < len(CASES) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert merged == (before + len(CASES), set(replicas()))


def conversation(server, model: str, key: str, topic: int, turns: int) -> list[tuple[str, int]]:
    """``turns`` chat turns growing one history; (replica, cached tokens) of each."""
    messages, seen = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": cycle_words(24, start=topic * 100 + turn * 7)})
        reply = server.post("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 4,
                                                     "temperature": 0}, key=key)
        assert reply.status_code == 200, reply.text
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
        seen.append((reply.headers["x-kvboost-replica"], reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        time.sleep(1.2)  # past a routing-stats period: the replica has reported the turn's chunks
    return seen


def test_a_conversation_stays_on_the_replica_that_holds_it(cluster, model_dir):
    for topic in range(4):
        seen = conversation(cluster, str(model_dir), "key-alice", topic, turns=3)
        holders = {replica for replica, _ in seen}
        assert len(holders) == 1, seen  # every follow-up went where its history is
        assert all(cached > 0 for _, cached in seen[1:]), seen


def test_another_tenants_prompt_is_routed_without_its_keys(cluster, model_dir):
    """Bob sends alice's exact conversation: the router computes his keys under his root, so it finds no
    holder (no hint of where alice's prefix lives) and the replica serves him nothing of hers."""
    # Bob's own first turns on new topics: what he can have cached is his template's tokens (a count that depends on
    # the replica each turn lands on and what ran before, so the bound is the most either of two such turns got).
    own = [conversation(cluster, str(model_dir), "key-bob", topic, turns=1)[0][1] for topic in (42, 41)]
    seen = conversation(cluster, str(model_dir), "key-alice", 40, turns=2)
    bob = conversation(cluster, str(model_dir), "key-bob", 40, turns=1)
    assert bob[0][1] <= max(own) < seen[1][1], (own, seen, bob)  # none of alice's 24 words or her history


def test_a_replica_killed_mid_stream_ends_the_stream_cleanly_and_comes_back(cluster, model_dir):
    body = {"model": str(model_dir), "prompt": cycle_words(20, start=500), "max_tokens": 450, "ignore_eos": True,
            "stream": True, "temperature": 0}
    events, started = [], time.monotonic()
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body,
                      headers={"Authorization": "Bearer key-alice"}, timeout=60) as stream:
        assert stream.status_code == 200
        victim = stream.headers["x-kvboost-replica"]
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    kill_replica(victim)
    assert time.monotonic() - started < 60  # no hang
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    for _ in range(6):  # meanwhile every request is served by the survivor (or a retry), none fails
        ok = cluster.post("/v1/completions", {"model": str(model_dir), "prompt": cycle_words(12), "max_tokens": 2},
                          key="key-alice")
        assert ok.status_code == 200, ok.text
    deadline = time.monotonic() + 120
    while (len(replicas()) < 2 or victim in replicas()) and time.monotonic() < deadline:
        time.sleep(1)
    assert len(replicas()) == 2 and victim not in replicas()  # Ray started a new replica


def two_turns(server, model: str, key: str, between=lambda: None) -> list[dict]:
    """A two-turn chat (``between`` runs between the turns): each turn's reply text and cached tokens."""
    messages, seen = [], []
    for turn in range(2):
        if turn:
            between()
        messages.append({"role": "user", "content": cycle_words(40, start=3000 + turn * 50)})
        reply = server.post("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 5,
                                                     "temperature": 0}, key=key)
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": text})
        seen.append({"text": text, "cached": reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]})
    return seen


def test_replicas_restarted_between_two_turns_warm_the_history_from_redis(cluster, model_dir, redis_url):
    """Bob's chat runs on live replicas; alice's same chat (under her own keys) has every replica killed
    and restarted between its turns: her second turn reads her history from Redis, as much of it as
    bob's second turn found in RAM, and replies the same."""
    control = two_turns(cluster, str(model_dir), "key-bob")

    def restart_every_replica() -> None:
        import redis

        client = redis.Redis.from_url(redis_url)
        deadline, seen, settled = time.monotonic() + 30, -1, False  # the write-behind queues have reached Redis
        while not settled and time.monotonic() < deadline:
            time.sleep(2 * PUSH_PERIOD_S)  # a push taken after the turn: its pending count is current
            blobs = len(client.keys("ray-test:kv:*"))
            pending = merged_metric(cluster.url, "kvboost_remote_pending_writes")
            settled = blobs == seen and set(pending) == set(replicas()) and not any(pending.values())
            seen = blobs
        assert settled, f"the replicas' writes to Redis did not settle: {seen} blobs, pending {pending}"
        before = set(replicas())
        for replica in before:
            kill_replica(replica)
        deadline = time.monotonic() + 120
        while (len(replicas()) < 2 or set(replicas()) & before) and time.monotonic() < deadline:
            time.sleep(1)
        assert len(replicas()) == 2 and not set(replicas()) & before

    restarted = two_turns(cluster, str(model_dir), "key-alice", between=restart_every_replica)
    assert [t["text"] for t in restarted] == [t["text"] for t in control]
    # the new replicas' RAM is empty: every cached token of the second turn came from Redis
    assert restarted[1]["cached"] == control[1]["cached"] > restarted[0]["cached"]
    new = set(replicas())  # the killed replicas linger in /metrics until they go stale: count the new ones'
    deadline = time.monotonic() + 30
    while not (hits := sum(v for r, v in merged_metric(cluster.url, "kvboost_remote_hits_total").items() if r in new)) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert hits >= restarted[1]["cached"] // 8  # chunks of 8 tokens, read from Redis by the new replicas


def test_stopping_drains_a_running_stream(cluster, model_dir):
    """Last in this module: it stops the application."""
    body = {"model": str(model_dir), "prompt": cycle_words(20, start=900), "max_tokens": 300, "ignore_eos": True,
            "stream": True, "temperature": 0}
    events = []
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body,
                      headers={"Authorization": "Bearer key-alice"}, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    threading.Thread(target=cluster.stop.set).start()
    assert events[-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-1] if json.loads(e).get("choices")]
    assert finish[-1] == "length"
    cluster.thread.join(120)
    assert not cluster.thread.is_alive()
