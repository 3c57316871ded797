"""Shared fixtures: tiny random models of each family, and the real Gemma-3-270M once per session."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvboost_hf import disable_chunk_reuse

VOCAB = 96
SLIDING_WINDOW = 16

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_tiny(family: str, seed: int = 0, num_layers: int = 2, vocab_size: int = VOCAB) -> torch.nn.Module:
    """A small random model of ``family`` (float32, eval mode, deterministic for ``seed``)."""
    torch.manual_seed(seed)
    common = dict(_COMMON, vocab_size=vocab_size)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=num_layers, **common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=num_layers, **common))
    elif family == "mistral":
        model = MistralForCausalLM(
            MistralConfig(num_hidden_layers=num_layers, sliding_window=SLIDING_WINDOW, **common)
        )
    elif family == "gemma3":
        layers = max(num_layers, 3)
        config = Gemma3TextConfig(
            num_hidden_layers=layers,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
            **common,
        )
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(family)
    model.generation_config.pad_token_id = 0
    return model.eval()


FAMILIES = ["llama", "qwen2", "mistral", "gemma3"]


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, torch.nn.Module]:
    return {family: make_tiny(family) for family in FAMILIES}


@pytest.fixture(params=FAMILIES)
def tiny(request, tiny_models):
    """One tiny model per family; reuse is always disabled again after the test."""
    model = tiny_models[request.param]
    disable_chunk_reuse(model)
    yield model
    disable_chunk_reuse(model)


def random_ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


@pytest.fixture(scope="session")
def gemma():
    """The real embedded Gemma-3-270M and its tokenizer, loaded once."""
    from kvboost_hf.models import load_default_model

    model, tokenizer = load_default_model()
    return model, tokenizer


@pytest.fixture(scope="session")
def gemma_awq(gemma, tmp_path_factory):
    """The embedded Gemma-3-270M packed by awq-pack's code (round-to-nearest, group size 128)."""
    from kvboost_hf.streaming.pack import pack_model

    model, tokenizer = gemma
    path = tmp_path_factory.mktemp("awq-gemma")
    pack_model(model, path, group_size=128, tokenizer=tokenizer)
    return path


@pytest.fixture
def gemma_model(gemma):
    model, tokenizer = gemma
    disable_chunk_reuse(model)
    yield model, tokenizer
    disable_chunk_reuse(model)


def make_tiny_tokenizer():
    """A word-level tokenizer for the tiny models: ``<pad>``, ``<bos>``, ``<eos>``, then ``w3``..``w95``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def words(ids: torch.Tensor) -> str:
    return " ".join(f"w{int(i)}" for i in ids.reshape(-1))


LANGUAGE_MODELS = FAMILIES + ["gemma-270m"]


@pytest.fixture(params=LANGUAGE_MODELS)
def lm(request, tiny_models):
    """``(model, tokenizer, texts)``: each tiny family with a word tokenizer, and the real Gemma.

    ``texts`` are three prompts: a base, one sharing a long prefix with it, and a third
    sharing the same prefix.
    """
    if request.param == "gemma-270m":
        model, tokenizer = request.getfixturevalue("gemma")
        prefix = (
            "The lighthouse keeper wrote in his log every evening. He noted the wind, the colour of the "
            "sea, the ships that passed and the birds that rested on the gallery rail. Over forty years "
            "the log grew to sixty volumes, and the harbour museum keeps them now in a glass case."
        )
        texts = [prefix + " In the first volume", prefix + " The museum's curator said", prefix + " Visitors often ask"]
    else:
        model, tokenizer = tiny_models[request.param], make_tiny_tokenizer()
        prefix = words(random_ids(40, 500))
        texts = [prefix + " " + words(random_ids(12, 500 + k)) for k in range(1, 4)]
    disable_chunk_reuse(model)
    yield model, tokenizer, texts
    disable_chunk_reuse(model)


# ---------------------------------------------------------------------- a real Redis server
def start_redis(password: str | None = None):
    """A real ``redis-server`` on a free loopback port (no persistence); returns ``(process, url)``.

    The Makefile installs the server (Debian's ``redis-server``); a missing binary fails loudly.
    """
    import shutil
    import socket
    import subprocess
    import time

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `make install` (it apt-get installs redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
    return proc, url


@pytest.fixture(scope="session")
def redis_url():
    """URL of a Redis server shared by the session (tests use distinct key prefixes)."""
    proc, url = start_redis()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


# ---------------------------------------------------------------- running on two pytest-xdist workers
# `make test` runs the suite on two workers (pytest -n 2 --dist loadfile): a file's tests stay together (its
# module fixtures are set up once; every test that starts Ray is in tests/cluster/test_ray_serve.py, so one
# local Ray application runs at a time). Each worker computes on one torch thread: two workers of two threads
# each would oversubscribe the two cores CI has.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """``count`` torch threads inside the block, the count before it after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def two_threads():
    """Two torch threads for the test (the kernels' column split between threads), whatever the worker's count."""
    with torch_threads(2):
        yield
