"""The packed forward: decode rows and prompt chunks side by side, each row attending to its own cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvboost_hf import attention
from kvboost_hf.batching import BatchLimits, BatchRunner, PackedRowsCache, RowSampling, Sequence
from kvboost_hf.batching.packed import chunk_mask, segments_of
from tests.batching.helpers import generate_alone, run_batch
from tests.conftest import SLIDING_WINDOW, random_ids


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


def test_model_attention_is_restored_even_when_the_forward_fails(tiny_models):
    model = tiny_models["llama"]
    assert model.config._attn_implementation == "sdpa"
    runner = BatchRunner(model)
    bad = Sequence([1, 2, model.config.vocab_size + 5], max_tokens=2, sampling=RowSampling(temperature=0), eos_ids=[])
    runner.start(bad)
    with pytest.raises(IndexError):
        runner.step([], [bad], [3])
    assert model.config._attn_implementation == "sdpa"
    assert attention.attention_route() is None  # later forwards on this thread are plain SDPA again
    good = Sequence(random_ids(9, seed=3)[0].tolist(), max_tokens=4, sampling=RowSampling(temperature=0), eos_ids=[])
    run_batch(runner, [good], BatchLimits(2, 16))
    assert good.generated == generate_alone(model, good.prompt_ids, 4, [])
    assert model.config._attn_implementation == "sdpa"
