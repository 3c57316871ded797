"""ChunkReuseCache: a DynamicCache that knows which tokens it holds and can be filled from a ChunkStore.

The cache itself does no lookups; the forward pre-hook in :mod:`kvboost_hf.reuse` loads
stored K/V into it and trims the prompt. What the cache adds to ``DynamicCache``:

- it records the token ids behind its K/V (transformers v5 passes no positions to ``update``);
- its layers can be loaded with stored K/V, and can hand back the K/V of every token they saw
  (sliding layers keep what their window would otherwise drop, so it can be stored);
- ``commit()`` writes the confirmed tokens' K/V to the store after generation.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvboost_hf.cache.buffer import BufferedLayer, BufferedSlidingLayer, buffered_layer_for

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvboost_hf.cache.stats import ReuseStats
    from kvboost_hf.store import ChunkStore
    from kvboost_hf.store.keys import Key
    from kvboost_hf.store.scope import CacheScope

logger = logging.getLogger(__name__)
_warned_unmanaged = False

Segment = tuple[torch.Tensor, torch.Tensor]
"""Keys and values of consecutive tokens, each ``[batch, num_kv_heads, num_tokens, head_dim]``."""


def _cat(segments: list[Segment]) -> Segment:
    if len(segments) == 1:
        return segments[0]
    return torch.cat([k for k, _ in segments], dim=-2), torch.cat([v for _, v in segments], dim=-2)


def as_batch(states: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """Stored ``[heads, tokens, dim]`` K or V as ``[batch, heads, tokens, dim]`` on ``device`` (a view when possible)."""
    t = states.unsqueeze(0)
    if t.device != device:
        t = t.to(device, non_blocking=True)
    return t.expand(batch, -1, -1, -1) if batch > 1 else t


def _with_pending(layer) -> Segment:
    """The layer's live K/V followed by its queued appends."""
    held = [(layer.keys, layer.values)] if layer.keys is not None and layer.keys.dim() == 4 else []
    return _cat(held + layer.pending)


class ReuseLayer(BufferedLayer):
    """Full-attention layer: holds every token, so its own tensors are the full history.

    ``append`` queues stored K/V and concatenates them once, when a forward next needs the
    layer: assembling a prompt from many stored chunks costs one copy, not one per chunk. A
    forward's new states are appended in place (:class:`~kvboost_hf.cache.buffer.BufferedLayer`).
    """

    kvboost_keys_in_order = True  # update() returns every key in order (kernels.plan.KEYS_IN_ORDER)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pending: list[Segment] = []

    def load(self, segments: list[Segment]) -> None:
        """Fill the (empty) layer with the K/V of the first tokens of the sequence."""
        keys, values = _cat(segments)
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.pending.append((keys, values))

    def flush(self) -> None:
        if self.pending:
            self.keys, self.values = _with_pending(self)
            self.pending = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.flush()
        return super().update(key_states, value_states, *args, **kwargs)

    kvboost_update = update  # the update the in-place protocol below mirrors (kernels.decoder)

    def kvboost_reserve(self, shape: tuple, dtype: torch.dtype):
        """:meth:`BufferedLayer.kvboost_reserve` after what update() does first (the queued K/V joined)."""
        self.flush()
        return BufferedLayer.kvboost_reserve(self, shape, dtype)

    kvboost_commit = BufferedLayer.kvboost_commit

    def get_seq_length(self) -> int:
        return super().get_seq_length() + sum(k.shape[-2] for k, _ in self.pending)

    def crop(self, tokens_to_remove: int) -> None:
        self.flush()
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.pending = []

    def full_states(self) -> Segment:
        self.flush()
        return self.keys, self.values


class ReuseSlidingLayer(BufferedSlidingLayer):
    """Sliding-window layer that also keeps the K/V its window drops, for storing them later."""

    kvboost_keys_in_order = True  # update() returns the window's keys in order, the new last (KEYS_IN_ORDER)

    def __init__(self, sliding_window: int, **kwargs) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.history: list[Segment] = []
        self.history_length = 0  # tokens in history (a crop trims it from the end, not by walking it)
        self.pending: list[Segment] = []
        self.capture = True

    def load(self, segments: list[Segment]) -> None:
        """Fill the (empty) layer: only the last ``sliding_window - 1`` tokens stay live, unless
        past recording is on (assisted decoding), where everything stays until the next ``crop``."""
        total = sum(k.shape[-2] for k, _ in segments)
        keep = total if self.record_past else self.sliding_window - 1
        tail, have = [], 0
        for seg in reversed(segments):
            tail.append(seg)
            have += seg[0].shape[-2]
            if have >= keep:
                break
        keys, values = _cat(tail[::-1])
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.keys, self.values = keys[..., -keep:, :], values[..., -keep:, :]
        self.cumulative_length = total
        self.history, self.history_length = list(segments), total

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Queue stored K/V of the next tokens (see :class:`ReuseLayer`); only the window stays live."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        if self.capture:
            self.history.append((keys, values))
            self.history_length += keys.shape[-2]
        self.pending.append((keys, values))
        self.cumulative_length += keys.shape[-2]

    def flush(self) -> None:
        if self.pending:
            keys, values = _with_pending(self)
            if not self.record_past:
                keys, values = keys[..., -(self.sliding_window - 1) :, :], values[..., -(self.sliding_window - 1) :, :]
            self.keys, self.values, self.pending = keys, values, []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.flush()
        if self.capture:
            self.history.append((key_states, value_states))
            self.history_length += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    kvboost_update = update  # the update the in-place protocol below mirrors (kernels.decoder)

    def kvboost_reserve(self, shape: tuple, dtype: torch.dtype):
        """:meth:`BufferedSlidingLayer.kvboost_reserve` after what update() does first (the queued K/V joined)."""
        self.flush()
        return BufferedSlidingLayer.kvboost_reserve(self, shape, dtype)

    def kvboost_commit(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """As update(): the new states also kept for storing, then the layer as the buffer leaves it."""
        if self.capture:
            self.history.append((key_states, value_states))
            self.history_length += key_states.shape[-2]
        BufferedSlidingLayer.kvboost_commit(self, key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized and not self.pending:
            # Nothing to crop; transformers 5.23's sliding crop of an empty layer reads keys.shape of
            # None (assisted decoding crops a draft's empty cache when the prompt is one token).
            return
        self.flush()
        super().crop(tokens_to_remove)
        if self.capture:
            self.history_length = _trim(self.history, self.history_length, self.cumulative_length)

    def reset(self) -> None:
        super().reset()
        self.history, self.pending = [], []
        self.history_length = 0
        self.capture = True

    def full_states(self) -> Segment:
        return _cat(self.history)


def _trim(segments: list[Segment], have: int, length: int) -> int:
    """Keep the first ``length`` of the ``have`` tokens of ``segments``, cutting from the end in place (a decode step
    appends one segment: walking from the start made every crop cost the whole reply); returns how many are left."""
    while segments and have > length:
        k, v = segments[-1]
        n = k.shape[-2]
        if have - n >= length:
            segments.pop()
            have -= n
        else:
            keep = n - (have - length)
            segments[-1] = (k[..., :keep, :], v[..., :keep, :])
            have = length
    return have


@dataclass
class ReuseRequest:
    """What the hook decided at the first forward of a request."""

    namespace: Key | None = None  # the root of the request's own chains (its CacheScope's)
    shared: Key | None = None  # the root of the shared chains it starts from, if any
    owner: str | None = None  # who its new entries are charged to
    epoch: int | None = None  # the owner's purge count when it began (a purge since drops its entries)
    prompt_tokens: int = 0
    commit_limit: int | None = None  # batch > 1 stores only the (shared) prompt


class ChunkReuseCache(DynamicCache):
    """A ``DynamicCache`` for one generate call that reuses and feeds a shared :class:`ChunkStore`.

    Use a fresh one per request (or let :func:`kvboost_hf.enable_chunk_reuse` create it): the
    reuse state lives in the store, not in the cache. ``copy.deepcopy`` shares the store.
    """

    def __init__(self, config: PretrainedConfig | None = None, store: ChunkStore | None = None) -> None:
        super().__init__(config=config)
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = ReuseLayer
        # other kinds (linear attention, indexed, dummy...) are kept as they are, and reuse is refused
        self.layers = [buffered_layer_for(layer, ReuseLayer, ReuseSlidingLayer) for layer in self.layers]
        self.store = store
        self.config = config
        self._token_chunks: list[torch.Tensor] = []
        self._num_tokens = 0
        self.trackable = True
        self.segments: list[int] = []  # extra chunk boundaries (token positions) for storing
        self.scope: CacheScope | None = None  # cache_salt: whose chains the request reads and feeds
        self.request: ReuseRequest | None = None
        self.stats: ReuseStats | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.request is None and layer_idx == 0:
            _warn_unmanaged()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    kvboost_update = update  # the update kvboost_updates_layers_only speaks for (kernels.decoder)

    def kvboost_updates_layers_only(self) -> bool:
        """Whether update() now adds nothing to its layers' updates (``kernels.decoder``'s in-place protocol): once
        a request manages the cache (else it warns)."""
        return self.request is not None

    # ------------------------------------------------------------------ state
    @property
    def supports_reuse(self) -> bool:
        """Whether the cache has its layers (a cache built without a config gets them only inside the first
        forward) and every one is a plain full or sliding attention layer that can be loaded."""
        return bool(self.layers) and all(isinstance(layer, (ReuseLayer, ReuseSlidingLayer)) for layer in self.layers)

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V this cache holds (loaded or computed)."""
        return self._num_tokens

    def token_ids(self) -> list[int]:
        """The token ids behind the cached K/V (row 0)."""
        if not self._token_chunks:
            return []
        return torch.cat(self._token_chunks).tolist()

    def track(self, token_ids: torch.Tensor) -> None:
        """Record the 1D token ids of K/V about to be appended."""
        self._token_chunks.append(token_ids.detach().reshape(-1))
        self._num_tokens += token_ids.numel()

    def untrack(self) -> None:
        """Stop tracking (e.g. ``inputs_embeds`` input): nothing of this request will be stored."""
        self.trackable = False
        self.stop_capture()

    def stop_capture(self) -> None:
        for layer in self.layers:
            if isinstance(layer, ReuseSlidingLayer):
                layer.capture = False

    def load(self, segments_per_layer: list[list[Segment]], token_ids: torch.Tensor) -> None:
        """Fill the empty cache with stored K/V of the first ``len(token_ids)`` tokens."""
        for layer, segments in zip(self.layers, segments_per_layer):
            layer.load(segments)
        self.track(token_ids)

    # ------------------------------------------------------------------ scattered forwards
    def begin_blend(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> None:
        """Hold every position ``[0, len)`` in order; the next forward computes ``positions`` only."""
        self.layers = [BlendLayer(layer, k, v, positions) for layer, (k, v) in zip(self.layers, buffers)]

    @property
    def blending(self) -> bool:
        return bool(self.layers) and isinstance(self.layers[0], BlendLayer)

    def end_blend(self) -> None:
        """Back to ordinary layers holding the blended positions in order."""
        if self.blending:
            self.layers = [layer.restore() for layer in self.layers]

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self._token_chunks:
            keep = max(0, self._num_tokens + tokens_to_remove)
            self._token_chunks = [torch.cat(self._token_chunks)[:keep]]
            self._num_tokens = keep

    def drop_rows(self, count: int) -> None:
        """Remove the last ``count`` rows of K/V that no tracked forward appended (a head draft forwards the
        model's decoder directly: its rows are tracked by the verification forward that takes them). The tracked
        token ids stay as they are; a sliding layer is cropped as ``crop`` crops it."""
        if count > 0:
            chunks, tokens = self._token_chunks, self._num_tokens
            self.crop(-count)
            self._token_chunks, self._num_tokens = chunks, tokens

    def reset(self) -> None:
        """Empty the cache so it can serve a new request (the store is untouched)."""
        super().reset()
        self._token_chunks, self._num_tokens = [], 0
        self.trackable, self.request, self.stats, self.segments = True, None, None, []

    def __deepcopy__(self, memo: dict) -> ChunkReuseCache:
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            shared = name in ("store", "config")
            setattr(new, name, value if shared else copy.deepcopy(value, memo))
        return new

    # ------------------------------------------------------------------ storing
    def commit(self, pin: bool = False, boundaries: list[int] = ()) -> int:
        """Store the K/V of every confirmed token not stored yet; returns the chunks added."""
        request = self.request
        if self.store is None or request is None or request.namespace is None:
            return 0
        if not self.trackable or not self.supports_reuse:
            return 0
        length = self._num_tokens if request.commit_limit is None else min(request.commit_limit, self._num_tokens)
        if length <= 0:
            return 0
        states = [layer.full_states() for layer in self.layers]
        if any(k.shape[-2] < length for k, _ in states):
            logger.debug("cache holds fewer tokens than tracked; nothing stored")
            return 0
        ids = self.token_ids()[:length]

        def chunk_states(start: int, end: int):
            keys = [k[0, :, start:end, :].clone() for k, _ in states]
            values = [v[0, :, start:end, :].clone() for _, v in states]
            return keys, values

        return self.store.insert(request.namespace, ids, chunk_states, pin=pin, boundaries=boundaries,
                                 shared=request.shared, owner=request.owner, epoch=request.epoch)


def _warn_unmanaged() -> None:
    global _warned_unmanaged
    if not _warned_unmanaged:
        _warned_unmanaged = True
        logger.warning(
            "A ChunkReuseCache is used on a model without chunk reuse enabled: it works like a DynamicCache and "
            "reuses nothing. Call kvboost_hf.enable_chunk_reuse(model, store) first (then generate needs no "
            "past_key_values at all)."
        )


class BlendLayer(DynamicLayer):
    """Stands in for a layer during a scattered forward: a buffer holding every position in order.

    ``update`` writes the forward's K/V into the buffer at the query positions and returns the
    whole buffer, so attention sees keys in position order (the mask maps query positions).
    """

    def __init__(self, original, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        super().__init__()
        self.original = original
        self.is_sliding = getattr(original, "is_sliding", False)
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.positions = positions.to(keys.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys[:, :, self.positions] = key_states
        self.values[:, :, self.positions] = value_states
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] - self.positions.numel()

    def restore(self):
        """The original layer holding the buffer's positions in order."""
        self.original.reset()
        self.original.load([(self.keys, self.values)])
        return self.original
