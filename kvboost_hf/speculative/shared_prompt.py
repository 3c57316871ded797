"""A self-draft starts from its target's prompt K/V instead of prefilling the prompt itself.

A :func:`~kvboost_hf.make_draft` self-draft runs the target's own decoder layers (all of them, or
the first ``layers``), quantized or not, in the same positions. So when generate has prefilled the
target, the target's cache already holds the K/V the draft would compute for the prompt (the same
bits where the draft's layers compute as the target's: an int4 target's int4 self-draft on this
package's kernels; close to them otherwise). Before its first round the draft's cache is filled
from the target's instead of forwarding the prompt: on a long document that prefill (hundreds of
rows through the draft) cost more than speculation could win over a short answer.

What the draft drafts with never changes the output: the target verifies every token. The draft
does not store this request's K/V (they are not its own computation): its cache is untracked.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from kvboost_hf.cache import ChunkReuseCache, ReuseStats
from kvboost_hf.cache.chunk_reuse import ReuseRequest

logger = logging.getLogger(__name__)

_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # self-draft -> weakref to its target


def record_source(draft: torch.nn.Module, target: torch.nn.Module) -> None:
    """Remember that ``draft`` runs ``target``'s decoder layers (called by ``make_draft``)."""
    _sources[draft] = weakref.ref(target)


def draft_source(draft: torch.nn.Module) -> torch.nn.Module | None:
    """The model ``draft`` is a self-draft of, if it is one and that model is alive."""
    ref = _sources.get(draft)
    return ref() if ref is not None else None


@dataclass
class PromptDonor:
    """The target's cache of one generate call, read once by its self-draft's first round."""

    cache: ChunkReuseCache
    dtype: torch.dtype  # the draft's activations

    def give(self, draft_cache: ChunkReuseCache, input_ids: torch.LongTensor) -> int:
        """Fill ``draft_cache`` (empty and not begun: the proposer checks) with the target's K/V of the
        first tokens of ``input_ids``, as many as assisted decoding keeps in an assistant's cache (all but
        the last two); returns how many (0: nothing given, the draft prefills as usual)."""
        length = min(self.cache.get_seq_length(), input_ids.shape[1] - 2)
        if length < 1 or input_ids.shape[0] != 1:
            return 0
        # Only a tracked cache keeps every token of its sliding layers (and says which tokens it holds).
        if not self.cache.trackable or self.cache.token_ids()[:length] != input_ids[0, :length].tolist():
            logger.debug("the target's cache does not hold this prompt's K/V in full: the draft prefills")
            return 0
        states = [layer.full_states() for layer in self.cache.layers[: len(draft_cache.layers)]]
        if any(k is None or k.dim() != 4 or k.shape[0] != 1 or k.shape[-2] < length for k, _ in states):
            logger.debug("the target's cache does not hold the whole prompt in every layer: the draft prefills")
            return 0
        segments = [[(k[:, :, :length].to(self.dtype, copy=True), v[:, :, :length].to(self.dtype, copy=True))]
                    for k, v in states]
        draft_cache.load(segments, input_ids[0, :length])
        draft_cache.request = ReuseRequest(prompt_tokens=length)
        draft_cache.stats = ReuseStats(prompt_tokens=length, reason="prompt K/V taken from the target's cache")
        draft_cache.untrack()  # not the draft's own computation: never stored under its namespace
        return length


def prompt_donor(target: torch.nn.Module, draft: torch.nn.Module, target_cache,
                 draft_cache: ChunkReuseCache | None) -> PromptDonor | None:
    """A donor when ``draft`` is a self-draft of ``target`` and both caches hold layers of the same kinds
    (full or sliding with the same window) for the draft's layers; else None."""
    if draft_source(draft) is not target or not isinstance(target_cache, ChunkReuseCache):
        return None
    if draft_cache is None or not target_cache.supports_reuse or not draft_cache.supports_reuse:
        return None
    if len(draft_cache.layers) > len(target_cache.layers):
        return None
    for mine, theirs in zip(draft_cache.layers, target_cache.layers):  # both ReuseLayer / ReuseSlidingLayer
        if type(mine) is not type(theirs):
            return None
        if getattr(mine, "sliding_window", None) != getattr(theirs, "sliding_window", None):
            return None
    dtype = getattr(draft.config, "dtype", None) or torch.float32  # make_draft records the draft's activations
    return PromptDonor(target_cache, getattr(torch, dtype) if isinstance(dtype, str) else dtype)
