"""``draft_round`` (``kernels.draft_round``, ``csrc/draft.cpp``): a head draft's greedy round in one op call gives the
tokens, decoder rows and cache of the same forwards made one token at a time; where a round is not plain, it runs
nothing and leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvboost_hf import kernels, make_head_draft
from kvboost_hf.cache import BufferedCache
from kvboost_hf.kernels.draft_round import draft_round
from kvboost_hf.kernels.plan import plan_held
from kvboost_hf.kernels.rotary import BLOCK
from kvboost_hf.speculative.quantized import BlockedInt8Linear
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import _COMMON, make_tiny, make_tiny_tokenizer, random_ids
from tests.streaming.conftest import TINY_GROUP, TINY_LAYERS, load_awq


@pytest.fixture(scope="module")
def int4_models(tmp_path_factory) -> dict:
    """Tiny int4 models on the kernels (fused decoders): Gemma 3 (scaled embedding, sliding layers of a 16-token
    window) and Llama (a plain embedding)."""
    status = kernels.available()
    assert status.built, status.reason
    out = {}
    for family, seed in (("gemma3", 4), ("llama", 1)):
        path = tmp_path_factory.mktemp(f"draft-round-{family}")
        pack_model(make_tiny(family, seed=seed, num_layers=TINY_LAYERS), path, group_size=TINY_GROUP)
        out[family] = load_awq(path, residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    return out


def _prefilled(model, ids: torch.Tensor, step: bool = True) -> BufferedCache:
    """A cache holding ``ids`` and (``step``) one more token: its buffers then have room (a prefill's are exact)."""
    cache = BufferedCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    if step:
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    return cache


def _inputs(cache, token: int) -> dict:
    """A one-token forward's arguments at the cache's next position, as a head draft's decode step makes them."""
    past = cache.get_seq_length()
    return {"input_ids": torch.tensor([[token]]), "past_key_values": cache, "use_cache": True,
            "attention_mask": torch.ones(1, past + 1, dtype=torch.long), "cache_position": torch.tensor([past])}


def _token_by_token(model, draft, cache, token: int, steps: int, ends: set) -> tuple[list[int], torch.Tensor]:
    """The round as the head draft's loop drafts it: one decoder forward a token, then the head."""
    tokens, rows = [], []
    for _ in range(steps):
        rows.append(model.get_decoder()(**_inputs(cache, token)).last_hidden_state[:, -1:])
        token = draft.next_token(rows[-1])
        tokens.append(token)
        if token in ends:
            break
    return tokens, torch.cat(rows, dim=1)


def _round(model, draft, cache, token: int, steps: int, ends: set):
    head = draft.head
    return draft_round(model.get_decoder(), _inputs(cache, token), steps, head.linear.blocks,
                       None if head.tokens is None else head.tokens.long(), ends)


def _same_cache(a, b) -> bool:
    return a.get_seq_length() == b.get_seq_length() and all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


@pytest.mark.parametrize("family,vocab", [("gemma3", None), ("gemma3", 40), ("llama", None)])
@torch.no_grad()
def test_a_round_gives_the_token_by_token_tokens_rows_and_cache(int4_models, family, vocab):
    model = int4_models[family]
    draft = make_head_draft(model, vocab, tokenizer=make_tiny_tokenizer() if vocab else None)
    assert type(draft.head.linear) is BlockedInt8Linear
    ids = random_ids(13, seed=5)
    for steps in (1, 5, 12):  # 13 + 12 rows: the sliding layers' 16-key window moves within the round
        loop, fused = _prefilled(model, ids), _prefilled(model, ids)
        with plan_held(model.get_decoder()):
            tokens, rows = _token_by_token(model, draft, loop, 7, steps, set())
            got = _round(model, draft, fused, 7, steps, set())
        assert got is not None and got.tokens == tokens and torch.equal(got.hidden, rows), (steps, got)
        assert _same_cache(loop, fused)
        # the next forward, on either cache, reads the same keys
        after = [model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=c).logits for c in (loop, fused)]
        assert torch.equal(*after)


@torch.no_grad()
def test_a_round_stops_after_an_end_token(int4_models):
    model = int4_models["gemma3"]
    draft = make_head_draft(model)
    ids = random_ids(11, seed=8)
    tokens, _ = _token_by_token(model, draft, _prefilled(model, ids), 9, 6, set())
    end = tokens[2]
    expected = tokens[: tokens.index(end) + 1]
    cache = _prefilled(model, ids)
    got = _round(model, draft, cache, 9, 6, {end, 10**6})
    assert got.tokens == expected and got.hidden.shape[1] == len(expected)
    assert cache.get_seq_length() == ids.shape[1] + 1 + len(expected)  # only the forwarded rows were committed


def _hooked(module):
    return module.register_forward_hook(lambda *args: None)


@pytest.mark.parametrize("change", ["embedding hook", "norm hook", "decoder hook", "grad", "masked key",
                                    "other position", "no steps", "too many steps", "empty cache", "no room"])
def test_a_round_that_is_not_plain_runs_nothing(int4_models, change, monkeypatch):
    model = int4_models["gemma3"]
    draft = make_head_draft(model)
    decoder = model.get_decoder()
    calls = []
    op = torch.ops.kvboost.draft_round
    monkeypatch.setattr(torch.ops.kvboost, "draft_round", lambda *args: calls.append(1) or op(*args))
    with torch.no_grad():
        cache = _prefilled(model, random_ids(9, seed=3), step=change != "no room")
    held = [(layer.keys, layer.values) for layer in cache.layers]
    length = cache.get_seq_length()
    inputs, steps, handle = _inputs(cache, 5), 4, None
    if change == "embedding hook":
        handle = _hooked(decoder.embed_tokens)
    elif change == "norm hook":
        handle = _hooked(decoder.norm)
    elif change == "decoder hook":
        handle = decoder.register_forward_pre_hook(lambda *args: None)
    elif change == "masked key":
        inputs["attention_mask"][0, 3] = 0
    elif change == "other position":
        inputs["cache_position"] = inputs["cache_position"] + 1
    elif change == "no steps":
        steps = 0
    elif change == "too many steps":
        steps = BLOCK + 1
    elif change == "empty cache":
        inputs["past_key_values"] = cache = DynamicCache(config=model.config)
        inputs["attention_mask"] = torch.ones(1, 1, dtype=torch.long)
        inputs["cache_position"] = torch.tensor([0])
    try:
        with torch.set_grad_enabled(change == "grad"):
            got = draft_round(decoder, inputs, steps, draft.head.linear.blocks, None, set())
    finally:
        if handle is not None:
            handle.remove()
    assert got is None and calls == []
    if change == "empty cache":
        assert cache.get_seq_length() == 0
        return
    assert cache.get_seq_length() == length
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, held))
    if change == "no room":  # (a prefill's buffers are exact: its next forward refills them, one token at a time)
        return
    with torch.no_grad():  # the same round, plain again, runs
        assert draft_round(decoder, _inputs(cache, 5), 4, draft.head.linear.blocks, None, set()) is not None
    assert calls == [1]


@torch.no_grad()
def test_a_rotary_module_that_rescales_with_the_longest_position_is_not_called_ahead(tmp_path, monkeypatch):
    """Dynamic NTK keeps the largest position it has seen and rescales from it: calling it for a round's positions
    before they are forwarded (a round that stops at an end token forwards fewer) would change later keys. The round
    is refused and the module left as it was; the loop then drafts (found by an adversarial review)."""
    torch.manual_seed(1)
    config = LlamaConfig(num_hidden_layers=TINY_LAYERS, **dict(_COMMON, max_position_embeddings=16),
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    pack_model(LlamaForCausalLM(config).eval(), tmp_path, group_size=TINY_GROUP)
    model = load_awq(tmp_path, residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    decoder, draft = model.get_decoder(), make_head_draft(model)
    cache = _prefilled(model, random_ids(20, seed=5))  # past the 16 original positions
    rotary = decoder.rotary_emb
    seen, frequencies = rotary.max_seq_len_cached, rotary.inv_freq.clone()
    calls = []
    op = torch.ops.kvboost.draft_round
    monkeypatch.setattr(torch.ops.kvboost, "draft_round", lambda *args: calls.append(1) or op(*args))
    with plan_held(decoder):
        assert draft_round(decoder, _inputs(cache, 7), 8, draft.head.linear.blocks, None, set()) is None
    assert calls == [] and rotary.max_seq_len_cached == seen and torch.equal(rotary.inv_freq, frequencies)
    assert cache.get_seq_length() == 21
