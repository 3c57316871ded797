"""``draft_round``: a head draft's greedy round on a fused decoder in one op call (``csrc/draft.cpp``).

A head draft (``kvboost_hf.speculative.head_draft``) forwards the target's own decoder one token at a time and
picks each next token with its int8 head. Per token that is a fused decoder forward, whose Python costs ~0.4 ms on
Gemma-3-270M int4 (2 cores: the plain-call checks, the positions, the embedding, the rotary rows, each cache layer's
reserve and commit, the op call's arguments), and a head call. Where the whole round is plain, :func:`draft_round`
runs it as one ``torch.ops.kvboost.draft_round`` call: each cache layer reserved once for the round's rows and
committed once after them, and per token inside the op the embedding, ``decoder_step`` over the layers, the final
norm, the head and its argmax. The same ops in the same order as the per-token forwards, with the same cos/sin rows
(views of the rotary blocks, :mod:`.rotary`) and each token's keys read over the same range (decode-exact attention
computes each row alone): the same tokens and decoder rows, and the cache left as the per-token commits leave it.

Plain means what the fused loop's own checks mean (:mod:`.decoder`), for every token of the round, plus: the
embedding is ``nn.Embedding`` or transformers' Gemma 3 scaled one, the final norm is a ``KernelRMSNorm``, neither
with hooks, nor the rotary module (where no rotary block serves, it is called once per position, as each forward
calls it, where it is a transformers module whose rows depend on their position alone: not dynamic NTK or longrope);
the positions are the cache's next ones (a mask of ones, no other position ids); every cache layer reserves the
round's rows. The decoder's own hooks are the caller's to rule out (a head draft's verification wrapper is its own).
Otherwise None: the caller forwards token by token as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from kvboost_hf.kernels.decoder import (
    _DTYPES,
    KernelDecoderMixin,
    _decoder_arguments,
    _plain,
    _reserved,
    _updates_layers_only,
)
from kvboost_hf.kernels.layer import _hooked
from kvboost_hf.kernels.layout import Int8Blocks
from kvboost_hf.kernels.norm import KernelRMSNorm
from kvboost_hf.kernels.plan import held_or_new_plan
from kvboost_hf.kernels.rotary import BLOCK, module_rope_type, rotary_rows
from kvboost_hf.models.rope import length_dependent

_STEP_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache",
                          "inputs_embeds", "cache_position"})


@dataclass
class DraftRound:
    """A round's outcome: the drafted tokens, in order, and the decoder's normed output for each forwarded token
    (the round's first token, then each drafted one but the last): ``[1, len(tokens), hidden]``."""

    tokens: list[int]
    hidden: torch.Tensor


def draft_round(decoder: nn.Module, inputs: dict, steps: int, head: Int8Blocks, head_tokens: torch.Tensor | None,
                ends: set[int]) -> DraftRound | None:
    """Up to ``steps`` greedy tokens from ``decoder`` and an int8 ``head`` (its top score, mapped through
    ``head_tokens`` where given), starting from the one-token forward ``inputs`` (as the decoder would be called for
    the round's first token) and stopping after a token in ``ends``; the tokens' rows are appended to the cache as
    that many forwards append them. None where the round is not plain (module doc): nothing was run."""
    if not 1 <= steps <= BLOCK or not isinstance(decoder, KernelDecoderMixin) or not set(inputs) <= _STEP_INPUTS:
        return None
    cache, ids = inputs.get("past_key_values"), inputs.get("input_ids")
    if (not isinstance(cache, Cache) or not isinstance(ids, torch.Tensor) or ids.shape != (1, 1) or not ids.is_cpu
            or inputs.get("inputs_embeds") is not None or inputs.get("use_cache") is False
            or decoder._forward_hooks or decoder._forward_pre_hooks or torch.is_grad_enabled()
            or not _plain(decoder, {})):
        return None
    plan = held_or_new_plan(decoder, cache)
    embed, norm = decoder._modules.get("embed_tokens"), decoder._modules.get("norm")
    scale = _embedding_scale(embed)
    if plan is None or scale is False or type(norm) is not KernelRMSNorm or _hooked(norm):
        return None
    dtype = embed.weight.dtype
    if dtype not in _DTYPES or any(a.has_bias and a.bias_dtypes != {dtype} for a, *_ in plan.layers):
        return None
    past = cache.get_seq_length()
    if not _next_one(inputs, past, cache):
        return None
    positions = torch.arange(past, past + steps).unsqueeze(0)
    probe = embed.weight.new_empty((1, steps, embed.weight.shape[1]))  # (rotary_rows reads its dtype and device)
    kinds = [None] if plan.types is None else plan.rotary
    embeddings = [_rotary(decoder, probe, positions, kind) for kind in kinds]
    if any(e is None for e in embeddings) or any(
            embeddings[rope][0].shape[-1] != head_dim or embeddings[rope][0].dtype != dtype
            for (_, _, head_dim, _, _), rope in zip(plan.layers, plan.rope)):
        return None
    layers = cache.layers if _updates_layers_only(cache) else None
    if not layers or not layers[0].is_initialized:
        return None
    slots = _reserved(layers, plan, 1, steps, dtype)
    if slots is None:
        return None
    tokens, hidden, keys, values = torch.ops.kvboost.draft_round(
        int(ids[0, 0]), steps, embed.weight, scale, norm.scale, norm.eps, head.qweight, head.scales,
        head.out_features, head_tokens, sorted(ends), *_decoder_arguments(plan), [c for c, _ in embeddings],
        [s for _, s in embeddings], *slots)
    for (_, index, *_), k, v in zip(plan.layers, keys, values):
        layers[index].kvboost_commit(k, v)
    return DraftRound(tokens.tolist(), hidden)


def _rotary(decoder: nn.Module, probe: torch.Tensor, positions: torch.Tensor, kind: str | None):
    """The ``(cos, sin)`` rows of ``positions`` (``[1, steps]``) that the round's one-token forwards would get: views
    of a rotary block (:func:`~.rotary.rotary_rows`), or else the rotary module called once per position, as each
    forward calls it; None where the module has hooks (their calls would not be the forwards')."""
    rows = rotary_rows(decoder, probe, positions, kind)
    module = decoder._modules.get("rotary_emb")
    if rows is not None or module is None or _hooked(module) or not _stateless(module, kind):
        return rows
    extra = () if kind is None else (kind,)
    calls = [module(probe[:, :1], positions[:, j: j + 1], *extra) for j in range(positions.shape[1])]
    return torch.cat([c for c, _ in calls], dim=1), torch.cat([s for _, s in calls], dim=1)


def _stateless(module: nn.Module, kind: str | None) -> bool:
    """Whether ``module``'s output for a position depends on that position alone: transformers' rotary modules but
    those that recompute their frequencies from the longest position a call sees (dynamic NTK keeps the largest it
    has seen, so calling it for positions the round never forwards would change the later forwards' keys)."""
    rope = module_rope_type(module, kind)
    return type(module).__module__.startswith("transformers.") and isinstance(rope, str) and not length_dependent(rope)


def _embedding_scale(embed) -> torch.Tensor | None | bool:
    """The factor ``embed``'s forward multiplies its rows by (None: none), or False where its forward is not one the
    op reproduces: ``nn.Embedding``'s own, or transformers' Gemma 3 scaled embedding's."""
    if not isinstance(embed, nn.Embedding) or _hooked(embed) or embed.max_norm is not None:
        return False
    if type(embed) is nn.Embedding:
        return None
    forward = type(embed).forward
    if (type(embed).__name__ != "Gemma3TextScaledWordEmbedding" or not forward.__module__.startswith("transformers.")
            or forward.__qualname__ != "Gemma3TextScaledWordEmbedding.forward"):
        return False
    scale = embed._buffers.get("embed_scale")
    return scale.to(embed.weight.dtype) if isinstance(scale, torch.Tensor) and scale.dim() == 0 else False


def _next_one(inputs: dict, past: int, cache: Cache) -> bool:
    """Whether ``inputs`` forward one token at the cache's next position with nothing masked."""
    mask, positions, cache_position = (inputs.get(k) for k in ("attention_mask", "position_ids", "cache_position"))
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (1, past + 1) or not bool(mask.all())):
        return False
    for given in (positions, cache_position):
        if given is not None and (not isinstance(given, torch.Tensor) or given.numel() != 1 or int(given) != past):
            return False
    return True
