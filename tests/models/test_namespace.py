"""What the model namespace sees: every weight byte, edits through ``.data``, copies and pickles of a model."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from kvboost_hf import (
    ChunkStore,
    disable_chunk_reuse,
    enable_chunk_reuse,
    is_chunk_reuse_enabled,
    last_request_stats,
    refresh_namespace,
)
from kvboost_hf.models.namespace import namespace
from tests.conftest import make_tiny, random_ids

GREEDY = dict(max_new_tokens=8, do_sample=False)


def prompt(seed: int = 3) -> torch.Tensor:
    return random_ids(40, seed)


def reuse_run(model, store, ids, **kw):
    enable_chunk_reuse(model, store)
    out = model.generate(ids, **GREEDY, **kw)
    return out, last_request_stats(model)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_models_differing_only_in_unsampled_elements_do_not_share_kv(family):
    a = make_tiny(family)
    b = copy.deepcopy(a)
    with torch.no_grad():  # the review's repro: every other element of one projection
        b.model.layers[0].self_attn.v_proj.weight.view(-1)[1::2] *= -20
    ids = prompt()
    ref_b = b.generate(ids, **GREEDY)
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    reuse_run(a, store, ids)
    out_b, stats = reuse_run(b, store, ids)
    assert stats.reused_tokens == 0
    assert torch.equal(out_b, ref_b)


def test_one_element_and_one_buffer_change_the_namespace():
    a = make_tiny("llama")
    base = namespace(a)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.model.layers[1].mlp.down_proj.weight[7, 3] += 1e-3
    assert namespace(b) != base
    c = copy.deepcopy(a)
    c.model.rotary_emb.inv_freq.mul_(1.0001)  # a buffer: RoPE frequencies
    assert namespace(c) != base


def rerun_after(edit) -> tuple:
    """Stats of a repeated request after ``edit(model)``, and whether its output equals plain generate."""
    model = make_tiny("llama")
    ids = prompt()
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    reuse_run(model, store, ids)
    edit(model)
    out, stats = reuse_run(model, store, ids)
    disable_chunk_reuse(model)
    return stats, torch.equal(out, model.generate(ids, **GREEDY))


def test_whole_tensor_edit_through_data_is_noticed():
    def edit(model):
        model.model.layers[0].self_attn.k_proj.weight.data.mul_(1.5)  # bypasses the version counter

    stats, same_as_plain = rerun_after(edit)
    assert stats.reused_tokens == 0 and same_as_plain


def test_an_edit_through_data_that_spares_the_first_column_is_noticed():
    """A sampling step that is a multiple of the row length would put every sample in column 0."""
    def edit(model):
        weight = model.model.layers[0].self_attn.k_proj.weight
        assert (weight.numel() // 16) % weight.shape[-1] == 0  # the case
        weight.data[:, 1:].mul_(1.5)

    stats, same_as_plain = rerun_after(edit)
    assert stats.reused_tokens == 0 and same_as_plain


def test_refresh_namespace_covers_edits_the_per_request_check_cannot_see():
    def edit(model):
        before = namespace(model)
        model.model.layers[0].self_attn.v_proj.weight.data[5, 7] += 3.0  # one unsampled element, no version bump
        assert namespace(model) == before  # the documented limit of the per-request check
        assert refresh_namespace(model) != before

    stats, same_as_plain = rerun_after(edit)
    assert stats.reused_tokens == 0 and same_as_plain


def test_namespace_is_memoised_per_model_state():
    model = make_tiny("llama")
    first = namespace(model)
    assert namespace(model) is first  # no rehash while nothing changed
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert namespace(model) != first


def test_weights_on_the_meta_device_step_aside_with_a_reason():
    model = make_tiny("llama")
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8))
    model.register_buffer("offloaded", torch.empty(4, device="meta"))
    out = model.generate(prompt(), **GREEDY)
    stats = last_request_stats(model)
    assert "fingerprinted" in stats.reason and stats.reused_tokens == 0 and stats.stored_chunks == 0
    assert out.shape[1] == prompt().shape[1] + 8


# ---------------------------------------------------------------------- copies and pickles
def test_deepcopy_of_an_enabled_model_is_a_plain_model():
    model = make_tiny("llama")
    cls = type(model)
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    enable_chunk_reuse(model, store)
    ids = prompt()
    model.generate(ids, **GREEDY)
    twin = copy.deepcopy(model)
    assert type(twin) is cls and not is_chunk_reuse_enabled(twin)
    assert not twin._forward_pre_hooks and not twin._forward_hooks
    inserted = store.stats()["inserted"]
    assert torch.equal(twin.generate(ids, **GREEDY), model.generate(ids, **GREEDY))
    assert store.stats()["inserted"] == inserted  # the copy did not touch the original's store
    enable_chunk_reuse(twin, store)  # it can be enabled on its own
    twin.generate(ids, **GREEDY)
    assert last_request_stats(twin).reused_tokens == ids.shape[1] - 1
    assert is_chunk_reuse_enabled(model) and type(model) is not cls


def test_torch_save_and_pickle_of_an_enabled_model_give_the_plain_model():
    model = make_tiny("qwen2")
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8))
    ids = prompt()
    ref = model.generate(ids, **GREEDY)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    unpickled = pickle.loads(pickle.dumps(model))
    for other in (loaded, unpickled):
        assert type(other) is type(model).__mro__[2] and not is_chunk_reuse_enabled(other)
        assert torch.equal(other.generate(ids, **GREEDY), ref)
    disable_chunk_reuse(model)
    assert type(model) is type(loaded)


# ---------------------------------------------------------------------- what an adversarial review found
def test_peft_adapter_rescaling_changes_the_namespace():
    from peft import LoraConfig, get_peft_model
    from peft.helpers import rescale_adapter_scale

    lora = get_peft_model(make_tiny("llama", seed=3), LoraConfig(r=4, target_modules=["k_proj", "v_proj"],
                                                                  init_lora_weights=False, lora_alpha=64)).eval()
    ids = prompt()
    with rescale_adapter_scale(lora, 5.0):
        ref = lora.generate(input_ids=ids, **GREEDY)
    enable_chunk_reuse(lora, ChunkStore(max_bytes=10**8, chunk_size=8))
    lora.generate(input_ids=ids, **GREEDY)  # stored at scale 1
    with rescale_adapter_scale(lora, 5.0):
        out = lora.generate(input_ids=ids, **GREEDY)
        reused = last_request_stats(lora).reused_tokens
    disable_chunk_reuse(lora)
    assert reused == 0 and torch.equal(out, ref)


def test_a_compiled_model_gets_reuse():
    compiled = torch.compile(make_tiny("llama"), backend="eager")
    ids = prompt()
    ref = compiled.generate(ids, **GREEDY)
    enable_chunk_reuse(compiled, ChunkStore(max_bytes=10**8, chunk_size=8))
    compiled.generate(ids, **GREEDY)
    out = compiled.generate(ids, **GREEDY)
    assert last_request_stats(compiled).reused_tokens == ids.shape[1] - 1
    disable_chunk_reuse(compiled)
    assert torch.equal(out, ref)


def test_buffers_replaced_under_inference_mode_do_not_break_requests():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()  # dynamic RoPE re-registers inv_freq past 64 positions
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8))
    for n in (40, 100, 40):
        with torch.inference_mode():
            out = model.generate(random_ids(n, n), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert out.shape[1] == n + 2


def test_a_pickled_cacheblend_model_loads_where_kvboost_is_imported(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    model = make_tiny("llama")
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8), recompute_strategy="cacheblend")
    torch.save(model, tmp_path / "model.pt")
    code = ("import kvboost_hf, torch; m = torch.load('model.pt', weights_only=False); "
            "print(m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False).shape[1])")
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "5"
