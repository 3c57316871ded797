"""Model drafts: HF's own ``AssistedCandidateGenerator`` driven one draft length at a time, with reuse.

The assistant's prompt prefill goes through the store like any request (the draft model has its
own namespace, since its weights differ): the generator's assistant cache is replaced by a
fresh :class:`~kvboost_hf.ChunkReuseCache` before the first round. At the end of the request
only the tokens the target confirmed are stored for the draft; rejected candidates never are.
With the adaptive controller, HF's confidence stop is off: the controller owns the draft length.
"""

from __future__ import annotations

import logging

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.kernels.plan import plan_held
from kvboost_hf.models.fingerprint import UnfingerprintableModel
from kvboost_hf.models.namespace import namespace
from kvboost_hf.reuse import commit_request, reuse_state
from kvboost_hf.speculative.shared_prompt import prompt_donor
from kvboost_hf.store.index import common_prefix_length
from kvboost_hf.store.scope import CacheScope

logger = logging.getLogger(__name__)


class ModelProposer:
    """Drafts ``k`` tokens with an assistant model through HF's generator (``k = 0``: no draft call)."""

    def __init__(self, inner: AssistedCandidateGenerator, name: str = "model", owns_length: bool = True,
                 scope: CacheScope | None = None, target=None, target_cache=None) -> None:
        self.name = name
        self.inner = inner
        if owns_length:
            # The controller chooses each round's length from measured acceptance and costs. HF's
            # confidence stop (end a round early when the draft's top probability is under a
            # threshold) would cut that length short behind the controller's back: with an accurate
            # draft it stopped rounds at ~2 tokens where 8 were accepted.
            inner.generation_config.assistant_confidence_threshold = 0.0
            inner.assistant_generation_config.assistant_confidence_threshold = 0.0
        prepare = getattr(inner, "_prepare_generation_args", None)
        if prepare is not None and not _sets_a_minimum(getattr(inner.assistant_model, "generation_config", None)):
            inner._prepare_generation_args = _without_zero_min_new_tokens(prepare)
        self.cache: ChunkReuseCache | None = None
        self._stored: int | None = None
        state = reuse_state(inner.assistant_model)
        if state is not None:
            self.cache = ChunkReuseCache(inner.assistant_model.config, state.store)
            self.cache.scope = scope  # the draft's prefill reads and feeds the request's own entries only
            self.cache.activate_past_recording()
            inner.assistant_kwargs["past_key_values"] = self.cache
        # A self-draft of the target starts from the target's prompt K/V (shared_prompt.py).
        self.donor = None if target is None else prompt_donor(target, inner.assistant_model, target_cache, self.cache)
        self.given = 0  # prompt tokens whose K/V the target gave

    @property
    def takes_prompt_from_target(self) -> bool:
        """Whether the draft waits for the target's prefill to take its prompt K/V from (round 0 should not
        draft: the draft would have to forward the whole prompt itself)."""
        return self.donor is not None and self.donor.cache.get_seq_length() == 0

    def _take_prompt(self, input_ids: torch.LongTensor) -> None:
        if self.donor is None:
            return
        if self.cache.get_seq_length() or self.cache.request is not None:
            self.donor = None  # the draft began on its own: its cache is its own from here
            return
        self.given = self.donor.give(self.cache, input_ids)
        if self.given:
            self.donor = None
            logger.debug("the draft took %d prompt tokens' K/V from the target's cache", self.given)

    def propose(self, input_ids: torch.LongTensor, k: int):
        self._take_prompt(input_ids)
        self.inner.num_assistant_tokens = k
        with plan_held(self.inner.assistant_model.get_decoder()):  # its layers checked once a round
            return self.inner.get_candidates(input_ids)

    def update(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        self.inner.update_candidate_strategy(input_ids, scores, num_matches)

    def unseen(self, input_ids: torch.LongTensor) -> int:
        """Tokens the assistant must forward before drafting: those it has no K/V for yet, less (before
        its first round) the prompt prefix the store holds for it, which is loaded, not computed."""
        self._take_prompt(input_ids)
        cache = self.inner.assistant_kwargs.get("past_key_values")
        held = cache.get_seq_length() if cache is not None else 0
        if held == 0 and self.cache is not None and self.cache.store is not None:
            held = self._stored_prefix(input_ids)
        return max(0, input_ids.shape[1] - held)

    def _stored_prefix(self, input_ids: torch.LongTensor) -> int:
        """Asked of the store once per request: the draft stores nothing before the request ends."""
        if self._stored is None:
            try:
                key = namespace(self.inner.assistant_model)
            except UnfingerprintableModel:
                key = None
            scope = self.cache.scope or CacheScope()
            self._stored = 0 if key is None else self.cache.store.stored_prefix_length(
                scope.root(key), input_ids[0].tolist(), shared=scope.shared_root(key))
        return self._stored

    def finish(self, sequence: torch.LongTensor) -> ChunkReuseCache | None:
        """Store the draft's K/V of the tokens the target confirmed (a prefix of ``sequence``)."""
        cache = self.cache
        state = reuse_state(self.inner.assistant_model)
        if cache is None or state is None or cache.request is None:
            return None
        confirmed = common_prefix_length(cache.token_ids(), sequence[0].tolist())
        limit = cache.request.commit_limit
        cache.request.commit_limit = confirmed if limit is None else min(limit, confirmed)
        commit_request(state, cache)
        return cache


def _sets_a_minimum(config) -> bool:
    """Whether a generation config would fill an unset minimum length (generate fills unset fields of
    the config it is given from the model's own): then ``min_new_tokens=0`` must stay, to override it."""
    return bool(getattr(config, "min_new_tokens", None) or getattr(config, "min_length", None))


def _without_zero_min_new_tokens(prepare):
    """HF's ``_prepare_generation_args`` without ``min_new_tokens=0``, which changes nothing but costs.

    generate turns ``min_new_tokens=0`` into ``min_length`` = the prompt length, which installs a
    ``MinLengthLogitsProcessor`` that never fires yet builds a vocabulary-sized mask and copies the
    scores at every draft token: about 1 ms per token with Gemma's 262k vocabulary, ~5% of a draft
    token. A positive minimum (the target's ``min_length`` not reached yet) is passed on unchanged,
    and nothing is dropped for a draft whose own generation config sets a minimum (see
    :func:`_sets_a_minimum`).
    """

    def prepare_args(input_ids, min_new_tokens, max_new_tokens):
        args = prepare(input_ids, min_new_tokens, max_new_tokens)
        if args.get("min_new_tokens") == 0:
            del args["min_new_tokens"]
        return args

    return prepare_args
