"""What every repair strategy works on: the reuse plan of one prompt and a context to act on the cache."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.cache.chunk_reuse import as_batch
from kvboost_hf.models.rope import RopeShifter
from kvboost_hf.store import ChunkHit

_inner = threading.local()


def in_inner_forward() -> bool:
    """Whether the current thread is inside a forward run by the reuse machinery itself."""
    return getattr(_inner, "active", False)


@contextmanager
def inner_forward():
    _inner.active = True
    try:
        yield
    finally:
        _inner.active = False


class _StopForward(Exception):
    """Raised by a layer pre-hook to end a forward after the layers that were needed."""


@dataclass
class ReusePlan:
    """A prompt with its exact prefix already in the cache and content hits to place after it."""

    input_ids: torch.Tensor  # [batch, prompt_len], identical rows
    exact_len: int  # tokens [0, exact_len) hold exact prefill K/V
    hits: list[ChunkHit]  # content hits in prompt order, all at or after exact_len

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1]

    def starts_run(self, index: int) -> bool:
        """Whether hit ``index`` begins a seam (does not continue the previous hit's source text)."""
        if index == 0:
            return True
        prev, hit = self.hits[index - 1], self.hits[index]
        return not (
            prev.start + prev.num_tokens == hit.start
            and prev.offset + prev.num_tokens == prev.chunk.num_tokens
            and hit.offset == 0
            and hit.chunk.parent == prev.chunk.key
        )


@dataclass
class RepairOutcome:
    """What the real (generate) forward still has to compute, and what repair cost."""

    positions: torch.Tensor  # sorted prompt positions the real forward computes
    approximate_tokens: int  # reused tokens whose K/V were not recomputed
    layer_tokens: list[int]  # tokens each decoder layer processes for this prompt
    tracked: bool = False  # the cache already tracks every prompt token

    @property
    def contiguous(self) -> bool:
        p = self.positions
        return bool(p.numel() == 0 or (p[-1] - p[0] + 1 == p.numel()))


@dataclass
class RepairContext:
    """The model, cache, plan and shifter a strategy acts on, with the two moves it can make."""

    model: torch.nn.Module
    cache: ChunkReuseCache
    plan: ReusePlan
    shifter: RopeShifter
    layer_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_tokens:
            self.layer_tokens = [0] * len(self.cache.layers)

    @property
    def batch(self) -> int:
        return self.plan.input_ids.shape[0]

    def positions(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.plan.input_ids.device)

    def compute(self, start: int, end: int, stop_after_layer: int | None = None, track: bool = True) -> None:
        """Forward prompt tokens ``[start, end)`` on top of the cache (all layers, or up to ``stop_after_layer``)."""
        if end <= start:
            return
        ids = self.plan.input_ids[:, start:end]
        positions = self.positions(start, end).unsqueeze(0).expand(self.batch, -1)
        layers = decoder_layers(self.model)
        handle = None
        last = len(layers) - 1 if stop_after_layer is None else stop_after_layer
        if last < len(layers) - 1:
            def stop(module, args, kwargs):
                raise _StopForward

            handle = layers[last + 1].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            # The decoder alone: these forwards only fill the cache, so no LM head (a 262k-vocab
            # projection on Gemma) is computed for them.
            with torch.no_grad(), inner_forward():
                decoder(self.model)(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
        except _StopForward:
            pass
        finally:
            if handle is not None:
                handle.remove()
        for i in range(last + 1):
            self.layer_tokens[i] += end - start
        if track:
            self.cache.track(self.plan.input_ids[0, start:end])

    def hit_states(self, hit: ChunkHit, layer: int, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``hit`` for ``layer`` (minus its first ``skip`` tokens), moved to their prompt positions."""
        k, v = hit.layer_states(layer)
        device = self.plan.input_ids.device
        k, v = as_batch(k[:, skip:], 1, device), as_batch(v[:, skip:], self.batch, device)
        k = self.shifter.shift(k, hit.start - hit.source_start, layer)
        return (k.expand(self.batch, -1, -1, -1) if self.batch > 1 else k), v

    def load(self, hit: ChunkHit, skip: int = 0) -> None:
        """Append ``hit`` (minus its first ``skip`` tokens) to every layer of the cache, in order."""
        if skip >= hit.num_tokens:
            return
        for i, layer in enumerate(self.cache.layers):
            layer.append(*self.hit_states(hit, i, skip))
        self.cache.track(self.plan.input_ids[0, hit.start + skip : hit.start + hit.num_tokens])


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (without its LM head)."""
    return getattr(model, "model", None) or getattr(model, "base_model", model)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = decoder(model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def assemble_in_order(ctx: RepairContext, seam_tokens: int) -> RepairOutcome:
    """Fill the cache position by position: compute gaps (and the first ``seam_tokens`` of every
    hit that starts a seam) with their true preceding context, append the rest of each hit as
    stored. The real forward then computes the tokens after the last hit."""
    plan, pos, approximate = ctx.plan, ctx.plan.exact_len, 0
    for index, hit in enumerate(plan.hits):
        seam = min(seam_tokens, hit.num_tokens) if plan.starts_run(index) else 0
        ctx.compute(pos, hit.start + seam)  # the gap before the hit and its seam, in one forward
        ctx.load(hit, skip=seam)
        approximate += hit.num_tokens - seam
        pos = hit.start + hit.num_tokens
    tail = ctx.positions(pos, plan.prompt_len)
    layer_tokens = [n + tail.numel() for n in ctx.layer_tokens]
    return RepairOutcome(tail, approximate, layer_tokens)
