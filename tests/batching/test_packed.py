"""The packed forward: decode rows and prompt chunks side by side, each row attending to its own cache."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from kvboost_hf.batching import BatchLimits, BatchRunner, PackedRowsCache, RowSampling, Sequence
from kvboost_hf.batching.packed import chunk_mask, segments_of
from kvboost_hf.models import attention
from tests.batching.helpers import generate_alone, run_batch
from tests.conftest import SLIDING_WINDOW, make_tiny, random_ids


def test_segments_and_chunk_masks():
    assert [(s.row, s.start, s.length) for s in segments_of([1, 3, 1])] == [(0, 0, 1), (1, 1, 3), (2, 4, 1)]
    with pytest.raises(ValueError, match="at least one"):
        segments_of([1, 0])
    mask = chunk_mask(before=2, new=3, window=None, device="cpu")[0, 0]
    assert mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                             [True, True, True, True, True]]
    windowed = chunk_mask(before=2, new=3, window=2, device="cpu")[0, 0]
    assert windowed.tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                                 [False, False, False, True, True]]


def test_update_refuses_kv_of_another_shape(tiny_models):
    config = tiny_models["llama"].config
    cache = PackedRowsCache([DynamicCache(config=config), DynamicCache(config=config)], [1, 2])
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    with pytest.raises(RuntimeError, match="packed forward"):
        cache.update(torch.zeros(1, heads, 4, dim), torch.zeros(1, heads, 4, dim), 0)


def test_one_forward_carries_decode_rows_and_window_crossing_chunks(tiny_models):
    """A decoding row and prompts whose chunks are longer than the sliding window share every forward."""
    model = tiny_models["gemma3"]
    prompts = [random_ids(n, seed=40 + n)[0].tolist() for n in (5, 3 * SLIDING_WINDOW + 7, 2 * SLIDING_WINDOW + 1)]
    seqs = [Sequence(p, max_tokens=SLIDING_WINDOW + 4, sampling=RowSampling(temperature=0), eos_ids=[])
            for p in prompts]
    steps = run_batch(BatchRunner(model), seqs, BatchLimits(max_batch_size=3, max_batched_tokens=SLIDING_WINDOW + 8))
    chunked = [s for s in steps if s["decoded"] and any(n > SLIDING_WINDOW for n in s["chunks"].values())]
    assert chunked  # a chunk longer than the window went through the same forward as a decode row
    for seq in seqs:
        assert seq.generated == generate_alone(model, seq.prompt_ids, seq.max_tokens, [])


def test_a_failed_forward_leaves_nothing_routed(tiny_models):
    model = tiny_models["llama"]
    runner = BatchRunner(model)
    assert model.config._attn_implementation == attention.ATTENTION_NAME  # switched once, for good
    bad = Sequence([1, 2, model.config.vocab_size + 5], max_tokens=2, sampling=RowSampling(temperature=0), eos_ids=[])
    runner.start(bad)
    with pytest.raises(IndexError):
        runner.step([], [bad], [3])
    assert attention.attention_route() is None  # later forwards on this thread are plain SDPA again
    good = Sequence(random_ids(9, seed=3)[0].tolist(), max_tokens=4, sampling=RowSampling(temperature=0), eos_ids=[])
    run_batch(runner, [good], BatchLimits(2, 16))
    assert good.generated == generate_alone(model, good.prompt_ids, 4, [])
    assert model.config._attn_implementation == attention.ATTENTION_NAME


def _prefill_logits(runner: BatchRunner, prompt: list[int]) -> torch.Tensor:
    seq = Sequence(prompt, max_tokens=1, sampling=RowSampling(temperature=0), eos_ids=[])
    runner.start(seq)
    return runner.prefill([seq], [len(prompt)])[0]


def test_a_step_ending_on_one_thread_does_not_unroute_one_mid_forward():
    """Step B (a thread) is inside layer 0 when step A starts; A is inside layer 1 when B ends. Every
    layer of A still runs packed attention: A's logits are those of A alone, bit for bit."""
    model = make_tiny("llama", seed=7, num_layers=3)
    prompt_a, prompt_b = random_ids(11, seed=1)[0].tolist(), random_ids(7, seed=2)[0].tolist()
    expected = _prefill_logits(BatchRunner(model), prompt_a)
    main = threading.current_thread()
    b_paused, a_mid, b_done = threading.Event(), threading.Event(), threading.Event()
    wait_s = 60  # a deadlock guard, not a timing assertion

    def layer0(_module, _args):
        if threading.current_thread() is not main and not b_paused.is_set():
            b_paused.set()
            a_mid.wait(wait_s)

    def layer1(_module, _args):
        if threading.current_thread() is main and not a_mid.is_set():
            a_mid.set()
            b_done.wait(wait_s)

    errors = []

    def step_b() -> None:
        try:
            _prefill_logits(BatchRunner(model), prompt_b)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
        finally:
            b_done.set()

    hooks = [model.model.layers[0].register_forward_pre_hook(layer0),
             model.model.layers[1].register_forward_pre_hook(layer1)]
    try:
        worker = threading.Thread(target=step_b)
        worker.start()
        assert b_paused.wait(wait_s)
        with torch.no_grad():
            got = _prefill_logits(BatchRunner(model), prompt_a)
        worker.join(wait_s)
    finally:
        for hook in hooks:
            hook.remove()
    assert not errors and a_mid.is_set() and b_done.is_set()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("held", [SLIDING_WINDOW - 3, SLIDING_WINDOW - 1, 2 * SLIDING_WINDOW])
def test_a_decoding_row_gets_the_decode_step_call_bit_for_bit(tiny_models, held):
    """Next to a prompt chunk, a decoding row's attention output equals a batch-1 decode step's, on a
    sliding layer whose window is not yet full, just full and long full (then transformers passes an
    all-True mask, and SDPA without it rounds differently)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvboost_hf.batching.packed import packed_rows_attention

    model = tiny_models["gemma3"]
    module = next(layer.self_attn for layer in model.model.layers if layer.self_attn.is_sliding)
    config, idx = model.config, module.layer_idx
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    torch.manual_seed(held)
    past_k, past_v = torch.randn(1, kv_heads, held, dim), torch.randn(1, kv_heads, held, dim)
    new_k, new_v = torch.randn(1, kv_heads, 1 + 3, dim), torch.randn(1, kv_heads, 1 + 3, dim)
    query = torch.randn(1, heads, 1 + 3, dim)

    alone = DynamicCache(config=config)
    alone.layers[idx].update(past_k, past_v)
    keys, values = alone.layers[idx].update(new_k[:, :, :1], new_v[:, :, :1])
    step = attention.decode_step_mask(module.sliding_window, keys.shape[-2], torch.device("cpu"))
    expected, _ = sdpa_attention_forward(module, query[:, :, :1], keys, values, step, scaling=module.scaling,
                                         is_causal=False)

    decoding, prefilling = DynamicCache(config=config), DynamicCache(config=config)
    decoding.layers[idx].update(past_k, past_v)
    packed = PackedRowsCache([decoding, prefilling], [1, 3])
    packed.update(new_k, new_v, idx)
    out, _ = packed_rows_attention(packed, module, query, new_k, new_v, None, scaling=module.scaling)
    assert torch.equal(out[:, :1], expected)
    assert (step is not None) == (held + 1 >= SLIDING_WINDOW)
