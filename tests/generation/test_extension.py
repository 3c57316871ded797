"""The generate extension point: an extension joins a generate call only through its protocol."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.generation import register_extension, unregister_extension
from kvboost_hf.generation.extension import extensions
from tests.conftest import make_tiny, random_ids


class RecordingSession:
    def __init__(self, log: list, tag: str) -> None:
        self.log, self.tag = log, tag

    @contextlib.contextmanager
    def around(self):
        self.log.append(("enter", self.tag))
        yield
        self.log.append(("exit", self.tag))

    def candidate_generator(self, model, generator, generation_config, input_ids, logits_processor, tokenizer):
        self.log.append(("candidates", type(generator).__name__, logits_processor is not None))
        return generator

    def finish(self, output, stats):
        self.log.append(("finish", tuple(output.shape), stats))


class TagExtension:
    """Takes part when generate is called with ``tag=...`` (and pops it, so generate never sees it)."""

    def __init__(self) -> None:
        self.log: list = []

    def open(self, model, kwargs, inputs):
        tag = kwargs.pop("tag", None)
        return None if tag is None else RecordingSession(self.log, tag)


@pytest.fixture
def tag_extension():
    extension = TagExtension()
    register_extension("test-tag", extension)
    yield extension
    unregister_extension("test-tag")


def test_an_extension_wraps_the_call_sees_the_stats_and_changes_nothing(tag_extension):
    model = make_tiny("llama")
    ids = random_ids(24, 3)
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8))
    try:
        out = model.generate(ids, max_new_tokens=6, do_sample=False, tag="a")
        assert torch.equal(out, expected)
        assert [entry[0] for entry in tag_extension.log] == ["enter", "exit", "finish"]
        finish = tag_extension.log[-1]
        assert finish[1] == tuple(expected.shape)
        assert finish[2] is last_request_stats(model)  # the request's own stats, before they are stored
        tag_extension.log.clear()
        model.generate(ids, max_new_tokens=2, do_sample=False)  # no tag: the extension stays out
        assert tag_extension.log == []
    finally:
        disable_chunk_reuse(model)


def test_an_extension_is_asked_for_the_candidate_generator_of_assisted_decoding(tag_extension):
    model = make_tiny("llama")
    ids = torch.cat([random_ids(12, 4)] * 3, dim=1)  # repeats: prompt lookup finds candidates
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8))
    try:
        out = model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=4, tag="b")
    finally:
        disable_chunk_reuse(model)
    assert torch.equal(out, expected)
    asked = [entry for entry in tag_extension.log if entry[0] == "candidates"]
    assert asked and asked[0][2], "the session gets transformers' generator and its logits processors"


def test_extensions_load_lazily_and_register_in_order():
    unregister_extension("test-b")
    calls = []

    def factory():
        calls.append("built")
        return TagExtension()

    register_extension("test-b", factory)
    try:
        assert calls == []
        names = [type(e).__name__ for e in extensions()]
        assert calls == ["built"] and names[-1] == "TagExtension"
        extensions()
        assert calls == ["built"]  # resolved once
        assert "SpeculativeExtension" in names  # registered by the package's entry point
    finally:
        unregister_extension("test-b")
