"""Streamed models compute bit for bit what the fully resident checkpoint computes."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf.streaming import streaming_stats
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import make_tiny
from tests.streaming.conftest import STREAM_FAMILIES, TINY_GROUP, TINY_LAYERS, load_awq

# Every residency mode with every slot count; hosts alternate, and each mode runs from both hosts.
SETTINGS = [
    dict(residency_mode=mode, keep_first_k=1, keep_last_k=1, n_staging_slots=slots, host=("ram", "mmap")[slots % 2])
    for mode in ("partial_resident", "ffn_only_stream", "full_stream")
    for slots in (1, 2, 3)
] + [dict(residency_mode="full_stream", n_staging_slots=2, prefetch=False)]
# generate() is compared on these (logits on all of them).
GENERATE = {("partial_resident", 2), ("ffn_only_stream", 1), ("full_stream", 1), ("full_stream", 2)}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", STREAM_FAMILIES)
def test_every_mode_equals_full_resident(family, tiny_awq, mmap_dir):
    _, path = tiny_awq[family]
    reference = load_awq(path, residency_mode="full_resident")
    prompt = _ids(24, 7)
    with torch.no_grad():
        ref_logits = reference(prompt).logits
        ref_tokens = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    for settings in SETTINGS:
        model = load_awq(path, mmap_dir=str(mmap_dir), **settings)
        generate = (settings["residency_mode"], settings["n_staging_slots"]) in GENERATE
        with torch.no_grad():
            logits = model(prompt).logits
            tokens = model.generate(prompt, max_new_tokens=6, do_sample=False) if generate else ref_tokens
        assert torch.equal(logits, ref_logits), settings
        assert torch.equal(tokens, ref_tokens), settings
        stats = streaming_stats(model)
        streamed = TINY_LAYERS if settings["residency_mode"] == "full_stream" else TINY_LAYERS - 2
        assert stats.streamed_layers == streamed
        # one forward for the logits (then prefill + 5 decode steps): every streamed layer each time
        assert stats.acquisitions == (7 if generate else 1) * streamed, (settings, stats)
        if not settings.get("prefetch", True):
            assert stats.misses == stats.acquisitions and stats.hits == 0


def test_batch_and_sampling_identical(tiny_awq):
    _, path = tiny_awq["llama"]
    reference = load_awq(path, residency_mode="full_resident")
    streamed = load_awq(path, residency_mode="full_stream", n_staging_slots=2)
    prompts = torch.cat([_ids(16, 1), _ids(16, 2)])
    kw = dict(max_new_tokens=8, do_sample=True, top_k=20)
    with torch.no_grad():
        torch.manual_seed(5)
        a = reference.generate(prompts, **kw)
        torch.manual_seed(5)
        b = streamed.generate(prompts, **kw)
    assert torch.equal(a, b)


def test_awq_output_tracks_float_model(tiny_awq):
    """Not exact (int4), but the quantized model must still compute the same function roughly."""
    model, path = tiny_awq["llama"]
    awq = load_awq(path, residency_mode="full_stream", n_staging_slots=1, dtype=torch.float32)
    prompt = _ids(32, 9)
    with torch.no_grad():
        ref = torch.log_softmax(model(prompt).logits, -1)
        out = torch.log_softmax(awq(prompt).logits.float(), -1)
    kl = torch.nn.functional.kl_div(out, ref, log_target=True, reduction="batchmean") / prompt.shape[1]
    assert kl < 0.05, kl


def test_zero_point_false_checkpoint(tmp_path):
    model = make_tiny("qwen2", seed=4, num_layers=4)
    pack_model(model, tmp_path, group_size=TINY_GROUP, zero_point=False)
    assert '"zero_point": false' in (tmp_path / "config.json").read_text()
    reference = load_awq(tmp_path, residency_mode="full_resident")
    streamed = load_awq(tmp_path, residency_mode="partial_resident", keep_first_k=1, keep_last_k=1,
                        n_staging_slots=1)
    prompt = _ids(20, 3)
    with torch.no_grad():
        assert torch.equal(reference(prompt).logits, streamed(prompt).logits)
        ref = torch.log_softmax(model(prompt).logits, -1)
        out = torch.log_softmax(reference(prompt).logits.float(), -1)
    assert torch.nn.functional.kl_div(out, ref, log_target=True, reduction="batchmean") / 20 < 0.05
