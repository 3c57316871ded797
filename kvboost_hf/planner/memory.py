"""MemoryPlanner: predict a request's peak memory before it runs, and pick settings that fit.

:meth:`MemoryPlanner.plan` is a pure function of the request's sizes and the planner's probed
numbers; it mutates nothing, and its settings apply to that request only. The peak it predicts:

- the request's K/V at its full length (prompt + new tokens), in the model's dtype, every layer
  (with chunk reuse on, sliding layers keep every token too: the cache holds them for storing);
- K/V other running requests already hold (``batch_kv_bytes``);
- activations of one prefill chunk (hidden states, attention projections, the gated MLP);
- attention scratch of that chunk (with SDPA its mask, chunk x context; with eager attention
  also the scores and softmax of every head, and keys and values repeated per head under GQA);
- the logits rows of the last position (and the processed copies generate makes).

A request that scores its prompt (``echo`` with ``logprobs``: lm-eval's loglikelihood) also
forwards the prompt with logits at every position, in slices: its peak is the larger of the
generation's and the scoring's (:meth:`MemoryPlanner.score_bytes`: the prompt's K/V, one slice's
activations, that slice's ``slice x vocab`` logits and the float32 log-softmax of
``SCORE_ROWS`` of them at a time). The slice is the largest of ``SCORE_SLICES`` that fits.

A prefill chunk only covers tokens that are not reused, so reuse lowers the activation and
scratch terms; the K/V term stays (a request's cache holds its reused tokens too).

The ladder it climbs, cheapest first: every prefill chunk size at full precision, then (only
when the caller allows it: ``kv_bits_options``) every chunk size with the live K/V in a
:class:`~kvboost_hf.cache.kivi.KIVICache` of 8, then 4 bits. Lossless rungs always come
first; a quantized rung is approximate and reported as such, and it reads nothing from the store
(so reuse does not lower its prefill).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvboost_hf.cache.buffer import SPARE_TOKENS
from kvboost_hf.models.attention import attention_implementation
from kvboost_hf.models.shape import (
    ModelShape,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    quantized_kv_bytes_per_sequence,
)
from kvboost_hf.planner.probe import decode_step_seconds, memory_limit_bytes, process_rss_bytes

logger = logging.getLogger(__name__)

# Chunk sizes tried from cheapest (one forward) to leanest.
PREFILL_LADDER = (None, 4096, 2048, 1024, 512, 256, 128)
DEFAULT_MARGIN = 0.10
MIB = 2**20
# Fitted on the live memory of Gemma-3-270M requests (CPU, fp32, SDPA; benchmarks/memory_planner.py,
# 128-4,096 tokens): a forward keeps about 1.5 copies of the per-token width alive, a chunked
# prefill one chunk-sized copy more (masks and the growing cache); SDPA's fused kernel works in
# tiles, so what grows with chunk x context is the mask, about 5 bytes per query-key pair.
# Eager attention materialises the scores of every head and their softmax instead.
ACTIVATION_COPIES = 1.5
CHUNKED_EXTRA_COPIES = 1.0
MASK_BYTES_PER_PAIR = 5
EAGER_SCORE_COPIES = 2
# A KIVICache layer dequantizes its whole history at every update and concatenates it with the new
# states (transformers' QuantizedLayer): two float copies of one layer's K/V are alive at that moment
# (measured on Gemma-3-270M, 1,024-4,096 tokens: three over-predicted by 16-24%).
KIVI_TRANSIENT_COPIES = 2
KIVI_RESIDUAL_LENGTH = 128
# Prompt scoring: positions per forward, cheapest (fewest forwards) first, and the rows of logits turned
# into logprobs at once (a float32 copy and its log-softmax: two [rows, vocab] temporaries). Measured on
# Gemma-3-270M fp32 scoring 1,000 tokens (262k vocabulary): 316 / 185 / 118 MiB at slices 256 / 128 / 64,
# predicted 335 / 194 / 124.
SCORE_SLICES = (256, 128, 64, 32, 16)
SCORE_ROWS = 16


@dataclass(frozen=True)
class RequestPlan:
    """What the planner decided for one request."""

    prompt_tokens: int
    max_new_tokens: int
    reused_tokens: int
    prefill_chunk_size: int | None  # None: the prompt in one forward
    kv_bits: int | None  # None: full-precision K/V (exact); 8 or 4: a KIVICache (approximate, no reuse)
    predicted_peak_bytes: int
    free_bytes: int
    fits: bool
    suggested_max_tokens: int  # the most new tokens that fit after this prompt (0: the prompt alone does not fit)
    score_slice_tokens: int | None = None  # prompt positions per scoring forward (None: the prompt is not scored)

    @property
    def generate_kwargs(self) -> dict:
        """Keyword arguments that apply this plan to ``model.generate`` (a chunk-reuse model: ``kv_bits``
        is its argument)."""
        out = {} if self.prefill_chunk_size is None else {"prefill_chunk_size": self.prefill_chunk_size}
        if self.kv_bits is not None:
            out["kv_bits"] = self.kv_bits
        return out

    def error_payload(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "predicted_peak_mb": round(self.predicted_peak_bytes / MIB, 1),
            "free_mb": round(self.free_bytes / MIB, 1),
            "suggested_max_tokens": self.suggested_max_tokens,
            "kv_bits": self.kv_bits,
        }


class MemoryPlanner:
    """Per-request memory plans for one model on one machine.

    ``free_bytes``: memory available to requests beyond what the process already holds (the
    weights included); a ``margin`` fraction of it is kept in reserve. ``sliding_capped`` says
    whether sliding layers keep only their window (plain ``DynamicCache``) or every token (with
    chunk reuse, which stores the whole prompt). ``kv_bits_options``: the live K/V precisions a
    request may fall back to when nothing fits at full precision (e.g. ``(8, 4)``; default none).
    """

    def __init__(self, shape: ModelShape, free_bytes: int, margin: float = DEFAULT_MARGIN,
                 sliding_capped: bool = False, ladder: tuple = PREFILL_LADDER, attention: str = "sdpa",
                 kv_bits_options: tuple[int, ...] = ()) -> None:
        if free_bytes <= 0:
            raise ValueError(f"free_bytes must be positive, got {free_bytes}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        bad = [b for b in kv_bits_options if b not in (8, 4)]
        if bad:
            raise ValueError(f"kv_bits_options may hold 8 and 4, got {bad}")
        self.shape, self.free_bytes, self.margin = shape, int(free_bytes), margin
        self.sliding_capped, self.ladder, self.attention = sliding_capped, ladder, attention
        self.kv_bits_options = tuple(sorted(set(kv_bits_options), reverse=True))  # 8 before 4
        self.decode_step_s: float | None = None  # measured by for_model()

    @property
    def budget_bytes(self) -> int:
        return int(self.free_bytes * (1.0 - self.margin))

    # ------------------------------------------------------------------ the model of a peak
    def kv_bytes(self, tokens: int, kv_bits: int | None = None) -> int:
        if kv_bits is not None:
            live = quantized_kv_bytes_per_sequence(self.shape, tokens, kv_bits, KIVI_RESIDUAL_LENGTH)
            per_layer = kv_bytes_per_token(self.shape)["full"] // max(1, self.shape.full_layers)
            return live + KIVI_TRANSIENT_COPIES * per_layer * tokens
        # A live cache's layers keep room to append in place (kvboost_hf.cache.buffer): up to SPARE_TOKENS more each.
        per_token = sum(kv_bytes_per_token(self.shape).values())
        held = kv_bytes_per_sequence(self.shape, tokens) if self.sliding_capped else per_token * tokens
        return held + per_token * SPARE_TOKENS

    def forward_bytes(self, chunk: int, context: int, chunked: bool = False) -> int:
        """Activations and attention scratch of forwarding ``chunk`` tokens over ``context`` keys
        (``chunked``: one of several prefill chunks)."""
        s = self.shape
        width = 4 * s.hidden_size + 3 * s.intermediate_size + (s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
        copies = ACTIVATION_COPIES + (CHUNKED_EXTRA_COPIES if chunked else 0.0)
        activations = int(copies * chunk * width * s.dtype_bytes)
        mask = MASK_BYTES_PER_PAIR * chunk * context
        if self.attention != "eager":
            return activations + mask
        scores = EAGER_SCORE_COPIES * chunk * context * s.num_attention_heads * max(s.dtype_bytes, 4)
        expanded = 0 if s.num_kv_heads == s.num_attention_heads else (
            2 * context * s.num_attention_heads * s.head_dim * s.dtype_bytes)  # keys/values repeated per head
        return activations + mask + scores + expanded

    def logits_bytes(self) -> int:
        return 3 * self.shape.vocab_size * 4  # last-position logits, fp32, plus generate's processed copies

    def score_bytes(self, prompt_tokens: int, slice_tokens: int = SCORE_SLICES[0], batch_kv_bytes: int = 0) -> int:
        """Peak of scoring a prompt (logprobs at every position) ``slice_tokens`` positions per forward: the
        prompt's K/V, one slice's activations, its logits (model dtype) and ``SCORE_ROWS`` rows of float32
        log-softmax temporaries; plus ``batch_kv_bytes``."""
        s = self.shape
        rows = min(slice_tokens, prompt_tokens)
        logits = rows * s.vocab_size * s.dtype_bytes + 2 * min(SCORE_ROWS, rows) * s.vocab_size * 4
        return self.kv_bytes(prompt_tokens) + batch_kv_bytes + self.forward_bytes(rows, prompt_tokens, True) + logits

    def peak_bytes(self, prompt_tokens: int, max_new_tokens: int, reused_tokens: int = 0,
                   prefill_chunk_size: int | None = None, batch_kv_bytes: int = 0, kv_bits: int | None = None) -> int:
        if kv_bits is not None:
            reused_tokens = 0  # a KIVICache request reads nothing from the store
        total = prompt_tokens + max_new_tokens
        computed = max(1, prompt_tokens - min(reused_tokens, prompt_tokens - 1))
        chunk = computed if prefill_chunk_size is None else min(prefill_chunk_size, computed)
        forward = self.forward_bytes(chunk, prompt_tokens, chunked=chunk < computed)
        return self.kv_bytes(total, kv_bits) + batch_kv_bytes + forward + self.logits_bytes()

    def rungs(self) -> list[tuple[int | None, int | None]]:
        """``(prefill_chunk_size, kv_bits)`` from cheapest to leanest: every lossless rung before any lossy one."""
        return [(chunk, bits) for bits in (None, *self.kv_bits_options) for chunk in self.ladder]

    # ------------------------------------------------------------------ plans
    def plan(self, prompt_tokens: int, max_new_tokens: int, reused_tokens: int = 0,
             batch_kv_bytes: int = 0, score_prompt: bool = False) -> RequestPlan:
        """The cheapest ``(prefill_chunk_size, kv_bits)`` rung whose predicted peak fits (and with
        ``score_prompt``, the largest scoring slice that fits; the peak is the larger of the two);
        ``fits=False`` with a suggestion (the most new tokens that fit at the leanest rung) when none does.
        ``batch_kv_bytes``: what other requests hold or have reserved."""
        if prompt_tokens <= 0 or max_new_tokens < 0 or reused_tokens < 0:
            raise ValueError("prompt_tokens must be positive, max_new_tokens and reused_tokens non-negative")
        rung, peak = self._generation_rung(prompt_tokens, max_new_tokens, reused_tokens, batch_kv_bytes)
        slice_tokens, score = self._score_rung(prompt_tokens, batch_kv_bytes) if score_prompt else (None, 0)
        if rung is not None and (slice_tokens is not None or not score_prompt):
            return RequestPlan(prompt_tokens, max_new_tokens, reused_tokens, *rung, max(peak, score), self.free_bytes,
                               True, max_new_tokens, slice_tokens)
        suggestion = self.suggested_max_tokens(prompt_tokens, reused_tokens, batch_kv_bytes, limit=max_new_tokens,
                                               score_prompt=score_prompt)
        leanest_bits = self.kv_bits_options[-1] if self.kv_bits_options else None
        leanest_slice = SCORE_SLICES[-1] if score_prompt else None
        return RequestPlan(prompt_tokens, max_new_tokens, reused_tokens, self.ladder[-1], leanest_bits,
                           max(peak, score), self.free_bytes, False, suggestion, leanest_slice)

    def _generation_rung(self, prompt_tokens: int, max_new_tokens: int, reused_tokens: int,
                         batch_kv_bytes: int) -> tuple[tuple[int | None, int | None] | None, int]:
        """The first ``(chunk, kv_bits)`` rung that fits and its peak; ``(None, leanest peak)`` when none does."""
        peak = 0
        for chunk, bits in self.rungs():
            computed = prompt_tokens - (0 if bits is not None else reused_tokens)
            if chunk is not None and chunk >= computed:
                continue  # no smaller than one forward: the next rung is
            peak = self.peak_bytes(prompt_tokens, max_new_tokens, reused_tokens, chunk, batch_kv_bytes, bits)
            if peak <= self.budget_bytes:
                return (chunk, bits), peak
        return None, peak

    def _score_rung(self, prompt_tokens: int, batch_kv_bytes: int) -> tuple[int | None, int]:
        """The largest scoring slice that fits and its peak; ``(None, leanest peak)`` when none does."""
        peak = 0
        for slice_tokens in SCORE_SLICES:
            peak = self.score_bytes(prompt_tokens, slice_tokens, batch_kv_bytes)
            if peak <= self.budget_bytes:
                return slice_tokens, peak
        return None, peak

    def _largest(self, fits, upper: int) -> int:
        """The largest ``n`` in ``[0, upper]`` with ``fits(n)`` (``fits`` monotone, decreasing in ``n``)."""
        lo, hi = 0, upper + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def suggested_max_tokens(self, prompt_tokens: int, reused_tokens: int = 0, batch_kv_bytes: int = 0,
                             limit: int = 1 << 20, score_prompt: bool = False) -> int:
        """The most new tokens that fit after this prompt (0: not even the prompt fits)."""
        if not self._fits(prompt_tokens, 0, reused_tokens, batch_kv_bytes, score_prompt):
            return 0
        return self._largest(lambda n: self._fits(prompt_tokens, n, reused_tokens, batch_kv_bytes, score_prompt),
                             limit)

    def truncated_prompt(self, prompt_tokens: int, max_new_tokens: int, batch_kv_bytes: int = 0,
                         score_prompt: bool = False) -> int:
        """The longest prefix of the prompt that fits with ``max_new_tokens`` (0 when none does)."""
        return self._largest(lambda n: n > 0 and self._fits(n, max_new_tokens, 0, batch_kv_bytes, score_prompt),
                             prompt_tokens)

    def _fits(self, prompt_tokens: int, max_new_tokens: int, reused_tokens: int, batch_kv_bytes: int,
              score_prompt: bool = False) -> bool:
        """Whether any rung fits (the leanest chunk size, at full precision or at any allowed ``kv_bits``;
        with ``score_prompt`` also the leanest scoring slice)."""
        budget = self.budget_bytes
        if score_prompt and self.score_bytes(prompt_tokens, SCORE_SLICES[-1], batch_kv_bytes) > budget:
            return False
        return any(
            self.peak_bytes(prompt_tokens, max_new_tokens, reused_tokens, self.ladder[-1], batch_kv_bytes, bits)
            <= budget
            for bits in (None, *self.kv_bits_options)
        )

    # ------------------------------------------------------------------ probing
    @classmethod
    def for_model(cls, model, memory_limit: int | None = None, margin: float = DEFAULT_MARGIN,
                  reuse: bool = True, kv_bits_options: tuple[int, ...] = ()) -> MemoryPlanner:
        """Probe once: model shape from its config, free memory (CUDA ``mem_get_info``; on CPU
        ``memory_limit`` or the cgroup limit / physical memory, minus what this process holds now)."""
        import torch

        first = next(model.parameters())
        dtype = str(first.dtype).removeprefix("torch.")
        held = sum(t.numel() * t.element_size() for t in model.parameters())
        shape = ModelShape.from_config(model.config, dtype=dtype, weight_bytes=held)
        if first.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(first.device)
            free = min(free, memory_limit) if memory_limit else free
        else:
            limit = memory_limit or memory_limit_bytes()
            free = limit - process_rss_bytes()
            if free <= 0:
                logger.warning("the process already holds more than the memory limit; planning with 256 MiB")
                free = 256 * MIB
        attention = attention_implementation(model.config) or "sdpa"
        planner = cls(shape, free, margin=margin, sliding_capped=not reuse, attention=attention,
                      kv_bits_options=kv_bits_options)
        planner.decode_step_s = decode_step_seconds(model)
        return planner
