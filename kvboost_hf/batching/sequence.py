"""One request in the running batch: its cache, prefill, sampler, tokens and why it finished."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from kvboost_hf.batching.prefill import PromptPrefill
from kvboost_hf.batching.sampling import RawLogprob, RowSampling, next_token, raw_logprob
from kvboost_hf.store.scope import CacheScope


class VisibleText(Protocol):
    """The reply text seen so far (e.g. the server's ``ReplyText``): cut at the first stop string."""

    stopped: bool

    def update(self, token_ids: list[int]) -> None: ...


class Sequence:
    """A request's state from admission to its last token.

    ``prefill`` is set by :meth:`start`; while ``prefilling`` the scheduler gives it chunks;
    once the prompt's last logits gave the first token it is ``decoding`` and feeds its latest
    token in each decode step until :attr:`finish_reason` is set ("stop", "length", or
    "cancelled"). With ``logprobs`` (k >= 0) each generated token's raw logprob and the top k
    are recorded in :attr:`logprobs`, one entry per token of :attr:`generated`.
    """

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: RowSampling, eos_ids: list[int],
                 text: VisibleText | None = None, ignore_eos: bool = False, logprobs: int | None = None) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a sequence needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.eos_ids = set() if ignore_eos else set(eos_ids)
        self.text = text
        self.cache = None
        self.scope: CacheScope | None = None  # cache_salt: whose chains the row reads and feeds
        self.prefill: PromptPrefill | None = None
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.top_logprobs = logprobs
        self.logprobs: list[RawLogprob] = []
        self.published = 0  # prompt chunks stored as soon as the prefill ended (BatchRunner.publish)

    # ------------------------------------------------------------------ state
    @property
    def prefilling(self) -> bool:
        return self.prefill is not None and self.prefill.remaining > 0

    @property
    def decoding(self) -> bool:
        return self.finish_reason is None and bool(self.generated)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Position of the token the next decode step feeds (the latest generated one)."""
        return len(self.prompt_ids) + len(self.generated) - 1

    def start(self, cache, prefill: PromptPrefill) -> None:
        self.cache, self.prefill = cache, prefill

    # ------------------------------------------------------------------ tokens
    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from this row's last logits and record it (and its raw logprob); returns it."""
        ids = torch.tensor(self.prompt_ids + self.generated) if self.sampling.needs_ids else None
        # Before the processors run: a processor may change scores in place, a logprob is the model's.
        logprobs = torch.log_softmax(logits.float().reshape(-1), dim=-1) if self.top_logprobs is not None else None
        token = next_token(logits, self.sampling, ids)
        if logprobs is not None:
            self.logprobs.append(raw_logprob(logprobs, token, self.top_logprobs))
        self.add_token(token)
        return token

    def add_token(self, token: int) -> None:
        """Record a generated token and decide whether the sequence ends with it."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.generated.append(token)
        if self.text is not None:
            self.text.update(self.generated)
        if (self.text is not None and self.text.stopped) or token in self.eos_ids:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_tokens:
            self.finish_reason = "length"

    def cancel(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def feed_token(self) -> int:
        """The token the next decode step forwards for this row (tracked in a reuse cache now)."""
        token = self.generated[-1]
        track = getattr(self.cache, "track", None)
        if track is not None and getattr(self.cache, "trackable", False):
            track(torch.tensor([token]))
        return token
