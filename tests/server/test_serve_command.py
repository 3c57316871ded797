"""``kvboost-hf serve`` / ``python -m kvboost_hf.server``: flags, store errors, start-up warming,
and the real command in a subprocess."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvboost_hf import ChunkStore, enable_chunk_reuse
from kvboost_hf.cli import main
from kvboost_hf.server import RECOMPUTE_STRATEGIES
from kvboost_hf.server.command import (
    ServeError,
    add_serve_arguments,
    available_cores,
    build_store,
    scheduler_of,
    worker_settings,
)
from kvboost_hf.server.launch import warm_texts
from tests.conftest import make_tiny, start_redis
from tests.server.conftest import MODEL_NAME, cycle_words, save_tiny_model, serve, server_process, tiny_tokenizer


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_store_refusing_its_settings_is_a_clear_cli_error(capsys):
    assert main(["serve", "--chunk-size", "0"]) == 2  # fails before any model is loaded
    err = capsys.readouterr().err
    assert "kvboost-hf serve: error: the chunk store refused its settings" in err and "chunk_size" in err


def test_store_gets_kv_bits_and_disk_path_only_when_set(tmp_path):
    plain = build_store(parse())
    assert plain.kv_bits is None and plain.stats()["bytes_by_tier"]["disk"] == 0
    quantized = build_store(parse("--kv-bits", "8", "--disk-path", str(tmp_path / "kv"), "--max-cache-bytes", "5000000",
                                  "--chunk-size", "32"))
    assert quantized.kv_bits == 8 and quantized.max_bytes == 5_000_000 and quantized.chunk_size == 32
    assert build_store(parse("--max-cache-bytes", "1.5GB")).max_bytes == 1_500_000_000  # sizes take units too
    with pytest.raises(ServeError, match="--max-cache-bytes -1: write a number and a unit"):
        build_store(parse("--max-cache-bytes", "-1"))


def test_flag_choices(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert RECOMPUTE_STRATEGIES == ("exact", "none", "selective", "cacheblend")
    assert parse().recompute_strategy == "exact"
    assert parse("--recompute-strategy", "cacheblend").recompute_strategy == "cacheblend"
    with pytest.raises(SystemExit):
        parse("--recompute-strategy", "magic")
    with pytest.raises(SystemExit):
        parse("--kv-bits", "2")
    args = parse()
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    cores = available_cores()
    assert scheduler_of(args) == "batch"  # continuous batching: one scheduler thread with every core
    assert scheduler_of(parse("--draft", "int4")) == "workers"  # speculation runs per request
    assert worker_settings(args, "cpu") == {"workers": 1, "torch_threads": cores}
    workers = parse("--scheduler", "workers")
    assert worker_settings(workers, "cpu") == {"workers": cores, "torch_threads": 1}
    one_worker = parse("--scheduler", "workers", "--workers", "1")
    assert worker_settings(one_worker, "cpu") == {"workers": 1, "torch_threads": cores}
    assert worker_settings(workers, "cuda") == {"workers": 1, "torch_threads": None}


def test_warm_file_in_blocks_then_requests_reuse_it(tmp_path, capsys):
    model, tokenizer = make_tiny("llama", seed=14), tiny_tokenizer()
    store = ChunkStore(max_bytes=50_000_000, chunk_size=16)
    enable_chunk_reuse(model, store)
    document = tmp_path / "handbook.txt"
    document.write_text(cycle_words(300, start=2))
    assert warm_texts(model, tokenizer, store, ["w7 w8 w9"], [str(document)], limit=512, block_tokens=64) == 303
    assert "warming" in capsys.readouterr().err  # the progress bar over the file's blocks
    with serve(model, tokenizer, store) as server:
        out = server.client().completions.create(model=MODEL_NAME, prompt=cycle_words(300, start=2) + " w50 w51",
                                                 max_tokens=2, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == 300
    with pytest.raises(ServeError, match="more than the prompt limit"):
        warm_texts(model, tokenizer, store, [], [str(document)], limit=100)
    with pytest.raises(ServeError, match="cannot read"):
        warm_texts(model, tokenizer, store, [], [str(tmp_path / "missing.txt")], limit=100)


def test_python_m_server_serves_a_saved_model(tmp_path):
    """The real command: a saved tiny model, start-up warming, the SDK, then the process is stopped."""
    model_dir = tmp_path / "tiny-llama"
    save_tiny_model(model_dir, seed=15)
    with server_process(model_dir, "--api-key", "k", "--chunk-size", "16", "--warm", cycle_words(40, start=9)) as base:
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=30)
        out = client.completions.create(model=MODEL_NAME, prompt=cycle_words(40, start=9) + " w60", max_tokens=2,
                                        temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == 40  # warmed at start-up


def test_omp_num_threads_sets_the_torch_threads(monkeypatch):
    from kvboost_hf.server.command import omp_threads

    cores = available_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 1))  # differs from every built-in default
    assert omp_threads() == cores + 1
    assert worker_settings(parse(), "cpu") == {"workers": 1, "torch_threads": cores + 1}
    assert worker_settings(parse("--scheduler", "workers"), "cpu") == {"workers": 1, "torch_threads": cores + 1}
    assert worker_settings(parse("--torch-threads", "1"), "cpu")["torch_threads"] == 1  # the flag wins
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")  # nested levels: the first is the intra-op count
    assert omp_threads() == 3


def test_serve_applies_omp_num_threads(monkeypatch):
    """The whole serve() path, with the model loader and uvicorn replaced: the app's settings carry the threads."""
    import uvicorn

    import kvboost_hf.server.launch as command

    ran = {}
    monkeypatch.setenv("OMP_NUM_THREADS", str(available_cores() + 1))
    monkeypatch.setattr(command, "load_served_model", lambda args: (make_tiny("llama", seed=5), tiny_tokenizer()))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(app=app, **kw))
    assert main(["serve", "--port", "8123", "--max-cache-bytes", "50MB", "--chunk-size", "16"]) == 0
    settings = ran["app"].state.settings
    assert settings.torch_threads == available_cores() + 1 and ran["port"] == 8123
    assert ran["app"].state.store.max_bytes == 50_000_000


def test_bad_omp_num_threads_is_one_line(monkeypatch, capsys):
    import uvicorn

    import kvboost_hf.server.launch as command

    def reached(*args, **kwargs):
        raise AssertionError("a bad OMP_NUM_THREADS got as far as loading the model")

    monkeypatch.setattr(command, "load_served_model", reached)
    monkeypatch.setattr(uvicorn, "run", reached)
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvboost-hf serve: error: OMP_NUM_THREADS=lots") and "\n" not in err


def test_docs_say_the_thread_default_the_help_says():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--torch-threads"))
    assert "OMP_NUM_THREADS" in row
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--torch-threads TORCH_THREADS torch intra-op threads per forward, process wide (default: " \
           "$OMP_NUM_THREADS when set;" in text


def test_stats_say_the_remote_tier_is_unavailable_while_redis_is_down():
    """Redis stops while the server is idle: /v1/stats and /metrics say so without any request
    touching the tier, and say it is back once Redis answers on its port again."""
    import subprocess

    import httpx

    proc, url = start_redis()
    port = url.rsplit(":", 1)[1].split("/")[0]
    store = ChunkStore(max_bytes=50_000_000, chunk_size=16, remote=url, remote_prefix="down")
    try:
        with serve(make_tiny("llama", seed=6), tiny_tokenizer(), store) as server:
            def remote():
                return httpx.get(f"{server.base_url}/v1/stats", timeout=5).json()["store"]["remote"]

            server.wait_until(lambda: remote()["available"] is True, "the first contact with Redis")
            proc.kill()
            proc.wait()
            server.wait_until(lambda: remote()["available"] is False, "stats to say Redis is down")
            down = remote()
            assert isinstance(down["last_error"], str) and down["last_error"]
            assert "kvboost_remote_available 0.0" in httpx.get(f"{server.base_url}/metrics").text
            proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", port, "--save", "",
                                     "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            server.wait_until(lambda: remote()["available"] is True, "stats to say Redis is back", timeout=90)
            assert remote()["last_error"] is None
    finally:
        proc.kill()
        proc.wait()


def test_a_served_cpu_model_is_put_on_huge_pages_with_its_values(tmp_path):
    from kvboost_hf.models.huge_pages import back_with_huge_pages
    from kvboost_hf.server.launch import load_served_model
    from tests.models.test_huge_pages import anon_huge_bytes

    saved = make_tiny("llama", seed=5, vocab_size=65536)  # a 16 MB embedding: frames to collapse
    saved.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, _ = load_served_model(parse("--model", str(tmp_path)))
    embedding = model.get_input_embeddings().weight
    assert torch.equal(embedding, saved.get_input_embeddings().weight)
    if back_with_huge_pages([torch.randn(8 << 18)]).collapsed:  # this host backs memory with THP
        assert anon_huge_bytes(embedding.data_ptr() + embedding.nbytes // 2) > 0


def test_a_model_whose_rope_follows_the_longest_row_is_served_by_workers(tmp_path):
    """A batched forward would rotate every row by the longest row's positions under dynamic NTK: such a model
    gets the workers scheduler by default, and an explicit --scheduler batch is a clear error."""
    from transformers import LlamaConfig

    from kvboost_hf.server.launch import _schedule_for_rope

    LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}).save_pretrained(tmp_path)
    args = parse("--model", str(tmp_path))
    _schedule_for_rope(args)
    assert scheduler_of(args) == "workers"
    with pytest.raises(ServeError, match="--scheduler workers"):
        _schedule_for_rope(parse("--model", str(tmp_path), "--scheduler", "batch"))
    LlamaConfig().save_pretrained(tmp_path)  # a fixed rotation per position: batched as before
    args = parse("--model", str(tmp_path))
    _schedule_for_rope(args)
    assert scheduler_of(args) == "batch"
