"""Head drafts: the target's own layers draft with a small head; the verification computes only the rows
the draft did not. The reply is plain greedy decoding's, whatever the head proposes."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from kvboost_hf import ControllerSettings, last_request_stats, make_head_draft
from kvboost_hf.speculative.head_draft import DraftedRows, HeadDraft, HeadProposer, head_verification
from tests.conftest import make_tiny, make_tiny_tokenizer, random_ids, words

pytestmark = pytest.mark.usefixtures("one_thread")
ALWAYS = ControllerSettings(adaptive=False, max_tokens=6, start_tokens=1, probe_tokens=1)


def _prompt(seed: int) -> torch.Tensor:
    base = random_ids(14, seed)
    return torch.cat([base, base[:, 2:10]], dim=1)


def _layer_rows(model) -> tuple[list[int], list]:
    """Rows each forward of the first decoder layer computes (a pre-hook: the tiny float models run unfused)."""
    rows: list[int] = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda _m, args, kwargs: rows.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True)
    return rows, handle


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_each_row_is_computed_once_and_the_reply_is_plain_decodings(family, reuse):
    """Past the prefill every layer call is one row: drafted rows are not computed again to verify them
    (a self-draft's verification forward computes k + 1). 40 tokens cross the tiny sliding window (16)."""
    model = make_tiny(family, seed=2)
    ids = _prompt(3)
    plain = model.generate(ids, max_new_tokens=40, do_sample=False)
    reuse(model)
    rows, handle = _layer_rows(model)
    try:
        out = model.generate(ids, max_new_tokens=40, do_sample=False, draft=make_head_draft(model), speculation=ALWAYS)
    finally:
        handle.remove()
    assert torch.equal(out, plain)
    stats = last_request_stats(model).speculation
    assert stats.accepted_tokens >= 20 and stats.rounds < 25  # its own int8 head: mostly accepted
    assert rows[0] == ids.shape[1] and set(rows[1:]) == {1}
    assert len(rows) - 1 == 39 + stats.drafted_tokens - stats.accepted_tokens  # rejected rows cost a forward each


def test_a_head_of_other_weights_changes_only_how_much_is_accepted(reuse):
    model, other = make_tiny("gemma3", seed=2), make_tiny("gemma3", seed=9)
    ids = _prompt(5)
    plain = model.generate(ids, max_new_tokens=30, do_sample=False)
    reuse(model)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, draft=make_head_draft(other), speculation=ALWAYS)
    assert torch.equal(out, plain)
    stats = last_request_stats(model).speculation
    assert stats.drafted_tokens > stats.accepted_tokens  # rejections: the rows were cropped, the reply kept


def test_candidates_cut_after_drafting_crop_the_drafted_rows(reuse, monkeypatch):
    """A stop string cuts the proposal after its rows were forwarded: the verification sees fewer tokens
    than were drafted and drops the rest from the cache."""
    from tests.speculative.test_draft_limits import PROMPT, _stop_string, _tokenizer

    model, tokenizer = make_tiny("llama", seed=6), _tokenizer()
    full = model.generate(PROMPT, max_new_tokens=40, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    seen = []
    verify = DraftedRows.verify
    monkeypatch.setattr(DraftedRows, "verify", lambda self, forward, args, kwargs: seen.append(
        (kwargs["input_ids"].shape[1], len(self.tokens))) or verify(self, forward, args, kwargs))
    reuse(model)
    for after in (4, 9, 15):
        stop, _ = _stop_string(tokenizer, full, after)
        plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        out = model.generate(PROMPT, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer,
                             draft=make_head_draft(model), speculation=ALWAYS)
        assert out.tolist() == plain.tolist()
    assert any(given <= drafted for given, drafted in seen)  # a cut round (a full one verifies drafted + 1)


def test_int4_targets_on_the_kernels_keep_greedy_replies(reuse, tmp_path):
    """An int4 target (bf16, fused layers where built, attention routed per row): drafted rows are its
    decode steps' rows, verified by its head alone."""
    from kvboost_hf.streaming.pack import pack_model
    from tests.streaming.conftest import TINY_GROUP, TINY_LAYERS, load_awq

    for family, seed in (("llama", 1), ("gemma3", 4)):
        pack_model(make_tiny(family, seed=seed, num_layers=TINY_LAYERS), tmp_path / family, group_size=TINY_GROUP)
        model = load_awq(tmp_path / family, residency_mode="full_resident", kernel="auto", dtype=torch.bfloat16)
        ids = _prompt(7)
        plain = model.generate(ids, max_new_tokens=40, do_sample=False)
        reuse(model)
        draft = make_head_draft(model)
        for _ in range(2):  # the second from the store
            out = model.generate(ids, max_new_tokens=40, do_sample=False, draft=draft, speculation=ALWAYS)
            assert torch.equal(out, plain), family
        stats = last_request_stats(model)
        assert stats.reused_tokens > 0 and stats.speculation.accepted_tokens > 10, family


def test_threads_sharing_a_model_each_verify_their_own_rows(reuse):
    model = make_tiny("gemma3", seed=2)
    prompts = [_prompt(s) for s in (11, 12, 13, 14)]
    plain = [model.generate(ids, max_new_tokens=24, do_sample=False) for ids in prompts]
    reuse(model)
    draft, outs, errors = make_head_draft(model), {}, []

    def run(i: int) -> None:
        try:
            outs[i] = model.generate(prompts[i], max_new_tokens=24, do_sample=False, draft=draft, speculation=ALWAYS)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # a deadlock guard, not a timing assertion
    assert not errors and all(torch.equal(outs[i], plain[i]) for i in range(len(prompts)))
    assert "forward" not in model.model.__dict__


def test_rows_left_behind_are_undone_and_the_decoder_restored(reuse):
    """Rows no verification took (another forward came first) are cropped from their cache, the other forward
    runs as it would; the decoder's own forward comes back when the last request ends, after an error too."""
    model = make_tiny("llama", seed=2)
    ids = random_ids(10, 4)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        reference = model(ids).logits
    proposer = HeadProposer(model, make_head_draft(model), eos=[], exact_rows=False)
    proposer.model_kwargs = {"past_key_values": cache, "attention_mask": torch.ones(1, 11, dtype=torch.long),
                             "use_cache": True}
    with head_verification(model):
        drafted, _ = proposer.propose(torch.cat([ids, ids[:, :1]], dim=1), 4)
        assert drafted.shape[1] == 15 and cache.get_seq_length() == 14
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference)  # no cache given: not the drafted rows' verification
        assert cache.get_seq_length() == 10
        # Verifying fewer tokens than were drafted (a grammar cut the proposal): the rest leave the cache.
        drafted, _ = proposer.propose(torch.cat([ids, ids[:, :1]], dim=1), 4)
        with torch.no_grad():
            logits = model(drafted[:, 10:13], past_key_values=cache, use_cache=True).logits
        assert cache.get_seq_length() == 13 and logits.shape[1] == 3
        plain = DynamicCache(config=model.config)
        with torch.no_grad():
            model(drafted[:, :13], past_key_values=plain, use_cache=True)
            nxt = drafted[:, 13:14]
            assert torch.allclose(model(nxt, past_key_values=cache).logits, model(nxt, past_key_values=plain).logits,
                                  atol=1e-5)
    assert "forward" not in model.model.__dict__
    reuse(model)
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(ids, max_new_tokens=20, do_sample=False, draft=make_head_draft(model), speculation=ALWAYS,
                       stopping_criteria=[_Boom(after=3)])
    assert "forward" not in model.model.__dict__


class _Boom:
    def __init__(self, after: int) -> None:
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_the_vocabulary_subset_and_bad_arguments(reuse):
    model = make_tiny("qwen2", seed=2)
    tokenizer = make_tiny_tokenizer()
    texts = [words(random_ids(60, 900 + k)) for k in range(4)]
    draft = make_head_draft(model, 40, tokenizer=tokenizer, texts=texts, head_bits=4)
    assert isinstance(draft, HeadDraft) and draft.draft_name == "head-int4-vocab40"
    assert draft.head.tokens.numel() >= 40 and {0, 1, 2} <= set(draft.head.tokens.tolist())
    with pytest.raises(ValueError, match="head_bits"):
        make_head_draft(model, head_bits=3)
    with pytest.raises(ValueError, match="tokenizer"):
        make_head_draft(model, 40)
    reuse(model)
    wider = make_head_draft(make_tiny("qwen2", seed=2, vocab_size=128))
    with pytest.raises(ValueError, match="built for"):
        model.generate(random_ids(8, 1), max_new_tokens=4, draft=wider)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        model.generate(random_ids(8, 1), max_new_tokens=4, draft=draft, prompt_lookup_num_tokens=3)
