"""KVBuffer: a layer's keys and values in buffers with room to append in place; the cache layers built on it.

``DynamicLayer.update`` concatenates: every decode step copies the layer's whole history, so a
token's cost grows with the context (Gemma-3-270M's 18 layers at 700 tokens copy ~10 MB a step:
its int4 self-draft's token measured 9.96 ms concatenating, 9.50 ms appending in place, on CPU). A
:class:`KVBuffer` appends into spare capacity instead and hands out views.

The rule that keeps this exact: an append writes only where no view still alive can see, into a
buffer whose held view the layer still holds. A layer whose tensors were replaced since its last
append (a load of stored K/V, a beam reorder) is first copied into a fresh buffer, so a view handed
out earlier (to attention, to a caller) never sees a later write. A crop (assisted decoding drops the
rejected candidates' rows every round) keeps the buffer where the cropped views are a range of its live
rows and nothing else holds a view of it (the storage's use count says so): the next append then writes
over the dropped rows, which no one can read any more. Where something still holds a view (a caller's
saved ``layer.keys``), the crop is copied into a fresh buffer at the next append, as before (a refill
copied the whole history each round: ~4 ms a round of a head draft on a 700-token Gemma-3-270M request,
and it sent that round's first forward down the decoder's slower per-layer path).
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

SPARE_TOKENS = 256
"""Capacity a buffer gets past the tokens it holds: one copy per this many appended tokens, and at most
this many tokens of unused memory per layer (a prefill's buffer is exact: most are never extended)."""


class KVBuffer:
    """Keys and values ``[batch, heads, capacity, head_dim]`` of which ``[start:end]`` are live."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.start = 0
        self.end = 0
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # the views the layer holds, as last handed out

    def append(self, keys: torch.Tensor | None, values: torch.Tensor | None, new_keys: torch.Tensor,
               new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``/``values`` (the layer's current tensors, 4-d or empty) followed by the new states, as views."""
        if _tracked(keys, new_keys, new_values):  # autograd saved the views handed out: concatenate, as transformers
            self.held = None
            return _concatenated(keys, new_keys), _concatenated(values, new_values)
        n = new_keys.shape[-2]
        if not self._extends(keys, values, new_keys, new_values):
            self._refill(keys, values, new_keys, new_values)
        self.keys[..., self.end : self.end + n, :] = new_keys
        self.values[..., self.end : self.end + n, :] = new_values
        self.end += n
        return self.live()

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The live keys and values, as the views the layer is expected to hold."""
        self.held = (self.keys[..., self.start : self.end, :], self.values[..., self.start : self.end, :])
        return self.held[0], self.held[1]  # a tuple of the caller's own: one kept refers to the views (cropped)

    def keep_last(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the last ``count`` live tokens stay live (a sliding window); earlier ones are never written again.
        ``count`` 0 keeps them all, as transformers' ``[-0:]`` slice does for a window of one."""
        if count > 0:
            self.start = max(self.start, self.end - count)
        return self.live()

    def room(self, keys, values, shape: tuple, dtype: torch.dtype) -> bool:
        """Whether new CPU states of ``shape`` ``[batch, heads, rows, head_dim]`` and ``dtype`` (keys and values
        alike) can be written into the buffers at ``end`` as :meth:`append` would write them, without a refill."""
        return (self._open(keys, values, shape[2]) and _fits(self.keys, shape, dtype, _CPU)
                and _fits(self.values, shape, dtype, _CPU))

    def written(self, rows: int) -> None:
        """``rows`` new states were written at ``end`` (where :meth:`room` said they fit); :meth:`live` or
        :meth:`keep_last` then hands out the views."""
        self.end += rows

    def cropped(self, keys: torch.Tensor | None, values: torch.Tensor | None):
        """The layer's views after a crop of the views :meth:`live` last handed out: where ``keys``/``values`` are
        one range of the live rows of both buffers and no other view of them is alive, that range becomes the live
        rows (later appends write after it, in place) and its views are returned; else ``(keys, values)`` as they
        are (the next append refills). The buffers themselves are not handed out as views are: one who holds them
        (``keys._base``, :meth:`BufferedLayer.kvboost_reserve`'s) sees every append, into their spare rows too."""
        held = self.held
        if (not _COUNTS_EVERY_HOLDER or held is None or not isinstance(keys, torch.Tensor)
                or not isinstance(values, torch.Tensor)
                or (keys is held[0] and values is held[1])):  # (nothing cropped: the buffer is still open)
            return keys, values
        span = _rows_of(self.keys, keys, self.start, self.end)
        if span is None or span != _rows_of(self.values, values, self.start, self.end):
            return keys, values
        # No one holds the views handed out (the layer dropped them), nor any other view of the buffers.
        if not (_held_only_by(held, 0) and _held_only_by(held, 1) and _only_views(self.keys, held[0], keys)
                and _only_views(self.values, held[1], values)):
            return keys, values
        self.start, self.end = span
        return self.live()

    def _extends(self, keys, values, new_keys: torch.Tensor, new_values: torch.Tensor) -> bool:
        return (self._open(keys, values, new_keys.shape[-2])
                and _fits(self.keys, new_keys.shape, new_keys.dtype, new_keys.device)
                and _fits(self.values, new_values.shape, new_values.dtype, new_values.device))

    def _open(self, keys, values, rows: int) -> bool:
        """Whether the layer still holds the views last handed out and ``rows`` more fit past ``end``."""
        return (self.held is not None and keys is self.held[0] and values is self.held[1]
                and self.end + rows <= self.keys.shape[-2]
                # a buffer made under inference_mode cannot be written outside it
                and not (self.keys.is_inference() and not torch.is_inference_mode_enabled()))

    def _refill(self, keys, values, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        held = keys is not None and keys.dim() == 4 and keys.shape[-2] > 0
        if held and (keys.shape[:2] != new_keys.shape[:2] or values.shape[:2] != new_values.shape[:2]):
            torch.cat([keys, new_keys], dim=-2)  # raises what DynamicLayer raises (another batch or head count)
        length = keys.shape[-2] if held else 0
        room = length + new_keys.shape[-2] + (SPARE_TOKENS if length else 0)  # a first (prefill) append: exact
        self.keys = _empty(keys if held else None, new_keys, room)
        self.values = _empty(values if held else None, new_values, room)
        if held:
            self.keys[..., :length, :] = keys
            self.values[..., :length, :] = values
        self.start, self.end = 0, length

    def clear(self) -> None:
        """Forget the buffers (a layer's reset): their memory goes with them."""
        self.keys = self.values = self.held = None
        self.start = self.end = 0


def _empty(held: torch.Tensor | None, new: torch.Tensor, room: int) -> torch.Tensor:
    """A buffer for ``room`` tokens shaped as ``new``, in the dtype torch.cat would give (history, then new)."""
    dtype = new.dtype if held is None else torch.promote_types(held.dtype, new.dtype)
    return new.new_empty((*new.shape[:2], room, new.shape[-1]), dtype=dtype)


def _tracked(keys: torch.Tensor | None, new_keys: torch.Tensor, new_values: torch.Tensor) -> bool:
    """Whether autograd records this forward: appending in place would modify tensors its graph saved."""
    return torch.is_grad_enabled() and (new_keys.requires_grad or new_values.requires_grad
                                        or keys is not None and keys.requires_grad)


def _concatenated(held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if held is None or held.dim() != 4 or held.shape[-2] == 0 else torch.cat([held, new], dim=-2)


def _rows_of(buffer: torch.Tensor, view: torch.Tensor, start: int, end: int) -> tuple[int, int] | None:
    """``(first, last)`` where ``view`` is ``buffer[..., first:last, :]`` with ``start <= first <= last <= end``,
    else None."""
    # (addresses, not untyped_storage(): asking for the storage object keeps one alive, a use _only_views counts)
    if (view.dim() != 4 or view.dtype != buffer.dtype or view.device != buffer.device
            or view.shape[:2] != buffer.shape[:2] or view.shape[-1] != buffer.shape[-1]
            or view.stride() != buffer.stride()):
        return None
    offset, row = view.data_ptr() - buffer.data_ptr(), buffer.stride(2) * buffer.element_size()
    if offset < 0 or offset % row:
        return None
    first = offset // row
    last = first + view.shape[-2]
    return (first, last) if start <= first <= last <= end else None


_ALONE = (object(),)  # an object only a tuple refers to: the reference count _held_only_by expects
# A reference held in C++ (a DLPack capsule, a tensor made from one) shows in the view's Python reference count on the
# torch this was tested on (2.13: PyObject preservation reworked in 2.10); older versions may miss such a holder, so
# crops there copy as before.
_COUNTS_EVERY_HOLDER = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)


def _held_only_by(pair: tuple, index: int) -> bool:
    """Whether ``pair[index]`` has no referrer but ``pair``."""
    return sys.getrefcount(pair[index]) <= sys.getrefcount(_ALONE[0])


def _only_views(buffer: torch.Tensor, *views: torch.Tensor) -> bool:
    """Whether the tensors alive on ``buffer``'s memory are ``buffer`` and ``views``, no other. The count comes from
    the kernels' ``storage_users`` op (c10's public use count; torch's Python API has none), and only where a model
    on them loaded it already (looked up, never imported or built here): elsewhere a crop copies as before."""
    ops = sys.modules.get("kvboost_hf.kernels.ops")
    users = None if ops is None else ops.storage_users(buffer)
    return users is not None and users == len({id(t) for t in (buffer, *views)})


def _fits(buffer: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether states of ``shape``, ``dtype`` and ``device`` can be written into ``buffer`` as they are."""
    return (buffer.dtype == dtype and buffer.device == device and buffer.shape[:2] == shape[:2]
            and buffer.shape[-1] == shape[-1])


_CPU = torch.device("cpu")


class BufferedLayer(DynamicLayer):
    """``DynamicLayer`` that appends a forward's new states in place instead of concatenating."""

    kvboost_keys_in_order = True  # update() returns every key in order (kernels.plan.KEYS_IN_ORDER)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.buffer = KVBuffer()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.buffer.append(self.keys, self.values, key_states, value_states)
        return self.keys, self.values

    kvboost_update = update  # the update the in-place protocol below mirrors (kernels.decoder)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.keys, self.values = self.buffer.cropped(self.keys, self.values)

    def kvboost_reserve(self, shape: tuple, dtype: torch.dtype):
        """Where a fused int4 decoder may write a forward's new states itself (``kernels.decoder``'s in-place
        protocol): ``(key buffer, value buffer, first key update() would return, position of the new rows)``, or None
        where update() must take them (nothing held yet, no room left, another dtype or shape)."""
        buffer = self.buffer
        if not self.is_initialized or not buffer.room(self.keys, self.values, shape, dtype):
            return None
        return buffer.keys, buffer.values, buffer.start, buffer.end

    def kvboost_commit(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The new states were written where :meth:`kvboost_reserve` said: the layer as update() leaves it."""
        self.buffer.written(key_states.shape[-2])
        self.keys, self.values = self.buffer.live()

    def reset(self) -> None:
        super().reset()
        self.buffer.clear()


class BufferedSlidingLayer(DynamicSlidingWindowLayer):
    """``DynamicSlidingWindowLayer`` that appends in place: its update is transformers 5.23's, the buffer's
    append standing in for the concatenation."""

    kvboost_keys_in_order = True  # update() returns the window's keys in order, the new last (KEYS_IN_ORDER)

    def __init__(self, sliding_window: int, **kwargs) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.buffer = KVBuffer()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys, values = self.buffer.append(self.keys, self.values, key_states, value_states)
        if not self.record_past:  # only the last sliding_window - 1 stay; the forward sees them all
            if self.buffer.held is None:  # concatenated (autograd records this forward)
                window = -self.sliding_window + 1
                self.keys, self.values = keys[:, :, window:, :], values[:, :, window:, :]
            else:
                self.keys, self.values = self.buffer.keep_last(self.sliding_window - 1)
            return keys, values
        # recording the past (assisted decoding): all stay until the next crop; the forward sees what the mask expects
        self.keys, self.values = keys, values
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:, :], values[:, :, -visible:, :]

    kvboost_update = update  # the update the in-place protocol below mirrors (kernels.decoder)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.keys, self.values = self.buffer.cropped(self.keys, self.values)

    def kvboost_reserve(self, shape: tuple, dtype: torch.dtype):
        """As :meth:`BufferedLayer.kvboost_reserve`; the first key is the first update() returns (recording the past:
        the window before the new rows)."""
        buffer = self.buffer
        if not self.is_initialized or not buffer.room(self.keys, self.values, shape, dtype):
            return None
        first = max(buffer.start, buffer.end - (self.sliding_window - 1)) if self.record_past else buffer.start
        return buffer.keys, buffer.values, first, buffer.end

    def kvboost_commit(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """As :meth:`BufferedLayer.kvboost_commit`: the layer as update() leaves it."""
        buffer = self.buffer
        self.cumulative_length += key_states.shape[-2]
        buffer.written(key_states.shape[-2])
        self.keys, self.values = buffer.live() if self.record_past else buffer.keep_last(self.sliding_window - 1)

    def reset(self) -> None:
        super().reset()
        self.buffer.clear()


def buffered_layer_for(layer, full: type = BufferedLayer, sliding: type = BufferedSlidingLayer):
    """The ``full`` / ``sliding`` layer standing in for a fresh transformers layer of that kind, or the layer
    itself when it is of another (linear attention, indexed, dummy...)."""
    if type(layer) is DynamicLayer:
        return full()
    if type(layer) is DynamicSlidingWindowLayer:
        return sliding(sliding_window=layer.sliding_window)
    return layer


def in_place_layer(layer):
    """The in-place layer standing in for ``layer``, a transformers dynamic layer that holds nothing yet, with every
    attribute ``layer`` has (its window, a past recording ``generate`` switched on...); None for a layer of another
    kind or one that holds states. What a fused int4 decoder swaps into ``generate``'s new ``DynamicCache``
    (:func:`kvboost_hf.kernels.decoder.fuse_decoder`)."""
    if layer.is_initialized:
        return None
    new = buffered_layer_for(layer)
    if new is layer:
        return None
    new.__dict__.update((name, value) for name, value in vars(layer).items() if name != "buffer")
    return new


class BufferedCache(DynamicCache):
    """A ``DynamicCache`` whose layers append in place (:class:`BufferedLayer`, :class:`BufferedSlidingLayer`):
    the same keys and values, without copying the history at every step. Layers of other kinds (linear attention,
    ...) stay transformers' own."""

    def __init__(self, config=None, **kwargs) -> None:
        super().__init__(config=config, **kwargs)
        self.layers = [buffered_layer_for(layer) for layer in self.layers]
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = BufferedLayer
