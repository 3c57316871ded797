"""Fused projections: the int4 linears a decoder layer calls one after another on the same input
(``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) computed by one kernel call.

On a CPU decode step most of a small projection's cost is the call, not the weight: a 256 x 640
``k_proj`` takes ~21 us, of which ~5 us is reading its weight (Gemma-3-270M, this project's
2-core host). The first member of a :class:`ProjectionGroup` to run computes every member's output
over the group's concatenated weight and leaves the others' outputs for them; a member called
with another input (or the same tensor modified in place) computes its own, so a model that does
not call its projections on one input stays correct, only slower.

Exact: on kernels whose output columns are computed independently (``Int4Kernel.amortises_rows``,
kvboost_hf's own), a column's bits do not depend on which other columns share the call. Members'
buffers become views of the group's tensors, so the weights are held once and their content (and
so the model's namespace) is unchanged.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch
from torch import nn

from kvboost_hf.kernels.layout import BLOCK
from kvboost_hf.streaming.linear import AWQInt4Linear

logger = logging.getLogger(__name__)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # called in this order on one input
MAX_MISSES = 3  # first-member calls in a row that find the others' outputs unclaimed before a group dissolves


class ProjectionGroup:
    """Linears sharing an input and a kernel; ``members[0]``'s call computes them all."""

    def __init__(self, members: list[AWQInt4Linear]) -> None:
        self.members = members
        self.kernel = members[0].kernel
        self.group_size = members[0].group_size
        self.sizes = [m.out_features for m in members]
        self.packed = _joined([m.int4_weight for m in members], dim=0)
        self.side = _joined([m.int4_scales_zeros for m in members], dim=1)
        start = 0
        for member in members:  # one copy of the weights: the members' buffers view the group's
            blocks = member.out_features // BLOCK
            member.set_weight(self.packed[start : start + blocks], self.side[:, start : start + blocks])
            start += blocks
        self._views = [(m.int4_weight, m.int4_scales_zeros) for m in members]
        self._pending = threading.local()
        self._misses = 0
        for member in members:
            member.group = self

    def output(self, member: AWQInt4Linear, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for its input ``x`` (as rows, ``x2``): taken from the group's call on this
        very tensor if one left it, else (the first member) computed with the others'; None when the
        member must compute alone."""
        if torch.compiler.is_compiling():  # a traced graph holds no state between calls
            return None
        pending = getattr(self._pending, "outputs", None)
        if pending is not None and pending[0]() is x and pending[1] == _version(x) and member in pending[2]:
            out = pending[2].pop(member)
            if not pending[2]:
                self._pending.outputs = None
            return out
        if member is not self.members[0]:
            return None
        if not self._intact() or self._missed(pending):
            self.dissolve()
            return None
        joined = self.kernel.matmul(x2, self.packed, self.side, self.group_size, sum(self.sizes))
        outs = [part.contiguous() for part in joined.split(self.sizes, dim=-1)]
        # A weak reference: an input nobody else holds any more cannot come back, and is not kept alive.
        self._pending.outputs = (weakref.ref(x), _version(x), dict(zip(self.members[1:], outs[1:])))
        return outs[0]

    def dissolve(self) -> None:
        """Every member computes alone from now on (its buffers stay what they are)."""
        for member in self.members:
            if member.group is self:
                member.group = None
        self._pending = threading.local()

    def _intact(self) -> bool:
        """Whether every member still holds the views this group installed (a buffer assigned anew, by
        ``load_state_dict(assign=True)`` for instance, would otherwise be computed from the old weights)."""
        return all(m._buffers.get("int4_weight") is w and m._buffers.get("int4_scales_zeros") is s
                   for m, (w, s) in zip(self.members, self._views))

    def _missed(self, pending) -> bool:
        """Count calls that find the previous call's outputs unclaimed (a model that does not call its
        projections on one input: cross-attention, shared K/V); True after :data:`MAX_MISSES` in a row."""
        self._misses = self._misses + 1 if pending is not None and pending[2] else 0
        if self._misses >= MAX_MISSES:
            logger.info("unfused %s: its members are not called on one input", type(self.members[0]).__name__)
            return True
        return False

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_pending"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pending = threading.local()


def _version(x: torch.Tensor) -> int | None:
    """``x``'s version counter; inference tensors have none (an in-place write to one between two
    members' calls goes unseen: transformers' layers do not write to a projection's input)."""
    return None if x.is_inference() else x._version


def fuse_projections(root: nn.Module) -> int:
    """Group the resident int4 projections under ``root`` that :data:`GROUPS` names (same parent, same
    kernel with independent columns, same group size and input size, out_features multiples of 16);
    returns how many groups were formed. Idempotent."""
    formed = 0
    for parent in root.modules():
        for names in GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if _fusable(members):
                ProjectionGroup(members)
                formed += 1
    if formed:
        logger.info("fused %d groups of int4 projections under %s", formed, type(root).__name__)
    return formed


def _fusable(members: list) -> bool:
    if not all(isinstance(m, AWQInt4Linear) for m in members):
        return False
    first = members[0]
    return (all(m.group is None and not m.streamed and m.int4_weight is not None for m in members)
            and first.kernel.amortises_rows
            and all(type(m.kernel) is type(first.kernel) for m in members)
            and len({(m.in_features, m.group_size, m.int4_weight.device) for m in members}) == 1
            and all(m.out_features % BLOCK == 0 for m in members))


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)``, as a view without a copy when ``parts`` already lie back to back along
    ``dim`` in one storage (a draft's projections viewing its target's fused weights)."""
    span = _span(parts, dim)
    return span if span is not None else torch.cat(parts, dim=dim)


def _span(parts: list[torch.Tensor], dim: int) -> torch.Tensor | None:
    first = parts[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for a, b in zip(parts, parts[1:]):
        if (b.untyped_storage().data_ptr() != storage.data_ptr() or b.stride() != a.stride()
                or b.storage_offset() != a.storage_offset() + a.shape[dim] * a.stride(dim)):
            return None
    size = list(first.shape)
    size[dim] = sum(p.shape[dim] for p in parts)
    return first.new_empty(0).set_(storage, offset, size, first.stride())
