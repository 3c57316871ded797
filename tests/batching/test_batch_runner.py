"""Batched decoding over per-request caches equals one-by-one generate (tiny families, fp32)."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse
from kvboost_hf.batching import BatchLimits, BatchRunner, RowSampling, Sequence
from tests.batching.helpers import generate_alone, run_batch
from tests.conftest import SLIDING_WINDOW, random_ids

LENGTHS = (1, 3, 17, 40, 5, 33, 70, 25)  # around and past the sliding window (16)


def prompts(shared: int = 0) -> list[list[int]]:
    prefix = random_ids(shared, seed=99)[0].tolist() if shared else []
    return [prefix + random_ids(n, seed=n)[0].tolist() for n in LENGTHS]


@pytest.mark.parametrize("reuse", [False, True])
def test_greedy_rows_equal_generate_alone(tiny, reuse):
    store = ChunkStore(max_bytes=50_000_000, chunk_size=16)
    if reuse:
        enable_chunk_reuse(tiny, store)
    seqs = [Sequence(p, max_tokens=3 + 2 * i, sampling=RowSampling(temperature=0), eos_ids=[2])
            for i, p in enumerate(prompts(shared=37 if reuse else 0))]
    runner = BatchRunner(tiny, store if reuse else None)
    steps = run_batch(runner, seqs, BatchLimits(max_batch_size=4, max_batched_tokens=20))
    assert max(len(s["decoded"]) for s in steps) == 4  # rows really were decoded together
    assert any(len(s["chunks"]) and s["decoded"] for s in steps)  # prompt chunks in the same forward as decoding
    assert max(len(s["chunks"]) for s in steps) > 1  # chunks of several prompts in one forward
    disable_chunk_reuse(tiny)
    for seq in seqs:
        assert seq.generated == generate_alone(tiny, seq.prompt_ids, seq.max_tokens, [2])
        assert seq.finish_reason in ("stop", "length")
    if reuse:  # later requests found the shared prefix the first ones committed
        reused = [seq.cache.stats.reused_tokens for seq in seqs]
        assert reused[:4] == [0] * 4 and all(r >= 32 for r in reused[4:]), reused


def test_first_step_logits_of_batched_rows_match_unbatched(tiny):
    seqs = [Sequence(p, max_tokens=2, sampling=RowSampling(temperature=0), eos_ids=[])
            for p in prompts()[1:6]]
    runner = BatchRunner(tiny)
    for seq in seqs:
        runner.start(seq)
        seq.sample(runner.prefill([seq], [10_000])[0])
    batched = runner.decode(seqs)  # the first decode step of five rows of different lengths
    for seq, row in zip(seqs, batched):
        ids = torch.tensor([seq.prompt_ids + seq.generated[:1]])
        with torch.no_grad():
            alone = tiny(ids).logits[0, -1]
        torch.testing.assert_close(row, alone, atol=1e-4, rtol=0)


def test_prefill_chunks_store_and_reuse_like_generate(tiny):
    """A prompt forwarded in uneven chunks commits K/V that a later generate reuses token-identically."""
    store = ChunkStore(max_bytes=50_000_000, chunk_size=8)
    enable_chunk_reuse(tiny, store)
    prompt = random_ids(45, seed=5)[0].tolist()
    seq = Sequence(prompt, max_tokens=6, sampling=RowSampling(temperature=0), eos_ids=[])
    run_batch(BatchRunner(tiny, store), [seq], BatchLimits(max_batch_size=2, max_batched_tokens=7))
    assert seq.cache.stats.reused_tokens == 0 and len(store) > 0
    later = prompt + random_ids(9, seed=6)[0].tolist()
    reused_out = tiny.generate(torch.tensor([later]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    from kvboost_hf import last_request_stats

    assert last_request_stats(tiny).reused_tokens >= 40
    disable_chunk_reuse(tiny)
    assert reused_out[0, len(later):].tolist() == generate_alone(tiny, later, 6, [])


@pytest.mark.parametrize("strategy", ["selective", "cacheblend"])
def test_approximate_strategy_rows_run_and_report_reuse(tiny_models, strategy):
    model = tiny_models["llama"]
    store = ChunkStore(max_bytes=50_000_000, chunk_size=16)
    enable_chunk_reuse(model, store, recompute_strategy=strategy)
    try:
        doc = random_ids(48, seed=7)[0].tolist()
        runner = BatchRunner(model, store)
        first = Sequence([5, 6, 7] + doc, max_tokens=3, sampling=RowSampling(temperature=0), eos_ids=[])
        run_batch(runner, [first], BatchLimits(2, 40))
        greedy = RowSampling(temperature=0)
        moved = Sequence([9, 9, 9, 9, 9] + doc + [11, 12], max_tokens=3, sampling=greedy, eos_ids=[])
        other = Sequence(random_ids(30, seed=8)[0].tolist(), max_tokens=6, sampling=greedy, eos_ids=[])
        run_batch(runner, [other, moved], BatchLimits(2, 40))  # batched with an unrelated request
        assert moved.cache.stats.approximate_tokens > 0  # the moved document came from the store
        assert moved.cache.stats.strategy == strategy
        assert len(moved.generated) == 3
        disable_chunk_reuse(model)
        assert other.generated == generate_alone(model, other.prompt_ids, 6, [])
    finally:
        disable_chunk_reuse(model)


def test_sliding_rows_cross_the_window_while_batched(tiny_models):
    model = tiny_models["gemma3"]
    short, long = random_ids(3, seed=1)[0].tolist(), random_ids(SLIDING_WINDOW + 9, seed=2)[0].tolist()
    seqs = [Sequence(p, max_tokens=2 * SLIDING_WINDOW, sampling=RowSampling(temperature=0), eos_ids=[])
            for p in (short, long)]
    run_batch(BatchRunner(model), seqs, BatchLimits(2, 64))
    for seq in seqs:
        assert seq.generated == generate_alone(model, seq.prompt_ids, seq.max_tokens, [])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eager_attention_takes_the_additive_masks(family):
    from tests.conftest import make_tiny

    model = make_tiny(family, seed=4)
    model.set_attn_implementation("eager")
    seqs = [Sequence(p, max_tokens=6, sampling=RowSampling(temperature=0), eos_ids=[]) for p in prompts()[:5]]
    run_batch(BatchRunner(model), seqs, BatchLimits(5, 30))
    for seq in seqs:
        assert seq.generated == generate_alone(model, seq.prompt_ids, 6, [])


def test_attention_without_prepared_masks_is_refused(tiny_models):
    model = tiny_models["llama"]
    before = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation"):
            BatchRunner(model)
    finally:
        model.config._attn_implementation = before


def test_gemma_batched_first_step_logits_match_unbatched(gemma_model):
    model, tokenizer = gemma_model
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea, "
             "there lived an old fisherman who"]
    seqs = [Sequence(tokenizer(t)["input_ids"], max_tokens=3, sampling=RowSampling(temperature=0), eos_ids=[])
            for t in texts]
    runner = BatchRunner(model)
    for seq in seqs:
        runner.start(seq)
        chunks = 0
        while seq.prefilling:  # several chunks for the longer prompts
            logits, chunks = runner.prefill([seq], [8])[0], chunks + 1
        seq.sample(logits)
        assert chunks == -(-len(seq.prompt_ids) // 8)
    batched = runner.decode(seqs)
    for seq, row in zip(seqs, batched):
        with torch.no_grad():
            alone = model(torch.tensor([seq.prompt_ids + seq.generated])).logits[0, -1]
        torch.testing.assert_close(row, alone, atol=1e-4, rtol=0)
        assert seq.generated == generate_alone(model, seq.prompt_ids, 1, [])
