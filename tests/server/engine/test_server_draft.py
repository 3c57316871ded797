"""``--draft``: greedy replies identical with and without a draft; speculation counters on /v1/stats and /metrics."""

from __future__ import annotations

import argparse

import httpx
import pytest

from kvboost_hf import ControllerSettings
from kvboost_hf.cli import main
from kvboost_hf.server.command import add_serve_arguments
from kvboost_hf.server.engine.speculation import attach_speculation, build_draft
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, cycle_words, save_tiny_model, serve, server_process, tiny_tokenizer

PROMPTS = [cycle_words(30, start=3) + " " + cycle_words(12, start=3), cycle_words(25, start=40)]


def _replies(running, temperature=0.0) -> list[str]:
    client = running.client()
    out = []
    for prompt in PROMPTS + PROMPTS:  # the second pass is warm: prompts and replies are in the store
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=temperature,
                                             seed=5)
        out.append(response.choices[0].text)
    return out


@pytest.mark.parametrize("spec", ["int8", "int4", "head", "store", "prompt-lookup"])
def test_greedy_replies_identical_with_and_without_draft(spec):
    model, tokenizer = make_tiny("qwen2", seed=6), tiny_tokenizer()
    with serve(model, tokenizer) as running:
        plain = _replies(running)
    # The adaptive controller decides from measured times; "store" drafts every round so that the
    # acceptance check below does not depend on the machine's load.
    settings = ControllerSettings(adaptive=False, max_tokens=4) if spec == "store" else None
    with serve(model, tokenizer) as running:
        attach_speculation(running.app, model, build_draft(spec, model, tokenizer), settings)
        assert _replies(running) == plain
        sampled = _replies(running, temperature=0.8)  # sampling requests go through the draft too
        assert all(isinstance(text, str) for text in sampled)
        stats = httpx.get(f"{running.base_url}/v1/stats").json()["speculation"]
        assert stats["requests"] == 8 and stats["rounds"] > 0
        assert stats["draft"] in (spec, f"{spec}-bf16", "head-int8") and stats["drafted_tokens"] > 0  # bf16: make_draft
        assert sum(stats["accepted_histogram"]) == stats["speculative_rounds"]
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert "kvboost_spec_requests_total 8.0" in metrics
        assert "kvboost_spec_acceptance_rate" in metrics
        if spec == "store":  # warm requests draft their whole reply from the store
            assert stats["accepted_tokens"] > 0


def test_bad_draft_flags_are_clear_errors(capsys, tmp_path):
    model, tokenizer = make_tiny("llama"), tiny_tokenizer()
    with pytest.raises(ValueError, match="--draft"):
        build_draft(str(tmp_path / "missing"), model, tokenizer)
    with pytest.raises(ValueError, match="--draft-vocab"):
        build_draft("store", model, tokenizer, vocab=10)
    with pytest.raises(ValueError, match="--draft-layers"):
        build_draft("head", model, tokenizer, layers=1)
    assert main(["serve", "--no-reuse", "--draft", "store"]) == 2
    assert "--draft needs reuse" in capsys.readouterr().err
    assert main(["serve", "--draft", "store", "--scheduler", "batch"]) == 2
    assert "--draft runs with --scheduler workers" in capsys.readouterr().err
    assert main(["serve", "--draft", "head", "--draft-layers", "2"]) == 2
    assert "--draft-layers shapes a self-draft" in capsys.readouterr().err
    assert main(["serve", "--draft", "store", "--draft-vocab", "100"]) == 2
    assert "--draft-vocab shapes a draft's head" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--draft", "int4", "--draft-vocab", "100", "--draft-layers", "2"])
    assert (args.draft, args.draft_vocab, args.draft_layers) == ("int4", 100, 2)


def test_serve_command_with_draft(tmp_path):
    """The real command with ``--draft int8``: same greedy reply as a server without it."""
    model_dir = tmp_path / "tiny-llama"
    save_tiny_model(model_dir, seed=15)
    prompt = cycle_words(20, start=9) + " " + cycle_words(8, start=9)
    replies = []
    for flags in ((), ("--draft", "int8", "--draft-layers", "1")):
        with server_process(model_dir, "--chunk-size", "16", *flags) as base:
            body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0)
            replies.append(httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
            stats = httpx.get(f"{base}/v1/stats", timeout=10).json()
            assert ("speculation" in stats) == bool(flags)
            assert stats["queue"]["scheduler"] == ("workers" if flags else "batch")  # --draft picks workers
    assert replies[0] == replies[1] and replies[0]


def test_a_head_draft_takes_a_16k_head_where_the_vocabulary_is_larger():
    """Without --draft-vocab, --draft head restricts its head to the 16,384 most frequent tokens where the model has
    more (the full head is read at every drafted token); --draft-vocab still decides, and a small vocabulary stays
    whole."""
    tokenizer = tiny_tokenizer()
    large = make_tiny("llama", vocab_size=20000)
    assert build_draft("head", large, tokenizer).draft_name == "head-int8-vocab16384"
    assert build_draft("head", large, tokenizer, vocab=1000).draft_name == "head-int8-vocab1000"
    assert build_draft("head", make_tiny("llama"), tokenizer).draft_name == "head-int8"
