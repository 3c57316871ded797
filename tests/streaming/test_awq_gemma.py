"""The embedded Gemma-3-270M packed by awq-pack: streamed exactly as fully resident, reuse exact."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.models.huge_pages import back_with_huge_pages
from kvboost_hf.streaming import streaming_stats
from tests.streaming.conftest import load_awq

pytestmark = pytest.mark.gemma

TEXT = (
    "The lighthouse keeper wrote in his log every evening. He noted the wind, the colour of the sea, "
    "the ships that passed and the birds that rested on the gallery rail."
)


def test_gemma_every_mode_equals_full_resident(gemma, gemma_awq, mmap_dir):
    """Every mode, each on huge pages (the default), equals full residency on the pages the load gave."""
    _, tokenizer = gemma
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    reference = load_awq(gemma_awq, residency_mode="full_resident", huge_pages=False)
    assert streaming_stats(reference).huge_page_bytes == 0
    with torch.no_grad():
        ref_logits = reference(ids).logits
        ref_tokens = reference.generate(ids, max_new_tokens=8, do_sample=False)
    del reference
    collapses = back_with_huge_pages([torch.randn(8 << 18)]).collapsed > 0  # this host backs memory with THP
    settings = [
        dict(residency_mode="partial_resident", keep_first_k=2, keep_last_k=2, n_staging_slots=2, host="ram"),
        dict(residency_mode="ffn_only_stream", keep_first_k=1, keep_last_k=1, n_staging_slots=3, host="ram"),
        dict(residency_mode="full_stream", n_staging_slots=1, host="mmap", mmap_dir=str(mmap_dir)),
    ]
    for setting in settings:
        model = load_awq(gemma_awq, **setting)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref_logits), setting
            assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref_tokens), setting
        stats = streaming_stats(model)
        assert stats.acquisitions == 9 * stats.streamed_layers
        # the bf16 head and embedding (335 MB) at least, and resident or RAM-streamed int4 weights
        assert (stats.huge_page_bytes > 300_000_000) == collapses, (setting, stats.huge_page_bytes)


def test_gemma_streamed_chunk_reuse_exact(gemma, gemma_awq):
    _, tokenizer = gemma
    model = load_awq(gemma_awq, residency_mode="full_stream", n_staging_slots=2)
    first = tokenizer(TEXT + " In the first volume", return_tensors="pt")["input_ids"]
    second = tokenizer(TEXT + " Visitors often ask", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = model.generate(second, max_new_tokens=8, do_sample=False)
        enable_chunk_reuse(model, ChunkStore(max_bytes=200_000_000, chunk_size=16))
        try:
            model.generate(first, max_new_tokens=1, do_sample=False)
            reused = model.generate(second, max_new_tokens=8, do_sample=False)
            assert last_request_stats(model).reused_tokens >= 16
        finally:
            disable_chunk_reuse(model)
    assert torch.equal(plain, reused)
