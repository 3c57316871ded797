"""``LayerStreamer``: staging slots, a prefetch thread and the decoder-layer hooks that use them.

Streamed decoder layers run in a fixed order. When layer ``S[j]`` starts, its weights must sit
in a staging slot (hit, late or miss); the streamer then asks the prefetch thread for the next
``n_staging_slots - 1`` streamed layers, wrapping from the last streamed layer to the first for
the next token. When the layer finishes, its slot is freed and the window moves on. At most
``n_staging_slots`` streamed layers are materialised at any time.

On a CPU a slot holds views of the host source's tensors (no copy; the source ``prepare``s the
pages, e.g. readahead of an mmap'd file), so "materialised" means "prefetched": the slots bound
how far ahead the prefetcher works. On CUDA (untested here: no CUDA machine in this project's CI) copies run on a side stream and
the slot is reused only after the compute stream has passed the layer that read it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from kvboost_hf.streaming.linear import AWQInt4Linear
from kvboost_hf.streaming.source import HostSource
from kvboost_hf.streaming.stats import StreamingStats

logger = logging.getLogger(__name__)


@dataclass
class _Slot:
    index: int
    layer: int | None = None
    in_use: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    released: object = None  # CUDA event recorded when compute last finished with the slot


class LayerStreamer:
    """Moves streamed layers' packed weights from a host source into ``n_slots`` staging slots."""

    def __init__(
        self,
        decoder_layers: nn.ModuleList,
        streamed: dict[int, list[tuple[str, AWQInt4Linear]]],
        source: HostSource,
        n_slots: int,
        prefetch: bool,
        device: torch.device,
        stats: StreamingStats,
    ) -> None:
        self.streamed = streamed
        self.order = sorted(streamed)
        self.position = {layer: j for j, layer in enumerate(self.order)}
        self.source = source
        self.prefetch = prefetch
        self.device = device
        self.in_place = device.type == "cpu"  # compute reads host tensors directly; see HostSource
        self.stats = stats
        self.slots = [_Slot(i) for i in range(n_slots)]
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._hooks = []
        for layer in self.order:
            module = decoder_layers[layer]
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(layer)))
            self._hooks.append(module.register_forward_hook(self._post_hook(layer), always_call=True))
        self._allocate_buffers()
        self._thread: threading.Thread | None = None
        if prefetch and self.order:
            # The thread holds only a weak reference: a model nobody uses any more can be freed.
            self._thread = threading.Thread(target=_worker, args=(weakref.ref(self), self._queue),
                                            name="kvboost-awq-prefetch", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)

    # ---- setup -----------------------------------------------------------------------------
    def _allocate_buffers(self) -> None:
        """One buffer per streamed linear shape and slot, allocated once (slot memory is fixed)."""
        if self.in_place:
            return
        largest = max(self.order, key=lambda l: sum(self.source.nbytes(n) for n, _ in self.streamed[l]), default=None)
        if largest is None:
            return
        total = 0
        for slot in self.slots:
            for name, _ in self.streamed[largest]:
                src = self.source.tensor(name)
                slot.buffers[self._suffix(name)] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                total += src.numel() * src.element_size()
        self.stats.staging_bytes = total

    @staticmethod
    def _suffix(name: str) -> str:
        """``model.layers.3.mlp.up_proj`` -> ``mlp.up_proj`` (the name inside a decoder layer)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if parts[i].isdigit():
                return ".".join(parts[i + 1 :])
        return name

    def _buffer(self, slot: _Slot, name: str) -> torch.Tensor:
        src = self.source.tensor(name)
        key = self._suffix(name)
        buf = slot.buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            # A layer shaped unlike the largest one: its slot buffer is replaced, memory stays bounded.
            buf = slot.buffers[key] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        return buf

    # ---- loading ---------------------------------------------------------------------------
    def _load(self, slot: _Slot, layer: int) -> None:
        start = time.perf_counter()
        moved = 0
        if self._copy_stream is not None:  # untested here
            with torch.cuda.stream(self._copy_stream):
                if slot.released is not None:
                    self._copy_stream.wait_event(slot.released)
                for name, _ in self.streamed[layer]:
                    moved += self.source.copy_into(name, self._buffer(slot, name), non_blocking=True)
            self._copy_stream.synchronize()
        elif self.in_place:
            for name, _ in self.streamed[layer]:
                slot.buffers[self._suffix(name)] = self.source.tensor(name)
                moved += self.source.prepare(name)
        else:
            for name, _ in self.streamed[layer]:
                moved += self.source.copy_into(name, self._buffer(slot, name))
        self.source.throttle(moved, start)  # one sleep per layer (benchmarks only)
        self.stats.add(loads=1, bytes_moved=moved, load_ms=(time.perf_counter() - start) * 1000)

    def _run_job(self, slot: _Slot, layer: int) -> None:
        try:
            self._load(slot, layer)
        except BaseException as err:  # handed to the layer that needs the weights
            logger.exception("prefetch of layer %d failed", layer)
            slot.error = err
        finally:
            with self._cond:
                slot.ready.set()
                self._cond.notify_all()

    # ---- slot bookkeeping (callers hold self._cond) -------------------------------------------
    def _slot_of(self, layer: int) -> _Slot | None:
        return next((s for s in self.slots if s.layer == layer), None)

    def _free_slot(self, evict_ready: bool) -> _Slot | None:
        for slot in self.slots:
            if slot.layer is None and not slot.in_use:
                return slot
        if evict_ready:  # a finished prefetch nobody asked for yet (e.g. after an interrupted forward)
            for slot in self.slots:
                if not slot.in_use and slot.ready.is_set():
                    return slot
        return None

    def _assign(self, slot: _Slot, layer: int) -> None:
        slot.layer = layer
        slot.error = None
        slot.ready.clear()

    def _schedule_after(self, layer: int) -> None:
        """Request the streamed layers after ``layer`` (wrapping) while free slots last."""
        j = self.position[layer]
        for k in range(1, len(self.slots) + 1):
            target = self.order[(j + k) % len(self.order)]
            if target == layer:
                break
            if self._slot_of(target) is not None:
                continue
            slot = self._free_slot(evict_ready=False)
            if slot is None:
                break
            self._assign(slot, target)
            self._queue.put((slot, target))

    # ---- hooks -----------------------------------------------------------------------------
    def acquire(self, layer: int) -> None:
        """Make ``layer``'s weights available to its modules (waiting or loading as needed)."""
        start = time.perf_counter()
        load_here = False
        with self._cond:
            for slot in self.slots:  # layers run one at a time: a slot still in use is stale
                if slot.in_use:
                    self._release_slot(slot)
            slot = self._slot_of(layer)
            if slot is None:
                kind = "misses"
                while (slot := self._free_slot(evict_ready=True)) is None:
                    self._cond.wait()
                self._assign(slot, layer)
                load_here = True
            else:
                kind = "hits" if slot.ready.is_set() else "late"
            slot.in_use = True
        if load_here:
            try:
                self._load(slot, layer)
            except BaseException as err:
                slot.error = err
            slot.ready.set()
        else:
            slot.ready.wait()
        if slot.error is not None:
            with self._cond:
                self._release_slot(slot)
            raise RuntimeError(f"loading streamed weights of decoder layer {layer} failed") from slot.error
        blocked = (time.perf_counter() - start) * 1000 if kind != "hits" else 0.0
        self.stats.add(**{kind: 1}, blocked_ms=blocked)
        for name, module in self.streamed[layer]:
            module.staged_weight = slot.buffers[self._suffix(name)]
        if self.prefetch:
            with self._cond:
                self._schedule_after(layer)

    def _release_slot(self, slot: _Slot) -> None:
        if slot.layer is not None:
            for _, module in self.streamed[slot.layer]:
                module.staged_weight = None
        if self._copy_stream is not None:  # untested here
            slot.released = torch.cuda.current_stream(self.device).record_event()
        slot.in_use = False
        slot.layer = None
        self._cond.notify_all()

    def release(self, layer: int) -> None:
        """Free ``layer``'s slot once its forward is done and move the prefetch window on."""
        with self._cond:
            slot = self._slot_of(layer)
            if slot is not None and slot.in_use:
                self._release_slot(slot)
            if self.prefetch:
                self._schedule_after(layer)

    def _pre_hook(self, layer: int):
        def hook(module, args):
            self.acquire(layer)

        return hook

    def _post_hook(self, layer: int):
        def hook(module, args, output):
            self.release(layer)

        return hook

    def close(self) -> None:
        """Stop the prefetch thread and remove the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None


def _worker(streamer_ref: weakref.ref, jobs: queue.SimpleQueue) -> None:
    """Prefetch thread: load queued ``(slot, layer)`` jobs until told to stop or the streamer is gone."""
    while True:
        job = jobs.get()
        if job is None:
            return
        streamer = streamer_ref()
        if streamer is None:
            return
        streamer._run_job(*job)
        del streamer
