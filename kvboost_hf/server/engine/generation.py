"""One request through ``model.generate`` on the worker thread: sampling settings, stop strings,
streaming deltas, cancellation, and the reuse figures of that call.

Stop strings are matched on the decoded text: generation ends at the step that completes one
(a ``StoppingCriteria``), the reply is cut before it, and while streaming the text that could
still turn into a stop string is held back until it cannot.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from kvboost_hf.cache import ChunkReuseCache, KIVICache
from kvboost_hf.generation import is_chunk_reuse_enabled
from kvboost_hf.server.decoding.logprobs import TokenLogprob, logprobs_at
from kvboost_hf.server.decoding.processors import sampling_processors
from kvboost_hf.server.decoding.stop_strings import StopStrings
from kvboost_hf.store.scope import CacheScope

logger = logging.getLogger(__name__)

# Sampling draws from torch's global RNG: sampling requests run one at a time, so a request's
# seed alone decides its tokens even with several workers (greedy requests never wait on it).
_SAMPLING_LOCK = threading.Lock()

# End-of-turn tokens of common chat formats; a reply stops at any of them that the tokenizer knows.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


@dataclass
class SamplingParams:
    """What to generate: ``temperature`` 0 is greedy; ``seed`` seeds a sampled request's draws (a greedy
    request draws nothing, so its seed is unused)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and the top k
    cache_scope: CacheScope | None = None  # whose entries it reads and feeds (tenant, cache_salt)
    # Builds this call's logits processors (grammar, logit_bias, penalties) from the prompt length:
    # a fresh list per generate call (a grammar matcher is single-use).
    processors: Callable[[int], list] | None = None


@dataclass
class Reply:
    """The outcome of one generate call. ``finish_reason`` is None when it was cancelled."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    first_token_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.logprobs or [] if e.logprob is not None)


def stop_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the generation config's, the tokenizer's and known end-of-turn tokens."""
    ids: list[int] = []
    configured = model.generation_config.eos_token_id
    for value in ([configured] if isinstance(configured, int) else list(configured or [])) + [tokenizer.eos_token_id]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        value = vocab.get(token)
        if value is not None and value not in ids:
            ids.append(value)
    return ids


class ReplyText:
    """The visible text of a reply as tokens arrive: decoded, cut at the first stop string.

    Stop strings are matched by :class:`StopStrings`: each update costs the decode plus the new
    characters, whatever the stop strings' length.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.matcher = StopStrings(stop)
        self.num_tokens = 0
        self.text = ""
        self.stopped = False
        self.sent = 0

    def update(self, token_ids: list[int]) -> None:
        """Decode the generated ``token_ids`` (all of them so far); idempotent per length."""
        if self.stopped or len(token_ids) == self.num_tokens:
            return
        self.num_tokens = len(token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = self.matcher.scan(text)
        if cut is not None:
            text, self.stopped = text[:cut], True
        self.text = text

    def would_stop(self, token_ids: list[int]) -> bool:
        """Whether the reply made of ``token_ids`` (the generated ones) holds a stop string; changes nothing."""
        if not self.matcher.stops:
            return False
        return self.matcher.find(self.tokenizer.decode(token_ids, skip_special_tokens=True)) is not None

    def completing_length(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` a reply that stopped keeps: up to the token that completes the stop
        string, the count plain decoding (one token per step) reports; all of them when it did not stop.
        Assisted decoding appends several tokens per round and can run past that token."""
        n = len(token_ids)
        if not self.stopped:
            return n
        while n > 1 and self.would_stop(token_ids[: n - 1]):
            n -= 1
        return n

    def _held_back(self) -> int:
        """Characters at the end that may still become a stop string or a complete character."""
        text = self.text
        partial = len(text) - len(text.rstrip("\ufffd"))  # an incomplete multi-byte character
        return max(partial, self.matcher.held_back)

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out that can no longer change (all of it when ``final``)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


class _StopOnSignal(StoppingCriteria):
    """Ends generation when the job is cancelled or the reply reached a stop string."""

    def __init__(self, reply: ReplyText, prompt_len: int, cancelled: Callable[[], bool]) -> None:
        self.reply, self.prompt_len, self.cancelled = reply, prompt_len, cancelled

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if self.reply.stop:
            self.reply.update(input_ids[0, self.prompt_len :].tolist())
        done = self.reply.stopped or self.cancelled()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    def would_stop(self, input_ids: torch.LongTensor) -> bool:
        """Whether the reply decoded from ``input_ids`` (the whole sequence, prompt included, batch 1)
        holds a stop string. Pure: the criterion's state is left as it is (for checking a draft's
        continuation before it is accepted)."""
        return self.reply.would_stop(input_ids[0, self.prompt_len :].tolist())


class _DeltaStreamer(BaseStreamer):
    """Hands each new piece of visible text to ``on_delta`` (skips the prompt generate puts first)."""

    def __init__(self, reply: ReplyText, on_delta: Callable[[str], None] | None) -> None:
        self.reply, self.on_delta = reply, on_delta
        self.ids: list[int] = []
        self.prompt_seen = False
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.ids.extend(int(t) for t in value.reshape(-1).tolist())
        if self.on_delta is not None:
            self.reply.update(self.ids)
            piece = self.reply.delta()
            if piece:
                self.on_delta(piece)

    def end(self) -> None:
        pass


def generate_reply(
    model,
    tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids: list[int],
    store=None,
    cancelled: Callable[[], bool] = lambda: False,
    on_delta: Callable[[str], None] | None = None,
    generate_kwargs: dict | None = None,
) -> Reply:
    """Run one ``model.generate`` call for ``prompt_ids`` (batch 1) on a worker thread.

    ``on_delta`` receives the visible text piece by piece (streaming); the returned
    :class:`Reply` holds the whole text, token counts, and the prompt tokens reused from the
    store. With reuse enabled, the request gets its own ``ChunkReuseCache`` (the explicit
    form), whose ``stats`` are this call's even while other workers generate. ``generate_kwargs``
    (the memory planner's choices: ``prefill_chunk_size``; ``kv_bits``, which runs the request
    on a :class:`~kvboost_hf.KIVICache` without reuse) are passed on to generate.
    """
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    reply = ReplyText(tokenizer, params.stop)
    streamer = _DeltaStreamer(reply, on_delta)
    kwargs: dict = dict(
        max_new_tokens=params.max_tokens,
        attention_mask=torch.ones_like(input_ids),
        stopping_criteria=StoppingCriteriaList([_StopOnSignal(reply, len(prompt_ids), cancelled)]),
        streamer=streamer,
        pad_token_id=_pad_id(model, tokenizer, eos_ids),
        eos_token_id=None if params.ignore_eos else eos_ids,
        **(generate_kwargs or {}),  # the memory plan: e.g. prefill_chunk_size
    )
    processors = params.processors(len(prompt_ids)) if params.processors is not None else []
    if params.temperature > 0 and processors:
        # Custom processors first, then temperature and top-p (generate would put them last).
        kwargs.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                      logits_processor=[*processors,
                                        *sampling_processors(params.temperature, params.top_p)])
    elif params.temperature > 0:
        kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if processors:
            kwargs["logits_processor"] = processors
    if params.logprobs is not None:
        kwargs.update(return_dict_in_generate=True, output_logits=True)
    cache = None
    kv_bits = kwargs.pop("kv_bits", None)
    if kv_bits is not None:  # the plan's lossy last resort: no reuse for this request
        kwargs["past_key_values"] = KIVICache(model.config, bits=kv_bits)
    elif store is not None and is_chunk_reuse_enabled(model):
        cache = ChunkReuseCache(model.config, store)
        kwargs["past_key_values"] = cache
    if store is not None and is_chunk_reuse_enabled(model):  # with kv_bits too: a draft stays in the scope
        kwargs["cache_salt"] = params.cache_scope
    sampled = params.temperature > 0
    with _SAMPLING_LOCK if sampled else contextlib.nullcontext():
        if sampled and params.seed is not None:  # greedy requests never touch the global RNG
            torch.manual_seed(params.seed)
        with torch.no_grad():
            output = model.generate(input_ids, **kwargs)
    sequences = output.sequences if params.logprobs is not None else output
    generated = sequences[0, len(prompt_ids) :].tolist()
    stats = getattr(cache, "stats", None)
    cached = stats.reused_tokens if stats is not None else 0
    reply.update(generated)
    # A draft (assisted decoding) appends several tokens per round: keep those up to the stop.
    generated = generated[: reply.completing_length(generated)]
    if on_delta is not None:
        piece = reply.delta(final=True)
        if piece:
            on_delta(piece)
    if cancelled() and not reply.stopped:
        finish = None
    elif reply.stopped or (generated and generated[-1] in eos_ids and not params.ignore_eos):
        finish = "stop"
    else:
        finish = "length"
    entries = None
    if params.logprobs is not None:
        shown = visible_tokens(tokenizer, generated, reply.text) if reply.stopped else len(generated)
        logits = torch.stack([step[0] for step in output.logits[:shown]]) if shown else None
        entries = logprobs_at(logits, generated[:shown], params.logprobs) if shown else []
    return Reply(
        text=reply.text,
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(generated),
        cached_tokens=cached,
        finish_reason=finish,
        first_token_at=streamer.first_token_at,
        token_ids=generated,
        logprobs=entries,
    )


def visible_tokens(tokenizer, generated: list[int], text: str) -> int:
    """How many generated tokens a reply cut at a stop string keeps (for its logprobs): those whose
    text lies wholly before the cut; a token the stop string starts inside is not one of them."""
    n = len(generated)
    while n > 0 and len(tokenizer.decode(generated[:n], skip_special_tokens=True)) > len(text):
        n -= 1
    return n


def _pad_id(model, tokenizer, eos_ids: list[int]) -> int:
    for value in (tokenizer.pad_token_id, model.generation_config.pad_token_id, *eos_ids):
        if isinstance(value, int):
            return value
    return 0
