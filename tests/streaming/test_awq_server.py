"""``kvboost-hf serve --awq-streaming``: flags, loading, and the counters on /v1/stats and /metrics."""

from __future__ import annotations

import argparse
import shutil

import httpx
import pytest

from kvboost_hf.server.command import ServeError, add_serve_arguments
from kvboost_hf.server.launch import load_served_model
from kvboost_hf.streaming import is_streaming_model
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def awq_dir(tiny_awq, tmp_path):
    path = tmp_path / "tiny-awq"
    shutil.copytree(tiny_awq["llama"][1], path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_flags_load_a_streamed_model(awq_dir):
    args = parse("--model", str(awq_dir), "--awq-streaming", "partial_resident", "--keep-first-k", "1",
                 "--keep-last-k", "2", "--staging-slots", "3", "--awq-host", "mmap")
    model, _ = load_served_model(args)
    config = model.config.quantization_config
    assert is_streaming_model(model)
    assert (config.residency_mode, config.keep_first_k, config.keep_last_k, config.n_staging_slots, config.host) == (
        "partial_resident", 1, 2, 3, "mmap")
    assert config.kernel == "auto"
    torch_model, _ = load_served_model(parse("--model", str(awq_dir), "--awq-streaming", "full_resident",
                                             "--awq-kernel", "torch"))
    assert {m.kernel.name for m in torch_model.modules() if hasattr(m, "kernel")} == {"torch"}


def test_bad_streaming_settings_are_serve_errors(awq_dir):
    with pytest.raises(ServeError, match="keep_first_k"):
        load_served_model(parse("--model", str(awq_dir), "--awq-streaming", "partial_resident",
                                "--keep-first-k", "4", "--keep-last-k", "4"))
    with pytest.raises(ServeError, match="n_staging_slots"):
        load_served_model(parse("--model", str(awq_dir), "--awq-streaming", "full_stream", "--staging-slots", "0"))
    with pytest.raises(ServeError, match="--model"):
        load_served_model(parse("--awq-streaming", "full_stream"))


def test_stats_and_metrics_carry_streaming_counters(awq_dir):
    model, tokenizer = load_served_model(parse("--model", str(awq_dir), "--awq-streaming", "full_stream"))
    tokenizer.chat_template = tiny_tokenizer().chat_template
    with serve(model, tokenizer) as running:
        client = running.client()
        client.completions.create(model=MODEL_NAME, prompt=cycle_words(20), max_tokens=3, temperature=0)
        stats = httpx.get(f"{running.base_url}/v1/stats").json()["streaming"]
        metrics = httpx.get(f"{running.base_url}/metrics").text
    assert stats["residency_mode"] == "full_stream" and stats["streamed_layers"] == 6
    assert stats["hits"] + stats["late"] + stats["misses"] >= 3 * 6
    assert stats["bytes_moved"] > 0
    for name in ("kvboost_awq_prefetch_hits_total", "kvboost_awq_prefetch_misses_total",
                 "kvboost_awq_bytes_moved_total",
                 "kvboost_awq_blocked_seconds_total", "kvboost_awq_prefetch_hit_rate"):
        assert name in metrics
