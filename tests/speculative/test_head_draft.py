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


def _layer_rows(model) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
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


class _CutAfterTwo:
    """A draft constraint (as a grammar mask is one) that lets two draft tokens through per round; masks nothing."""

    def __call__(self, input_ids, scores):
        return scores

    def allowed_prefix(self, input_ids, draft) -> int:
        return min(len(draft), 2)


def _tracked_at_commit(monkeypatch) -> list:
    import kvboost_hf.generation.wrapper as wrapper

    seen, commit = [], wrapper.commit_request
    monkeypatch.setattr(wrapper, "commit_request", lambda state, cache: seen.append(
        (cache.get_seq_length(), cache.token_ids())) or commit(state, cache))
    return seen


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_limits_stop_the_draft_before_a_refused_token_is_forwarded(family, reuse, monkeypatch):
    """A constraint refusing drafts (a grammar) is asked before each drafted token is forwarded, so the verified
    tokens are always the forwarded ones (+ the last): nothing is cropped behind the cache's token tracking. Past
    the sliding window, with a head of other weights (rejections after the cut), on the store the request fed."""
    model, other = make_tiny(family, seed=2), make_tiny(family, seed=9)
    ids = _prompt(3)  # 22 tokens: past the tiny sliding window (16)
    limits = dict(max_new_tokens=30, do_sample=False, logits_processor=[_CutAfterTwo()])
    plain = model.generate(ids, **limits)
    reuse(model)
    seen, shapes = _tracked_at_commit(monkeypatch), []
    verify = DraftedRows.verify
    monkeypatch.setattr(DraftedRows, "verify", lambda self, forward, kwargs, config: shapes.append(
        (kwargs["input_ids"].shape[1], len(self.tokens))) or verify(self, forward, kwargs, config))
    for head in (make_head_draft(model), make_head_draft(other)):
        out = model.generate(ids, draft=head, speculation=ALWAYS, **limits)
        assert torch.equal(out, plain)
        rows, tracked = seen[-1]
        assert tracked == out[0, :rows].tolist()  # the store is fed the tokens its K/V belong to
    assert shapes and all(given - drafted in (0, 1) for given, drafted in shapes)
    assert any(given == drafted for given, drafted in shapes)  # a round the limit ended: no decoder forward
    later = torch.cat([out[:, :40], random_ids(3, 8)], dim=1)  # served from what the head-draft requests stored
    fresh = model.generate(later, max_new_tokens=8, do_sample=False)
    assert last_request_stats(model).reused_tokens > 20
    reuse(model)
    assert torch.equal(fresh, model.generate(later, max_new_tokens=8, do_sample=False))


def test_a_decoder_called_positionally_still_takes_the_rows(reuse, monkeypatch):
    """GPT-J's CausalLM passes input_ids to its decoder positionally: the rows are still used, tracked right."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(2)
    model = GPTJForCausalLM(GPTJConfig(vocab_size=96, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256,
                                       bos_token_id=1, eos_token_id=2)).eval()
    model.generation_config.pad_token_id = 0
    ids = _prompt(3)
    plain = model.generate(ids, max_new_tokens=30, do_sample=False)
    reuse(model)
    seen, rows = _tracked_at_commit(monkeypatch), []
    handle = model.get_decoder().h[0].register_forward_pre_hook(lambda _m, args, _kw: rows.append(args[0].shape[1]),
                                                                with_kwargs=True)
    try:
        out = model.generate(ids, max_new_tokens=30, do_sample=False, draft=make_head_draft(model), speculation=ALWAYS)
    finally:
        handle.remove()
    assert torch.equal(out, plain) and set(rows[1:]) == {1}
    assert seen[-1][1] == out[0, : seen[-1][0]].tolist()


def test_requests_for_per_layer_outputs_get_them_from_plain_rounds(reuse):
    model = make_tiny("llama", seed=2)
    ids = _prompt(4)
    kw = dict(max_new_tokens=8, do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    plain = model.generate(ids, **kw)
    reuse(model)
    out = model.generate(ids, draft=make_head_draft(model), speculation=ALWAYS, **kw)
    assert torch.equal(out.sequences, plain.sequences)
    assert [h[-1].shape for h in out.hidden_states] == [h[-1].shape for h in plain.hidden_states]
    assert last_request_stats(model).speculation.drafted_tokens == 0  # its rows carry no per-layer outputs


def test_int4_targets_on_the_kernels_keep_greedy_replies(reuse, tmp_path):
    """An int4 target (bf16, fused layers where built, attention routed per row): drafted rows are its
    decode steps' rows, verified by its head alone."""
    from kvboost_hf.streaming.pack import pack_model
    from tests.streaming.conftest import TINY_GROUP, TINY_LAYERS, load_awq

    for family, seed, residency in (("llama", 1, "full_resident"), ("gemma3", 4, "full_resident"),
                                    ("gemma3", 4, "partial_resident")):  # streamed: layers read again per token
        if not (tmp_path / family).exists():
            pack_model(make_tiny(family, seed=seed, num_layers=TINY_LAYERS), tmp_path / family, group_size=TINY_GROUP)
        settings = {"keep_first_k": 1, "keep_last_k": 1} if residency == "partial_resident" else {}
        model = load_awq(tmp_path / family, residency_mode=residency, kernel="auto", dtype=torch.bfloat16, **settings)
        ids = _prompt(7)
        plain = model.generate(ids, max_new_tokens=40, do_sample=False)
        reuse(model)
        draft = make_head_draft(model)
        for _ in range(2):  # the second from the store
            out = model.generate(ids, max_new_tokens=40, do_sample=False, draft=draft, speculation=ALWAYS)
            assert torch.equal(out, plain), (family, residency)
        stats = last_request_stats(model)
        assert stats.reused_tokens > 0 and stats.speculation.accepted_tokens > 10, (family, residency)


def test_int4_rounds_run_as_one_op_call_with_the_loops_reply(reuse, tmp_path, monkeypatch):
    """On a fused int4 target a plain round is one ``draft_round`` call (kernels.draft_round): the reply and the rows
    the verification takes are the token-by-token loop's. A draft constraint (limits to ask before each token), or a
    forward a user set on the decoder, keeps the loop; the reply is the same."""
    from kvboost_hf.speculative import head_draft
    from kvboost_hf.streaming.pack import pack_model
    from tests.streaming.conftest import TINY_GROUP, TINY_LAYERS, load_awq

    pack_model(make_tiny("gemma3", seed=4, num_layers=TINY_LAYERS), tmp_path, group_size=TINY_GROUP)
    model = load_awq(tmp_path, residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    ids = _prompt(11)
    plain = model.generate(ids, max_new_tokens=40, do_sample=False)
    reuse(model)
    draft, rounds, taken = make_head_draft(model), [], []
    real = head_draft.draft_round
    monkeypatch.setattr(head_draft, "draft_round", lambda *args: taken.append(real(*args)) or taken[-1])
    verify = DraftedRows.verify
    monkeypatch.setattr(DraftedRows, "verify", lambda self, *args: rounds.append(
        (list(self.tokens), self.hidden.clone())) or verify(self, *args))

    def run(**kwargs):
        rounds.clear(), taken.clear()
        out = model.generate(ids, max_new_tokens=40, do_sample=False, draft=draft, speculation=ALWAYS, **kwargs)
        assert torch.equal(out, plain)
        return list(rounds), sum(r is not None for r in taken)

    fused, calls = run()
    assert calls >= 4 and len(fused) >= calls
    monkeypatch.setattr(HeadProposer, "fused_rounds", False)
    loop, calls = run()
    assert calls == 0 and len(loop) == len(fused)
    assert all(a == c and torch.equal(b, d) for (a, b), (c, d) in zip(fused, loop))  # the same rows, bit for bit
    monkeypatch.setattr(HeadProposer, "fused_rounds", True)
    assert run(logits_processor=[_CutAfterTwo()])[1] == 0  # (masks nothing: the reply stays plain decoding's)
    decoder = model.get_decoder()
    decoder.forward = decoder.forward  # an instance forward of the user's (as accelerate sets one)
    try:
        assert run()[1] == 0
    finally:
        del decoder.forward


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
        # A forward of fewer tokens than were drafted: the draft's rows leave, the forward runs as it would.
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
    with head_verification(model):  # drafting that raises takes its rows with it
        calls = []
        next_token = proposer.draft.next_token
        proposer.draft.next_token = lambda h: next_token(h) if calls.append(1) or len(calls) < 3 else 1 / 0
        assert cache.get_seq_length() == 14
        with pytest.raises(ZeroDivisionError):
            proposer.propose(drafted[:, :15], 4)
        assert len(calls) == 3 and cache.get_seq_length() == 14
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
    ids = random_ids(8, 1)
    plain = model.generate(ids, max_new_tokens=6, do_sample=False, draft="prompt-lookup")
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=draft), plain)
    assert last_request_stats(model).speculation.draft == "head-int4-vocab40"
    with pytest.raises(ValueError, match="either draft= or assistant_model="):
        model.generate(ids, max_new_tokens=4, draft="store", assistant_model=draft)
