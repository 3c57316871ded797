"""Row-exact verification on an AWQ int4 target: k + 1 verified rows equal k + 1 decode steps, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvboost_hf import ControllerSettings, last_request_stats, make_draft
from kvboost_hf.models import attention
from kvboost_hf.speculative.exact_rows import needs_exact_rows, route_rows, verifying
from kvboost_hf.streaming import StreamingAWQConfig
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import SLIDING_WINDOW, make_tiny, random_ids, torch_threads

pytestmark = pytest.mark.usefixtures("one_thread")


def _int4_target(family: str, path, layers: int = 4, dtype: torch.dtype = torch.float32):
    model = make_tiny(family, seed=3, num_layers=layers)
    pack_model(model, path, group_size=32)
    config = StreamingAWQConfig(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=dtype).eval()


def _decode_hidden(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Last-layer hidden states of ``ids[prefix:]`` decoded one token at a time."""
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
    rows = [model.model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
            for t in range(prefix, ids.shape[1])]
    return torch.stack(rows)


def _verify_hidden(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """The same rows from one verification forward, attention routed per row."""
    cache = DynamicCache(config=model.config)
    with verifying(model):
        model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
        route_rows(ids.shape[1] - prefix)
        return model.model(input_ids=ids[:, prefix:], past_key_values=cache, use_cache=True).last_hidden_state[0]


def _attention_per_row(target) -> None:
    """The way without kvboost_hf's attention kernel: float32 SDPA (bf16) or stock SDPA, one call per row."""
    owned = attention.FLOAT32_SDPA if target.dtype == torch.bfloat16 else None
    for module in target.modules():
        if attention.owned_attention(module) is not None:
            setattr(module, attention.OWNED_ATTR, owned)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("prefix", [5, SLIDING_WINDOW + 3])  # inside and beyond the sliding window
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("way", ["kernel", "per-row"])
def test_verified_rows_equal_decode_steps(family, prefix, dtype, way, tmp_path, monkeypatch):
    from kvboost_hf.kernels import ops

    target = _int4_target(family, tmp_path / "ckpt", dtype=dtype)
    assert needs_exact_rows(target)
    if way == "per-row":
        _attention_per_row(target)
    ids = random_ids(prefix + 7, 4)
    calls, kernel_calls = [], []
    real, real_kernel = attention.sdpa_forward, ops.attention
    with torch.no_grad():
        decoded = _decode_hidden(target, ids, prefix)
        def counted(*args, **kwargs):  # the routed forward's calls (the prefix prefill is not routed)
            if attention.attention_route() is not None:
                calls.append(args[1].shape[2])
            return real(*args, **kwargs)

        def counted_kernel(query, *args, **kwargs):
            if attention.attention_route() is not None:
                kernel_calls.append(query.shape[2])
            return real_kernel(query, *args, **kwargs)

        monkeypatch.setattr(attention, "sdpa_forward", counted)
        monkeypatch.setattr(ops, "attention", counted_kernel)
        verified = _verify_hidden(target, ids, prefix)
    assert torch.equal(verified, decoded)
    if way == "kernel":  # one call per layer for all 7 rows
        assert not calls and kernel_calls == [7] * target.config.num_hidden_layers
    else:
        assert calls and set(calls) == {1} and not kernel_calls  # one query row per SDPA call
    # Switched once and kept (other threads' requests share the config); stock SDPA when not routed.
    assert target.config._attn_implementation == "kvboost_sdpa"
    assert attention.attention_route() is None


def test_a_float_target_keeps_the_batched_call(tmp_path):
    assert not needs_exact_rows(make_tiny("llama"))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype,adaptive", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_speculation_on_an_int4_target_is_token_identical(family, dtype, adaptive, tmp_path, reuse):
    """bf16 too: on the kvboost kernel its attention and norms are ours, and a bf16 draft of it as well."""
    target = _int4_target(family, tmp_path / "ckpt", layers=5, dtype=dtype)
    draft = make_draft(target, bits=4)
    reuse(target)
    # speculate in every round it can (adaptive), or a fixed 6 tokens in every round from the first
    settings = ControllerSettings(min_gain=1e-6, start_tokens=3, max_tokens=6, adaptive=adaptive)
    verified = reused = 0
    common = random_ids(5, 99)  # later prompts reuse a partial chunk: the sliding layers load from the store
    for seed in (1, 2, 3):
        ids = torch.cat([common, random_ids(SLIDING_WINDOW + 4, seed)], dim=1)
        ref = target.generate(ids, max_new_tokens=24, do_sample=False, draft=None)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, draft=draft, speculation=settings)
        assert torch.equal(out, ref)
        spec = last_request_stats(target).speculation
        assert spec.choices[0][0] == 0  # round 0, the prompt prefill, never carries drafts here
        verified += spec.drafted_tokens
        reused += last_request_stats(target).reused_tokens
    assert verified > 0 and reused > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_top_k_1_sampling_on_an_int4_target_is_greedy(family, tmp_path, reuse):
    """Sampling goes through HF's speculative sampling, not the greedy match: with top_k=1 the target's
    distribution is one token, so the output must be plain greedy decoding whatever the seed."""
    target = _int4_target(family, tmp_path / "ckpt", layers=5)
    draft = make_draft(target, bits=4)
    reuse(target)
    settings = ControllerSettings(adaptive=False, max_tokens=4, start_tokens=1, probe_tokens=1)
    for seed in (1, 2):
        ids = random_ids(SLIDING_WINDOW + 6, seed)
        ref = target.generate(ids, max_new_tokens=20, do_sample=False)
        torch.manual_seed(seed)
        out = target.generate(ids, max_new_tokens=20, do_sample=True, top_k=1, draft=draft, speculation=settings)
        assert torch.equal(out, ref)
        assert last_request_stats(target).speculation.drafted_tokens > 0


@pytest.mark.parametrize("strategy", ["cacheblend", "selective"])
def test_approximate_reuse_on_an_int4_target_gives_the_same_tokens_with_a_draft(strategy, tmp_path):
    """Approximate reuse changes the prompt's K/V (reported as approximate); a draft must not change
    anything on top: the same request from identically warmed stores, with and without a draft."""
    from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, warm

    target = _int4_target("gemma3", tmp_path / "ckpt", layers=5)
    draft = make_draft(target, bits=4)
    bos = torch.tensor([1])
    a, b, system, question = (random_ids(n, seed)[0] for n, seed in ((40, 11), (40, 12), (10, 13), (6, 14)))
    prompt = torch.cat([bos, system, b, a, question]).unsqueeze(0)  # the documents, reordered
    settings = ControllerSettings(min_gain=1e-6, start_tokens=3, max_tokens=6)
    outputs, approximate = [], []
    try:
        for kwargs in ({}, {"draft": draft, "speculation": settings}):
            store = ChunkStore(max_bytes=10**8, chunk_size=16)
            warm(target, torch.cat([bos, a]), store)
            warm(target, torch.cat([bos, b]), store)
            enable_chunk_reuse(target, store, recompute_strategy=strategy, recompute_ratio=0.25, seam_tokens=4)
            outputs.append(target.generate(prompt, max_new_tokens=16, do_sample=False, **kwargs))
            stats = last_request_stats(target)
            approximate.append(stats.approximate_tokens)
    finally:
        disable_chunk_reuse(target)
    assert approximate[0] > 0 and approximate[0] == approximate[1]
    assert torch.equal(outputs[0], outputs[1])
    assert stats.speculation.drafted_tokens > 0


def _hidden_by_position(model):
    """Forward hooks recording the last hidden state of every position the model computes (the last
    computation wins: a position computed for a rejected candidate is computed again later)."""
    rows, start = {}, [0]

    def before(_module, _args, kwargs):
        start[0] = kwargs["past_key_values"].get_seq_length()

    def after(_module, _args, _kwargs, output):
        for i, row in enumerate(output.last_hidden_state[0]):
            rows[start[0] + i] = row.clone()

    hooks = [model.model.register_forward_pre_hook(before, with_kwargs=True),
             model.model.register_forward_hook(after, with_kwargs=True)]
    return rows, hooks


def test_every_decoded_position_has_the_hidden_state_of_plain_decoding(tmp_path, reuse):
    """Bit for bit, not only the tokens: every verified row and plain round of a speculative request on
    an int4 Gemma3 target, prompts beyond the sliding window. Once a sliding window is full, a decode
    step calls SDPA with an all-True mask (transformers does not skip it then) and rounds differently
    from a call without one: seed 5 differed at position 46 (1.6e-4) when verification passed no mask."""
    target = _int4_target("gemma3", tmp_path / "ckpt", layers=5)
    draft = make_draft(target, bits=4)
    reuse(target)
    settings = ControllerSettings(adaptive=False, max_tokens=3, start_tokens=1, probe_tokens=1)
    common = random_ids(5, 99)
    compared = 0
    for seed in range(1, 7):
        ids = torch.cat([common, random_ids(SLIDING_WINDOW + 4, seed)], dim=1)
        runs = []
        for variant in ({}, {"draft": "prompt-lookup", "speculation": settings},
                        {"draft": draft, "speculation": settings}):
            rows, hooks = _hidden_by_position(target)
            out = target.generate(ids, max_new_tokens=24, do_sample=False, **variant)
            for hook in hooks:
                hook.remove()
            runs.append((out, rows))
        (ref, plain), spec = runs[0], runs[1:]
        for out, rows in spec:
            assert torch.equal(out, ref)
            for position in range(ids.shape[1], ref.shape[1] - 1):
                assert torch.equal(rows[position], plain[position]), (seed, position)
                compared += 1
    assert compared > 200


def test_verified_rows_equal_decode_steps_with_wide_heads_and_threads(tmp_path):
    """Several key heads of 64 dims and two threads: each row's float32 keys reach SDPA in the layout a
    decode step's have (contiguous), and the kernels split work across threads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0)
    pack_model(LlamaForCausalLM(config).eval(), tmp_path / "ckpt", group_size=64)
    target = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", quantization_config=StreamingAWQConfig(residency_mode="full_resident"),
        dtype=torch.bfloat16).eval()
    ids = random_ids(40, 8)
    with torch_threads(2), torch.no_grad():
        assert torch.equal(_verify_hidden(target, ids, 31), _decode_hidden(target, ids, 31))
