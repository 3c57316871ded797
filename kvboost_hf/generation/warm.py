"""``warm``: fill a store with the K/V of a system prompt, a chat's opening turns, documents or any
token sequence ahead of requests; ``chat_prefix``: what later chats starting with some messages share."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.cache.stats import ReuseStats
from kvboost_hf.generation.enable import disable_chunk_reuse, enable_chunk_reuse, is_chunk_reuse_enabled
from kvboost_hf.models.namespace import namespace
from kvboost_hf.models.target import target_model
from kvboost_hf.reuse.commit import commit_request
from kvboost_hf.reuse.state import reuse_state
from kvboost_hf.store import ChunkStore
from kvboost_hf.store.scope import CacheScope, as_scope

# Stand-ins for the turn a later chat adds after the warmed messages. Their first characters are
# of different kinds (letter, digit, punctuation), so a template text that the tokenizer merges
# with the next turn's first character falls outside the common prefix.
PROBE_TEXTS = ("Hello", "0", "?")
_VOCAB_PROBES_TRIED = 256  # vocabulary entries tried when PROBE_TEXTS do not tokenize apart


def probe_texts(tokenizer, count: int = len(PROBE_TEXTS)) -> list[str]:
    """``count`` stand-in turn texts whose first tokens differ under ``tokenizer`` (and are no special
    token, such as the unknown token a small vocabulary maps them all to): :data:`PROBE_TEXTS`, then
    entries of the tokenizer's vocabulary. Probes that tokenize alike would put their own text into
    the common prefix."""
    special = set(tokenizer.all_special_ids)
    chosen: list[str] = []
    firsts: set[int] = set()

    def consider(text: str) -> None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids and ids[0] not in firsts and ids[0] not in special:
            firsts.add(ids[0])
            chosen.append(text)

    for text in PROBE_TEXTS:
        consider(text)
    size = len(tokenizer)
    for token_id in range(0, size, max(1, size // _VOCAB_PROBES_TRIED)):
        if len(chosen) >= count:
            break
        text = tokenizer.decode([token_id], skip_special_tokens=True).strip()
        if text:
            consider(text)
    if len(chosen) < 2:
        raise ValueError("cannot find two texts this tokenizer tells apart to probe its chat template with")
    return chosen[:count]


def continuation_probes(last_role: str, texts: Sequence[str] = PROBE_TEXTS) -> list[tuple[dict[str, str] | None, bool]]:
    """``(turn to append or None, add_generation_prompt)`` renderings whose common token prefix is what
    every later chat continuing messages that end in a ``last_role`` turn starts with (``texts``: the
    stand-in turns' texts, from :func:`probe_texts`).

    After a user (or tool) turn a chat goes on with the model's reply: the messages rendered with the
    generation prompt (the chat that asks exactly this), and with an assistant turn appended. After
    any other turn (system, assistant) it goes on with a user turn and the generation prompt.
    """
    if last_role in ("user", "tool", "function"):
        return [(None, True), *(({"role": "assistant", "content": text}, False) for text in texts)]
    return [({"role": "user", "content": text}, True) for text in texts]


def shared_prefix(renderings: Sequence[Sequence[int]]) -> list[int]:
    """The longest common prefix of token sequences."""
    return list(os.path.commonprefix([list(r) for r in renderings]))


def chat_prefix(tokenizer, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The tokens that every later chat starting with ``messages`` renders first under the tokenizer's
    chat template: what :func:`warm` stores for ``messages=``.

    Rendering ``messages`` alone is not enough: many templates drop a system message without a user
    turn (Gemma, Llama 2), fold it into the first user turn, or render the last turn differently from
    earlier ones. So the chat is rendered with several stand-in next turns and the common token prefix
    of the renderings is kept. A template that refuses the messages raises its own error.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_prefix() needs a tokenizer with a chat_template (tokenizer.chat_template is unset)")
    if not messages:
        raise ValueError("chat_prefix() needs at least one message")
    turns = [dict(m) for m in messages]
    renderings = []
    for extra, generation in continuation_probes(turns[-1]["role"], probe_texts(tokenizer)):
        chat = turns if extra is None else [*turns, extra]
        encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=generation, tokenize=True,
                                                return_dict=True)
        renderings.append(encoded["input_ids"])
    prefix = shared_prefix(renderings)
    if not prefix:
        raise ValueError("later chats starting with these messages share no leading token under this chat template")
    return prefix


def _store_for(target: torch.nn.Module, store: ChunkStore | None, missing: str) -> ChunkStore:
    """``store``, else the store reuse is enabled with on ``target``; ValueError (``missing``, and how to
    enable reuse instead) when there is neither."""
    if store is not None:
        return store
    state = reuse_state(target)
    if state is None:
        raise ValueError(f"{missing}, or enable_chunk_reuse(model, store) first")
    return state.store


def reusable_tokens(model: torch.nn.Module, token_ids: Sequence[int], store: ChunkStore | None = None, *,
                    cache_salt: str | CacheScope | None = None) -> int:
    """How many leading tokens of ``token_ids`` a later prompt that continues them (with the same
    ``cache_salt``) loads from ``store`` (its RAM and disk tiers; an index estimate: nothing is loaded,
    no counter moves). A prompt that is exactly ``token_ids`` reuses one token fewer: the model
    forwards at least one prompt token."""
    target = target_model(model)
    store = _store_for(target, store, "reusable_tokens() needs store=: pass the ChunkStore")
    scope, ns = as_scope(cache_salt) or CacheScope(), namespace(target)
    return store.stored_prefix_length(scope.root(ns), list(token_ids), shared=scope.shared_root(ns))


def warm(
    model: torch.nn.Module,
    input_ids_or_text: str | Sequence[int] | torch.Tensor | Sequence[str] | None = None,
    store: ChunkStore | None = None,
    tokenizer=None,
    pin: bool = False,
    *,
    documents: Sequence[str | Sequence[int]] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    cache_salt: str | CacheScope | None = None,
) -> ReuseStats:
    """Prefill ``store`` with the K/V of a text or token sequence (one forward, no generation).

    Text is tokenized with ``tokenizer`` exactly as a prompt would be (special tokens added),
    so a warmed system prompt is a prefix of later prompts that start with it; its chunks start
    right after the leading special tokens, so the text is also found by content wherever it
    later appears (with a ``recompute_strategy``). ``documents=[...]`` (or a list of strings)
    warms each document as a segment of its own. ``messages=[...]`` (chat messages, with
    ``tokenizer``'s chat template) warms :func:`chat_prefix`: the tokens every later chat starting
    with those messages shares (for a system prompt, what a chat with it renders before the first
    user text). ``pin=True`` makes the store evict these chunks last. ``cache_salt``: only later
    requests with the same salt find these entries (see ``generate(..., cache_salt=...)``; a
    :class:`~kvboost_hf.store.scope.CacheScope` also names the owner they are charged to).
    ``store`` defaults to the store reuse is enabled with on ``model``. Returns the stats summed over everything warmed
    (``prompt_tokens``: the tokens forwarded).
    """
    given = sum(x is not None for x in (input_ids_or_text, documents, messages))
    if given != 1:
        raise ValueError("warm() needs exactly one of: a text or token ids, documents=[...], messages=[...]")
    if messages is not None:
        if tokenizer is None:
            raise ValueError("warm(messages=...) needs tokenizer= (its chat template renders the messages)")
        return warm(model, chat_prefix(tokenizer, messages), store, pin=pin, cache_salt=cache_salt)
    target = target_model(model)
    store = _store_for(target, store, "warm() needs store=: pass the ChunkStore to fill")
    if documents is None and isinstance(input_ids_or_text, (list, tuple)) and input_ids_or_text \
            and isinstance(input_ids_or_text[0], str):
        documents = input_ids_or_text
    if documents is not None:
        total = ReuseStats()
        for document in documents:
            stats = warm(model, document, store, tokenizer=tokenizer, pin=pin, cache_salt=cache_salt)
            total.prompt_tokens += stats.prompt_tokens
            total.reused_tokens += stats.reused_tokens
            total.exact_tokens += stats.exact_tokens
            total.recomputed_tokens += stats.recomputed_tokens
            total.stored_chunks += stats.stored_chunks
            total.lookup_ms += stats.lookup_ms
        return total
    if isinstance(input_ids_or_text, str):
        if tokenizer is None:
            raise ValueError("warm() got text: pass tokenizer= to tokenize it, or pass token ids")
        ids = tokenizer(input_ids_or_text, return_tensors="pt")["input_ids"]
    else:
        ids = torch.as_tensor(input_ids_or_text, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"warm() needs one non-empty token sequence, got shape {tuple(ids.shape)}")
    ids = ids.to(target.device)
    installed_here = not is_chunk_reuse_enabled(target)
    if installed_here:
        enable_chunk_reuse(target, store)
    try:
        state = reuse_state(target)
        cache = ChunkReuseCache(target.config, store)
        cache.scope = as_scope(cache_salt)
        with torch.no_grad():
            target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        commit_request(state, cache, pin=pin)
    finally:
        if installed_here:
            disable_chunk_reuse(target)
    return cache.stats
