"""A grammar mask under speculative decoding: every draft kind, greedy and sampled, gives what decoding
without a draft gives, and the reply is valid JSON.

transformers' assisted decoding runs the target's processors once per candidate position (and hands
them to a model draft's own generate), so a matcher that advanced once per call stepped onto draft
tokens the target later rejected: 500 "token N breaks the grammar" on every structured request.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvboost_hf import (ChunkStore, ControllerSettings, disable_chunk_reuse, enable_chunk_reuse, kernels,
                        last_request_stats, make_draft, make_head_draft)
from kvboost_hf.kernels.layer import KernelLayerMixin
from kvboost_hf.server.decoding.structured import GrammarCompilers
from tests.conftest import VOCAB, make_tiny
from tests.server.decoding.test_grammar_mask import SCHEMA, char_tokenizer, decode

ALWAYS = ControllerSettings(adaptive=False, max_tokens=6, start_tokens=1, probe_tokens=1)
ARRAY = {"type": "array", "items": {"type": "object", "properties": {"tag": {"enum": ["ab", "cd"]}},
                                    "required": ["tag"], "additionalProperties": False}, "maxItems": 6}


@pytest.fixture(scope="module")
def setup():
    return char_tokenizer(), GrammarCompilers()


def _generate(model, grammars, tokenizer, schema, prompt, **kwargs):
    mask = grammars.json_processor(tokenizer, VOCAB, [2], schema)
    return model.generate(prompt, max_new_tokens=60, eos_token_id=2, pad_token_id=0, logits_processor=[mask],
                          **kwargs)[0, prompt.shape[1]:].tolist()


def _valid(tokenizer, reply: list[int], schema) -> None:
    assert 2 in reply, "the grammar ended with the stop token"
    jsonschema.validate(json.loads(decode(tokenizer, reply[: reply.index(2)])), schema)


@pytest.mark.parametrize("family, seed", [("llama", 1), ("qwen2", 2), ("gemma3", 3)])
@pytest.mark.parametrize("schema", [SCHEMA, ARRAY], ids=["record", "array"])
def test_greedy_structured_replies_are_the_same_with_every_draft(setup, family, seed, schema):
    _assert_drafts_keep_the_plain_reply(setup, make_tiny(family, seed=seed), schema, bits=8)


def _assert_drafts_keep_the_plain_reply(setup, model, schema, bits: int) -> None:
    """Greedy structured replies with prompt lookup, store-wide drafts, a ``bits`` self-draft and a head draft (each
    drafting every round) are the reply without a draft, which is valid."""
    tokenizer, grammars = setup
    prompt = torch.tensor([[1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7]])
    plain = _generate(model, grammars, tokenizer, schema, prompt, do_sample=False)
    _valid(tokenizer, plain, schema)
    enable_chunk_reuse(model, ChunkStore(max_bytes=20_000_000, chunk_size=8))
    try:
        for draft in ("prompt-lookup", "store", make_head_draft(model), make_draft(model, bits=bits)):
            for _ in range(2):  # the second run of "store" drafts the first run's reply
                out = _generate(model, grammars, tokenizer, schema, prompt, do_sample=False, draft=draft,
                                speculation=ALWAYS)
                assert out == plain, getattr(draft, "draft_name", draft)
        assert last_request_stats(model).speculation.drafted_tokens > 0  # the self-draft did draft
    finally:
        disable_chunk_reuse(model)


def test_sampled_structured_replies_are_valid_and_seeded_with_every_draft(setup):
    tokenizer, grammars = setup
    model = make_tiny("llama", seed=5)
    prompt = torch.tensor([[1, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    enable_chunk_reuse(model, ChunkStore(max_bytes=20_000_000, chunk_size=8))
    try:
        replies = []
        for draft in ("prompt-lookup", "store", make_draft(model, bits=8), make_head_draft(model)):
            torch.manual_seed(11)
            out = _generate(model, grammars, tokenizer, SCHEMA, prompt, do_sample=True, temperature=1.5, top_k=0,
                            draft=draft, speculation=ALWAYS)
            _valid(tokenizer, out, SCHEMA)
            replies.append(out)
        assert all(reply == replies[0] for reply in replies)
    finally:
        disable_chunk_reuse(model)


def test_a_draft_is_cut_where_the_grammar_stops_accepting(setup):
    tokenizer, grammars = setup
    mask = grammars.json_processor(tokenizer, VOCAB, [2], SCHEMA)
    prompt = torch.tensor([[1, 3, 4]])
    mask(prompt, torch.zeros(1, VOCAB))
    ids = tokenizer.convert_tokens_to_ids(['{"', "i", "d", '":', "x"])
    assert mask.allowed_prefix(prompt, ids) == 4  # '{"id":' continues the schema, 'x' does not
    assert mask.allowed_prefix(prompt, ids[:2]) == 2
    # Asking changed nothing: the mask at the prompt's end still allows only '{' openings.
    allowed = torch.isfinite(mask(prompt, torch.zeros(1, VOCAB))[0]).nonzero().flatten().tolist()
    assert set(tokenizer.convert_ids_to_tokens(allowed)) <= {"{", '{"'}


def test_the_mask_follows_the_tokens_it_is_shown_not_its_call_count(setup):
    """Shown a longer prefix, then a shorter one (as verification then the next round do), the mask at a
    position is the one plain decoding computes there."""
    tokenizer, grammars = setup
    ids = tokenizer.convert_tokens_to_ids(['{"', "i", "d", '":', " ", "1", ",", " ", '"', "t", "a", "g", '":', " ",
                                           '"', "a", "b", '"'])
    prompt = [1, 3, 4]

    def masks(order):
        mask = grammars.json_processor(tokenizer, VOCAB, [2], SCHEMA)
        out = {}
        for n in order:
            row = torch.tensor([prompt + ids[:n]])
            out[n] = torch.isfinite(mask(row, torch.zeros(1, VOCAB))).clone()
            assert mask.rows[0].valid  # every prefix shown is one plain decoding could reach
        return out

    plain = masks(range(len(ids) + 1))
    jumping = masks([0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 4, 9, 10, 2, 11, 6, 17, 18, 12, 1, 14])
    for n, allowed in jumping.items():
        assert torch.equal(allowed, plain[n]), n


@pytest.fixture(scope="module")
def int4_models(tmp_path_factory):
    """Tiny llama and gemma3 packed to int4 and loaded on kvboost_hf's kernels (fused layers where built)."""
    from kvboost_hf.streaming.pack import pack_model
    from tests.streaming.conftest import TINY_GROUP, TINY_LAYERS, load_awq

    models = {}
    for family, seed in (("llama", 1), ("gemma3", 4)):  # seeds whose greedy replies close both schemas in 60 tokens
        path = tmp_path_factory.mktemp(f"awq-{family}")
        pack_model(make_tiny(family, seed=seed, num_layers=TINY_LAYERS), path, group_size=TINY_GROUP)
        models[family] = load_awq(path, residency_mode="full_resident", kernel="auto", dtype=torch.bfloat16)
    return models


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("schema", [SCHEMA, ARRAY], ids=["record", "array"])
def test_an_int4_target_with_its_int4_self_draft_keeps_greedy_structured_replies(setup, int4_models, family, schema):
    """The combination the server runs for an int4 model with --draft int4 and a response_format: an int4
    target on our kernels (row-exact verification), its int4 self-draft, and the grammar mask."""
    model = int4_models[family]
    _assert_drafts_keep_the_plain_reply(setup, model, schema, bits=4)
    assert all(isinstance(layer, KernelLayerMixin) for layer in model.model.layers) or not kernels.available().built
