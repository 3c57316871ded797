"""Every draft kind on the real Gemma-3-270M with reuse on: greedy output token-identical to plain."""

from __future__ import annotations

import torch

from kvboost_hf import ChunkStore, ControllerSettings, enable_chunk_reuse, last_request_stats, make_draft

ALWAYS = ControllerSettings(adaptive=False, max_tokens=4, start_tokens=1, probe_tokens=1)
DOCUMENT = (
    "The harbour museum keeps the lighthouse logs in a glass case. The keeper wrote every evening: the wind, "
    "the colour of the sea, the ships that passed and the birds that rested on the gallery rail. "
)


def test_every_draft_kind_on_gemma(gemma_model):
    model, tokenizer = gemma_model
    prompt = DOCUMENT + "Question: what did the keeper write every evening? Answer: The keeper wrote"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    drafts = {
        "prompt-lookup": "prompt-lookup",
        "store": "store",
        "int8-layers6": make_draft(model, bits=8, layers=6),
        "int4-vocab8192-layers9": make_draft(model, bits=4, vocab=8192, layers=9, tokenizer=tokenizer),
    }
    for name, draft in drafts.items():
        enable_chunk_reuse(model, ChunkStore(max_bytes=400_000_000, chunk_size=32))
        for k in range(2):  # cold, then warm (the prompt, and for "store" the reply, come from the store)
            out = model.generate(ids, max_new_tokens=8, do_sample=False, draft=draft, speculation=ALWAYS)
            assert torch.equal(out, ref), (name, k)
            stats = last_request_stats(model)
            assert stats.speculation.drafted_tokens > 0, name
        assert stats.reused_tokens >= 32, name  # the repeated prompt came from the store
        if name == "store":  # the repeated request's reply was drafted from the store: almost all accepted
            assert stats.speculation.acceptance_rate > 0.8, stats.speculation
    draft = drafts["int4-vocab8192-layers9"]
    logits = draft(ids).logits[0, -1]
    assert int(torch.isfinite(logits).sum()) <= 8192 + 16
