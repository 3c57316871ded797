"""The grammar mask inside plain ``model.generate`` on a tiny random model with a character vocabulary:
random weights, sampling, batch rows with different prompts, reuse on: every row is schema-valid JSON."""

from __future__ import annotations

import json
import string

import jsonschema
import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse
from kvboost_hf.server.decoding.processors import LogitBias
from kvboost_hf.server.decoding.structured import GrammarCompilers, response_format_schema
from tests.conftest import VOCAB, make_tiny

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["ab", "cd"]},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}


def char_tokenizer():
    """Special tokens, JSON punctuation, digits, letters and a few multi-character pieces: 96 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = list('{}[]":,. -') + list(string.digits) + list(string.ascii_lowercase) + ['{"', '":', '",', "true", "false"]
    pieces += [f"x{i}" for i in range(VOCAB - 3 - len(pieces))]
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{p: i + 3 for i, p in enumerate(pieces)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def grammar_setup():
    tokenizer = char_tokenizer()
    return tokenizer, GrammarCompilers()


def decode(tokenizer, ids: list[int]) -> str:
    return "".join(tokenizer.convert_ids_to_tokens([i for i in ids if i > 2]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_batch_rows_are_valid_json(grammar_setup, seed):
    tokenizer, grammars = grammar_setup
    model = make_tiny("llama", seed=seed)
    mask = grammars.json_processor(tokenizer, VOCAB, [2], SCHEMA)
    prompts = torch.tensor([[1, 40, 41, 42, 43], [1, 50, 51, 52, 53]])
    torch.manual_seed(seed)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=60, do_sample=True,
                         temperature=1.5, top_k=0, logits_processor=[mask, LogitBias({5: 50.0})],
                         eos_token_id=2, pad_token_id=0)
    for row in out[:, prompts.shape[1]:].tolist():
        assert 2 in row, "the grammar ended and allowed only the stop token"
        jsonschema.validate(json.loads(decode(tokenizer, row[: row.index(2)])), SCHEMA)


def test_with_reuse_the_constrained_reply_is_the_same(grammar_setup):
    """Reuse changes nothing under the mask: the second (reused) run gives the same greedy tokens."""
    tokenizer, grammars = grammar_setup
    model = make_tiny("qwen2", seed=4)
    prompt = torch.tensor([list(range(3, 3 + 40))])
    plain = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=0,
                           logits_processor=[grammars.json_processor(tokenizer, VOCAB, [2], {"type": "object"})])
    store = ChunkStore(max_bytes=10_000_000, chunk_size=16)
    enable_chunk_reuse(model, store)
    try:
        runs = [model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=0,
                               logits_processor=[grammars.json_processor(tokenizer, VOCAB, [2], {"type": "object"})])
                for _ in range(2)]
    finally:
        disable_chunk_reuse(model)
    assert store.stats()["hit_tokens"] > 0
    assert all(torch.equal(run, plain) for run in runs)
    reply = plain[0, 40:].tolist()
    text = decode(tokenizer, reply[: reply.index(2)] if 2 in reply else reply)
    if 2 in reply:
        assert isinstance(json.loads(text), dict)


def test_response_format_schema_mapping():
    assert response_format_schema(None) is None and response_format_schema({"type": "text"}) is None
    assert response_format_schema({"type": "json_object"}) == {"type": "object"}
    assert response_format_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}) == SCHEMA
    with pytest.raises(ValueError, match="not supported"):
        response_format_schema({"type": "grammar"})
