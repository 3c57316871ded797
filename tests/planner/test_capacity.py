"""The capacity model's properties, its agreement with the real store, and ``kvboost-hf plan``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig

from kvboost_hf import ChunkStore, warm
from kvboost_hf.cli import main
from kvboost_hf.models.shape import stored_bytes_per_token
from kvboost_hf.planner import ModelShape, capacity, kv_bytes_per_sequence, kv_bytes_per_token, weight_bytes
from kvboost_hf.planner.capacity import checkpoint_weight_bytes, estimated_parameters
from kvboost_hf.planner.probe import parse_bytes
from tests.conftest import make_tiny, random_ids

BASE = ModelShape(num_layers=8, num_kv_heads=4, head_dim=64, hidden_size=512, intermediate_size=1024,
                  vocab_size=1000, num_attention_heads=8, dtype_bytes=2)


def per_token(shape: ModelShape) -> int:
    return sum(kv_bytes_per_token(shape).values())


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
def test_kv_bytes_scale_linearly(field):
    doubled = dataclasses.replace(BASE, **{field: 2 * getattr(BASE, field)})
    assert per_token(doubled) == 2 * per_token(BASE)
    assert kv_bytes_per_sequence(doubled, 300) == 2 * kv_bytes_per_sequence(BASE, 300)
    assert kv_bytes_per_sequence(BASE, 600) == 2 * kv_bytes_per_sequence(BASE, 300)


def test_grouped_query_attention_divides_kv():
    mha = ModelShape.from_config(LlamaConfig(num_attention_heads=8, num_key_value_heads=8, hidden_size=512,
                                             num_hidden_layers=4))
    gqa = ModelShape.from_config(LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=512,
                                             num_hidden_layers=4))
    assert per_token(mha) == 4 * per_token(gqa)
    assert per_token(gqa) == 2 * 2 * 64 * 4 * 4  # K and V, 2 heads, head_dim 64, 4 layers, fp32


def test_sliding_window_caps_its_layers():
    mistral = ModelShape.from_config(MistralConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                                   num_key_value_heads=2, sliding_window=16))
    assert kv_bytes_per_sequence(mistral, 1000) == kv_bytes_per_sequence(mistral, 16) == 16 * per_token(mistral)
    hybrid = ModelShape.from_config(Gemma3TextConfig(
        num_hidden_layers=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        sliding_window=512, layer_types=["sliding_attention"] * 5 + ["full_attention"]))
    full, sliding = kv_bytes_per_token(hybrid)["full"], kv_bytes_per_token(hybrid)["sliding"]
    assert sliding == 5 * full
    assert kv_bytes_per_sequence(hybrid, 4096) == full * 4096 + sliding * 512


def test_weights_that_fit_but_leave_no_room_cannot_serve():
    weights = weight_bytes(BASE)
    report = capacity(BASE, memory_bytes=int(weights / 0.9) + 1000, context=4096, bandwidth_gb_s=10)
    assert not report.can_serve and report.max_sequences == 0
    roomy = capacity(BASE, memory_bytes=weights * 4, context=4096, bandwidth_gb_s=10)
    assert roomy.can_serve
    assert roomy.max_sequences == roomy.kv_pool_bytes // kv_bytes_per_sequence(BASE, 4096)
    one, many = roomy.decode_tok_s_one_sequence, roomy.decode_tok_s_per_sequence_at_max
    assert one > many and roomy.decode_tok_s_aggregate_at_max > one  # batching trades per-stream speed for throughput


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_weight_estimate_and_stored_bytes_match_the_real_model_and_store(family, tmp_path):
    model = make_tiny(family)
    shape = ModelShape.from_config(model.config)
    real = sum(p.numel() for p in model.parameters())
    assert abs(estimated_parameters(shape) - real) / real < 0.05
    model.save_pretrained(tmp_path)
    assert checkpoint_weight_bytes(tmp_path, 4) == real * 4
    ids = random_ids(16, 3)
    for bits in (None, 8, 4):
        store = ChunkStore(max_bytes=10**8, chunk_size=16, kv_bits=bits)
        warm(model, ids, store)
        entry = store.entries()[0]
        assert entry.nbytes / entry.num_tokens == pytest.approx(stored_bytes_per_token(shape, bits, 16), rel=1e-6)


def test_plan_command_json(tmp_path, capsys):
    make_tiny("llama").save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--memory", "64MiB", "--context", "512", "--bandwidth", "10",
                 "--shared-prefix", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weights_exact"] and report["memory_bytes"] == 64 * 2**20
    assert report["kv_bytes_per_sequence"] == 512 * 2 * 2 * 16 * 2 * 4  # K+V, 2 kv heads, head_dim 16, 2 layers, fp32
    assert report["max_sequences"] == report["kv_pool_bytes"] // report["kv_bytes_per_sequence"] > 0
    assert report["shared_prefix"]["prefill_tokens_saved_per_request"] == 100
    assert main(["plan", "--model", str(tmp_path), "--memory", "1MiB", "--bandwidth", "10"]) == 0
    assert "cannot serve" in capsys.readouterr().out


def test_sizes_parse_and_bad_ones_are_refused():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("500MB") == 500 * 10**6 and parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="dtype"):
        ModelShape.from_config(LlamaConfig(), dtype="int3")
    with pytest.raises(ValueError, match="positive"):
        capacity(BASE, 0, 100, 1.0)
    assert torch.float32  # torch is importable next to the planner
