"""How speculation plugs into generate: the pinned call site, reuse on the draft, telemetry that adds up."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.generation.utils import GenerationMixin

from kvboost_hf import ControllerSettings, last_request_stats, make_draft
from kvboost_hf.models.namespace import namespace
from kvboost_hf.speculative import set_default_draft, speculation_totals
from kvboost_hf.speculative.controller import DraftController
from kvboost_hf.speculative.generator import MeasuredCandidateGenerator
from kvboost_hf.speculative.stats import SpeculationStats
from tests.conftest import make_tiny, random_ids

pytestmark = pytest.mark.usefixtures("one_thread")
ALWAYS = ControllerSettings(adaptive=False, max_tokens=4, start_tokens=1, probe_tokens=1)


def test_transformers_call_site_is_unchanged():
    """Our generator reaches generate through ``self._get_candidate_generator(...)`` in assisted decoding,
    called with these keywords. If transformers changes that, this fails first."""
    source = inspect.getsource(GenerationMixin._assisted_decoding)
    assert "self._get_candidate_generator(" in source
    params = list(inspect.signature(GenerationMixin._get_candidate_generator).parameters)
    assert params[:3] == ["self", "generation_config", "input_ids"]
    assert {"inputs_tensor", "logits_processor", "model_kwargs", "assistant_model"} <= set(params)
    assert "candidate_generator.update_candidate_strategy(input_ids, new_logits, n_matches)" in source
    # A head draft reads generate's model kwargs (its cache) through the path for generators that require model
    # outputs, and its verification forward is the one call of the model in the loop.
    assert "if candidate_generator.requires_model_outputs:" in source and "model_kwargs=model_kwargs," in source
    assert "model_inputs |= candidate_generator.model_kwargs_overrides" in source
    assert source.count("outputs = self(**model_inputs)") == 1
    assert "outputs.past_key_values.crop(-number_of_tokens_to_crop)" in source


def test_generate_uses_the_measured_generator(reuse, monkeypatch):
    model = make_tiny("llama")
    reuse(model)
    seen = []
    original = MeasuredCandidateGenerator.get_candidates

    def spy(self, input_ids, **kwargs):
        seen.append(type(self.proposer).__name__)
        return original(self, input_ids, **kwargs)

    monkeypatch.setattr(MeasuredCandidateGenerator, "get_candidates", spy)
    model.generate(random_ids(12, 1), max_new_tokens=4, do_sample=False, draft="prompt-lookup")
    assert seen and set(seen) == {"LookupProposer"}


def test_telemetry_adds_up_with_the_target_forwards(reuse):
    model = make_tiny("gemma3")
    reuse(model)
    forwards = []
    handle = model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape[1]),
                                             with_kwargs=True)
    ids = torch.cat([random_ids(20, 2), random_ids(20, 2)], dim=1)
    out = model.generate(ids, max_new_tokens=15, do_sample=False, draft="prompt-lookup", speculation=ALWAYS)
    handle.remove()
    spec = last_request_stats(model).speculation
    new = out.shape[1] - ids.shape[1]
    assert spec.rounds == len(forwards)  # one round per target forward
    assert spec.rounds + spec.accepted_tokens == new  # each round: accepted tokens + the target's own
    assert sum(spec.accepted_histogram) == spec.speculative_rounds
    assert sum(a * n for a, n in enumerate(spec.accepted_histogram)) == spec.accepted_tokens
    assert spec.accepted_tokens <= spec.drafted_tokens
    assert 0.0 <= spec.acceptance_rate <= 1.0
    assert sum(n for _, n in spec.choices) == spec.rounds
    d = last_request_stats(model).to_dict()["speculation"]
    assert d["acceptance_rate"] == spec.acceptance_rate and d["tokens_per_round"] == spec.tokens_per_round


def test_adaptive_first_round_is_plain(reuse):
    """The first target forward (the prefill) verifies no draft: the first token comes as without one."""
    model = make_tiny("qwen2")
    reuse(model)
    forwards = []
    handle = model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape[1]),
                                             with_kwargs=True)
    ids = random_ids(30, 3)
    model.generate(ids, max_new_tokens=6, do_sample=False, draft=make_draft(model, bits=8))
    handle.remove()
    assert forwards[0] == ids.shape[1]  # the prompt alone, no candidates appended
    assert last_request_stats(model).speculation.choices[0][0] == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_draft_prefill_comes_from_the_store_and_rejected_tokens_never_reach_it(family, reuse):
    model = make_tiny(family)
    # A weak draft (many rejected candidates) of a twin: a self-draft of `model` itself would take its
    # prompt from model's cache and store nothing (test_shared_prompt.py).
    draft = make_draft(make_tiny(family), bits=4, layers=1)
    store = reuse(model, chunk_size=4)
    ids = random_ids(26, 7)
    first = model.generate(ids, max_new_tokens=12, do_sample=False, draft=draft, speculation=ALWAYS)
    spec = last_request_stats(model).speculation
    assert spec.drafted_tokens > spec.accepted_tokens  # some candidates were rejected
    draft_key = namespace(draft)
    assert draft_key != namespace(model)  # the draft has its own namespace
    confirmed = first[0].tolist()
    for key in (draft_key, namespace(model)):
        chains = store.token_chains(key)
        assert chains
        for _, tokens in chains:
            assert list(tokens) == confirmed[: len(tokens)]  # only confirmed tokens were stored
    second = model.generate(ids, max_new_tokens=12, do_sample=False, draft=draft, speculation=ALWAYS)
    assert torch.equal(first, second)
    spec = last_request_stats(model).speculation
    assert spec.draft_reused_tokens >= 24, spec  # the draft's prompt K/V came from the store
    assert last_request_stats(model).reused_tokens >= 24


def test_vocabulary_mismatch_is_a_clear_error(reuse):
    model = make_tiny("llama")
    reuse(model)
    other = make_tiny("llama", seed=1, vocab_size=120)
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate(random_ids(8, 1), max_new_tokens=2, draft=other)
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate(random_ids(8, 1), max_new_tokens=2, assistant_model=other)
    with pytest.raises(ValueError, match="draft='nope'"):
        model.generate(random_ids(8, 1), max_new_tokens=2, draft="nope")
    with pytest.raises(TypeError, match="draft must be"):
        model.generate(random_ids(8, 1), max_new_tokens=2, draft=3)
    with pytest.raises(ValueError, match="not both"):
        model.generate(random_ids(8, 1), max_new_tokens=2, draft="store", assistant_model=other)
    with pytest.raises(TypeError, match="speculation"):
        model.generate(random_ids(8, 1), max_new_tokens=2, draft="store", speculation=4)


def test_default_draft_and_totals(reuse):
    model = make_tiny("mistral")
    ids = torch.cat([random_ids(16, 9), random_ids(16, 9)], dim=1)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match="enable_chunk_reuse"):
        set_default_draft(model, "store")
    reuse(model)
    set_default_draft(model, "store", ALWAYS)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref)
    assert last_request_stats(model).speculation.draft == "store"
    model.generate(ids, max_new_tokens=8, do_sample=False)
    totals = speculation_totals(model).to_dict()
    assert totals["requests"] == 2 and totals["accepted_tokens"] > 0
    assert totals["rounds"] >= 2 and sum(totals["accepted_histogram"]) == totals["speculative_rounds"]
    with pytest.raises(ValueError, match="vocabulary"):
        set_default_draft(model, make_tiny("mistral", vocab_size=50))
    set_default_draft(model, None)
    model.generate(ids, max_new_tokens=3, do_sample=False)
    assert last_request_stats(model).speculation is None


class _CatchingUpProposer:
    """A model-draft stand-in: proposing forwards every token it had not seen yet."""

    name = "stand-in"
    takes_prompt_from_target = False

    def __init__(self) -> None:
        self.seen = 0

    def unseen(self, input_ids: torch.LongTensor) -> int:
        return input_ids.shape[1] - self.seen

    def propose(self, input_ids: torch.LongTensor, k: int):
        self.seen = input_ids.shape[1] + k
        return torch.cat([input_ids, torch.zeros(1, k, dtype=input_ids.dtype)], dim=1), None

    def update(self, input_ids, scores, num_matches) -> None:
        return None

    def finish(self, sequence) -> None:
        return None


class _Recording(DraftController):
    def __init__(self) -> None:
        super().__init__()
        self.observed: list[tuple[int, int]] = []

    def observe(self, drafted, accepted, draft_ms, verify_ms, unseen=0) -> None:
        self.observed.append((drafted, unseen))
        super().observe(drafted, accepted, draft_ms, verify_ms, unseen)


def test_the_catch_up_is_counted_before_the_draft_forwards_it():
    """The first drafting round of a request catches the draft up on the whole prompt. The controller
    does not ask for that count when it has no catch-up cost yet, and after proposing nothing is unseen:
    the count must still reach it, or the catch-up cost is never learnt (every later request paid it)."""
    controller = _Recording()
    generator = MeasuredCandidateGenerator(_CatchingUpProposer(), controller, SpeculationStats(), max_length=200)
    ids = random_ids(40, 3)
    for _ in range(4):
        candidates, _ = generator.get_candidates(ids)
        drafted = candidates.shape[1] - ids.shape[1]
        generator.update_candidate_strategy(candidates, torch.zeros(1, drafted + 1, 8), drafted)
        ids = torch.cat([candidates, torch.zeros(1, 1, dtype=ids.dtype)], dim=1)
    first_draft = next(i for i, (drafted, _) in enumerate(controller.observed) if drafted)
    assert controller.observed[first_draft][1] == 40 + first_draft  # the prompt and the plain rounds' tokens
    assert controller.catch_up_ms_per_token.value is not None
    assert all(unseen <= 2 for drafted, unseen in controller.observed[first_draft + 1:] if drafted)
