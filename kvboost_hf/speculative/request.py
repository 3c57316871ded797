"""One generate call's speculation: read the ``draft`` argument, build the candidate generator, finish up.

``model.generate(ids, draft=...)`` on a model with chunk reuse enabled accepts:

- ``"prompt-lookup"``: continuations of n-grams of this request (prompt and reply so far);
- ``"store"``: the same, plus continuations found in every sequence the store holds;
- a model (an HF assistant sharing the tokenizer, or :func:`~kvboost_hf.make_draft`'s self-draft);
- a :class:`~kvboost_hf.speculative.head_draft.HeadDraft` (:func:`~kvboost_hf.make_head_draft`): the
  target's own layers with a small head, verified by the target's LM head alone.

``assistant_model=`` is treated like ``draft=<model>``; HF's ``prompt_lookup_num_tokens`` alone
keeps HF's generator and only gains telemetry. ``speculation=ControllerSettings(...)`` tunes the
adaptive draft length. The generator reaches generate through the speculation session
(:mod:`kvboost_hf.speculative.extension`), a generate extension of :mod:`kvboost_hf.generation`.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator, CandidateGenerator

from kvboost_hf.generation import enable_chunk_reuse
from kvboost_hf.generation.sequence import longest_sequence
from kvboost_hf.models.fingerprint import UnfingerprintableModel
from kvboost_hf.models.namespace import namespace
from kvboost_hf.models.rope import length_dependent_rope
from kvboost_hf.reuse import reuse_state
from kvboost_hf.speculative.controller import ControllerSettings, DraftController
from kvboost_hf.speculative.draft_limits import draft_limits
from kvboost_hf.speculative.generator import FixedProposer, MeasuredCandidateGenerator
from kvboost_hf.speculative.head_draft import HeadDraft, HeadProposer
from kvboost_hf.speculative.lookup import LazyStoreNgrams, LookupProposer, store_ngrams
from kvboost_hf.speculative.model_draft import ModelProposer
from kvboost_hf.speculative.model_state import model_state
from kvboost_hf.speculative.ngram import LookupSettings
from kvboost_hf.speculative.seeded import PositionGumbel, request_seed
from kvboost_hf.speculative.stats import SpeculationStats
from kvboost_hf.store.scope import CacheScope, as_scope

logger = logging.getLogger(__name__)

LOOKUP_DRAFTS = ("prompt-lookup", "store")
_store_followers: weakref.WeakSet = weakref.WeakSet()  # drafts whose reuse was enabled with the target's store
_plain_rope_models: weakref.WeakSet = weakref.WeakSet()  # models told once that their RoPE rules out drafts


@dataclass
class SpeculationRequest:
    kind: str  # "prompt-lookup", "store", "model", "head" or "hf" (HF's own generator, telemetry only)
    settings: ControllerSettings
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    proposer: object = None
    controller: DraftController | None = None
    memory_key: object = None  # which earlier requests' costs this one starts from
    exact_rows: bool = False  # verification forwards route attention per row (exact_rows.py)
    scope: CacheScope | None = None  # the call's cache_salt: store-wide drafts read only its own entries
    stopping_criteria: list = field(default_factory=list)  # the caller's, asked about drafts if side-effect free
    head_draft: HeadDraft | None = None  # kind "head": the draft's head


def prepare(model: torch.nn.Module, kwargs: dict, inputs: torch.Tensor | None = None) -> SpeculationRequest | None:
    """Pop ``draft`` / ``speculation`` from generate's ``kwargs`` and set HF's arguments that select
    assisted decoding; None when the call does not speculate. A call naming no draft, assistant or
    prompt lookup uses the model's default draft (:func:`set_default_draft`), if any and if the call
    can speculate (one sequence of ``inputs``, no beam search)."""
    request = _prepare(model, kwargs, inputs)
    if request is not None:
        request.stopping_criteria = list(kwargs.get("stopping_criteria") or ())
        request.scope = as_scope(kwargs.get("cache_salt"))
    return request


def _prepare(model: torch.nn.Module, kwargs: dict, inputs: torch.Tensor | None) -> SpeculationRequest | None:
    draft = kwargs.pop("draft", None)
    settings = kwargs.pop("speculation", None)
    assistant = kwargs.get("assistant_model")
    if isinstance(assistant, HeadDraft):  # not a model transformers can run: taken as draft= is
        if draft is not None:
            raise ValueError("pass either draft= or assistant_model=, not both")
        draft, assistant = kwargs.pop("assistant_model"), None
    if draft is None and assistant is None:
        config = kwargs.get("generation_config") or model.generation_config
        if (kwargs.get("prompt_lookup_num_tokens", getattr(config, "prompt_lookup_num_tokens", None)) is not None
                and _decodes_plain(model, kwargs, inputs)):
            return None
        if kwargs.get("prompt_lookup_num_tokens") is not None:
            return SpeculationRequest("hf", _settings(settings), SpeculationStats(draft="hf-prompt-lookup"))
        state = reuse_state(model)
        defaults = model_state(state) if state is not None else None
        if defaults is None or defaults.default_draft is None or not _can_speculate(inputs, kwargs):
            return None
        draft, settings = defaults.default_draft, settings if settings is not None else defaults.default_settings
    settings = _settings(settings, lookup=isinstance(draft, str))
    if draft is not None and assistant is not None:
        raise ValueError("pass either draft= or assistant_model=, not both")
    if isinstance(draft, (str, HeadDraft)):
        validate_draft(model, draft)
        if kwargs.get("prompt_lookup_num_tokens") is not None:
            name = getattr(draft, "draft_name", draft)
            raise ValueError(f"draft={name!r} drafts itself: drop prompt_lookup_num_tokens")
        if _decodes_plain(model, kwargs, inputs):
            return None
        kwargs["prompt_lookup_num_tokens"] = settings.max_tokens  # selects assisted decoding in generate
        if isinstance(draft, HeadDraft):
            return SpeculationRequest("head", settings, SpeculationStats(draft=draft.draft_name),
                                      memory_key=("head", id(draft)), head_draft=draft)
        return SpeculationRequest(draft, settings, SpeculationStats(draft=draft), memory_key=draft)
    assistant = draft if draft is not None else assistant
    if kwargs.get("tokenizer") is None or kwargs.get("assistant_tokenizer") is None:
        validate_draft(model, assistant)
    if _decodes_plain(model, kwargs, inputs):
        return None
    _enable_reuse_on(model, assistant)
    kwargs["assistant_model"] = assistant
    name = getattr(assistant, "draft_name", "model")
    return SpeculationRequest("model", settings, SpeculationStats(draft=name), memory_key=("model", id(assistant)))


def _decodes_plain(model: torch.nn.Module, kwargs: dict, inputs: torch.Tensor | None) -> bool:
    """Whether ``model``'s RoPE rules drafts out for this call (:func:`~kvboost_hf.models.rope.length_dependent_rope`:
    its sequence may pass the original length, where a verification's rows would change keys that plain decoding
    computes otherwise); then generate's ``kwargs`` are left selecting plain decoding, the reply speculation
    promises, and the model's first such call logs why."""
    rope = length_dependent_rope(model.config, longest_sequence(model, inputs, kwargs))
    if rope is None:
        return False
    if model not in _plain_rope_models:
        _plain_rope_models.add(model)
        logger.warning("%s's rope_type %r recomputes its frequencies from the longest position a forward sees, so "
                       "past its original length a verification's rows would change later keys: calls that may pass "
                       "it decode without drafts, as plain generate", type(model).__name__, rope)
    for key in ("assistant_model", "assistant_tokenizer"):
        kwargs.pop(key, None)
    kwargs["prompt_lookup_num_tokens"] = None  # (over a generation config's own: HF's prompt lookup drafts too)
    return True


def _can_speculate(inputs: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether HF's assisted decoding takes this call: batch 1 token ids, no beam search, a cache (a dynamic one:
    transformers refuses assisted decoding without a cache or on a static one)."""
    if inputs is None or inputs.dim() != 2 or inputs.shape[0] != 1 or kwargs.get("inputs_embeds") is not None:
        return False
    config = kwargs.get("generation_config")
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1))
    use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    return beams in (None, 1) and use_cache is not False and implementation in (None, "dynamic")


def validate_draft(model: torch.nn.Module, draft) -> None:
    """Raise a ValueError / TypeError naming ``draft`` when it cannot draft for ``model``."""
    if isinstance(draft, str):
        if draft not in LOOKUP_DRAFTS:
            raise ValueError(f"draft={draft!r}: expected one of {LOOKUP_DRAFTS}, a head draft or a model")
        return
    if isinstance(draft, HeadDraft):
        draft.check(model)
        return
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "generate"):
        raise TypeError(f"draft must be {LOOKUP_DRAFTS[0]!r}, {LOOKUP_DRAFTS[1]!r}, a head draft (make_head_draft) "
                        f"or a generative model, got {type(draft).__name__}")
    check_vocabulary(model, draft)


def check_vocabulary(model: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Raise ValueError when ``draft`` does not score the same token ids as ``model``."""
    ours = model.config.get_text_config(decoder=True).vocab_size
    theirs = draft.config.get_text_config(decoder=True).vocab_size
    if ours != theirs:
        raise ValueError(
            f"draft / assistant_model vocabulary ({theirs} tokens) differs from the model's ({ours} tokens): a draft "
            "must share the tokenizer and vocabulary size (or pass tokenizer= and assistant_tokenizer= for HF's "
            "universal assisted decoding)"
        )


LOOKUP_MAX_TOKENS = 16  # lookup drafts cost nothing to propose: let long copied spans through in one round


def _settings(value, lookup: bool = False) -> ControllerSettings:
    if value is None:
        return ControllerSettings(max_tokens=LOOKUP_MAX_TOKENS) if lookup else ControllerSettings()
    if isinstance(value, ControllerSettings):
        return value
    if isinstance(value, dict):
        return ControllerSettings(**value)
    raise TypeError(f"speculation must be a ControllerSettings or a dict, got {type(value).__name__}")


def _enable_reuse_on(model: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Give the draft the target's store, so its prompt prefill is reused too (its own namespace).

    A draft whose reuse was enabled here follows the target's store when the target moves to
    another one; a draft the caller enabled reuse on keeps its own store."""
    state = reuse_state(model)
    if state is None or draft is model:
        return
    draft_state = reuse_state(draft)
    if draft_state is not None and (draft_state.store is state.store or draft not in _store_followers):
        return
    enable_chunk_reuse(draft, state.store)
    _store_followers.add(draft)


def candidate_generator(model: torch.nn.Module, request: SpeculationRequest, generator: CandidateGenerator,
                        generation_config, logits_processor: list | None = None, tokenizer=None,
                        target_cache=None) -> CandidateGenerator:
    """The generator generate() uses for ``request`` (``generator`` is HF's choice).

    ``logits_processor`` is the list the assisted loop applies (HF's, warpers included),
    ``tokenizer`` generate's ``tokenizer=`` and ``target_cache`` the call's cache (a self-draft of
    ``model`` starts from its prompt K/V). For our drafts, a sampled request is turned into greedy
    decoding of position-seeded Gumbel-perturbed scores (:mod:`.seeded`), and proposals are cut at
    stop strings and grammar constraints (:mod:`.draft_limits`)."""
    limits = None
    if request.kind != "hf":
        limits = draft_limits(logits_processor, getattr(generation_config, "stop_strings", None), tokenizer,
                              request.stopping_criteria)
        if generation_config.do_sample:
            _sample_by_position(generation_config, logits_processor, generator)
        if isinstance(generator, AssistedCandidateGenerator):
            # HF hands the draft's generate the call's stop strings without a tokenizer (it raises); the
            # limits cut the draft at them instead.
            generator.generation_config.stop_strings = None
    if request.kind == "model" and isinstance(generator, AssistedCandidateGenerator):
        proposer = ModelProposer(generator, request.stats.draft, owns_length=request.settings.adaptive,
                                 scope=request.scope, target=model, target_cache=target_cache)
    elif request.kind == "head":
        proposer = HeadProposer(model, request.head_draft, _eos_ids(generation_config), request.exact_rows, limits)
    elif request.kind in LOOKUP_DRAFTS:
        store_index = LazyStoreNgrams(lambda: _store_index(model, request.scope)) if request.kind == "store" else None
        proposer = LookupProposer(LookupSettings(), store_index, _eos_ids(generation_config))
    else:
        proposer = FixedProposer(generator, request.stats.draft or type(generator).__name__)
    request.proposer = proposer
    if not isinstance(proposer, FixedProposer):
        state = reuse_state(model)
        memory = model_state(state).costs.get(request.memory_key) if state is not None else None
        request.controller = DraftController(request.settings, memory)
    return MeasuredCandidateGenerator(proposer, request.controller, request.stats, generation_config.max_length,
                                      exact_rows=request.exact_rows, limits=limits)


def _sample_by_position(generation_config, logits_processor: list | None, generator: CandidateGenerator) -> None:
    """Make this sampled call greedy over position-seeded Gumbel-perturbed scores (see :mod:`.seeded`).

    The assisted loop reads ``generation_config.do_sample`` after asking for the candidate generator
    (pinned by a test), and applies ``logits_processor``, HF's list with the sampling warpers, to
    every verified position; a model draft gets the same noise and greedy drafting."""
    if logits_processor is None:
        raise RuntimeError("transformers did not pass its logits processors to the candidate generator")
    gumbel = PositionGumbel(request_seed())
    logits_processor.append(gumbel)
    generation_config.do_sample = False
    if isinstance(generator, AssistedCandidateGenerator):
        generator.logits_processor = [*generator.logits_processor, gumbel]
        generator.generation_config.do_sample = False


def finish(request: SpeculationRequest, output) -> None:
    """After generate: store the draft's confirmed K/V and fill the draft's reuse counts."""
    proposer = request.proposer
    if proposer is None:
        return
    sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
    if sequences is None:
        return
    request.stats.draft_given_tokens = getattr(proposer, "given", 0)
    draft_cache = proposer.finish(sequences)
    if draft_cache is not None and draft_cache.stats is not None:
        request.stats.draft_reused_tokens = draft_cache.stats.reused_tokens
        request.stats.draft_prompt_tokens = draft_cache.stats.prompt_tokens


def _store_index(model: torch.nn.Module, scope: CacheScope | None = None):
    state = reuse_state(model)
    if state is None:
        return None
    try:
        key = (scope or CacheScope()).root(namespace(model))
    except UnfingerprintableModel as err:
        logger.warning("store-wide drafts fall back to prompt lookup: %s", err)
        return None
    return store_ngrams(state.store, key)


def _eos_ids(generation_config) -> list[int]:
    eos = getattr(generation_config, "_eos_token_tensor", None)
    return [] if eos is None else [int(t) for t in eos.reshape(-1).tolist()]
