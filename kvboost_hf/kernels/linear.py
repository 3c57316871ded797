"""``KernelLinear``: an ``nn.Linear`` whose forward runs :func:`kvboost_hf.kernels.linear`.

Used for the output head of models whose other linears run on these kernels: the head keeps its
weight tensor (a tied embedding stays tied, no copy) and its rows become bit-independent too.
On a CPU with AMX it may also hold its weight in the tile layout (:func:`tile_layout`, a copy: the
weight's size again), which the amx_bf16 path reads instead: a verification's 9 rows then cost about
what one row costs, where the weight's own rows make them ~1.5x.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from kvboost_hf.kernels.ops import linear

logger = logging.getLogger(__name__)


def tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[N, K]`` weight (``K`` a multiple of 32) as the amx_bf16 head reads it: ``[NB, K / 32, 16, 16, 2]``
    with element ``[b, c, p, j, e] = weight[16 b + j, 32 c + 2 p + e]``, ``NB`` even (rows past ``N`` zero): each
    16-column block's k-pairs in order, one 1 KB tile per 32 k, so the weight streams in address order."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 32:
        raise ValueError(f"tile_layout takes a bf16 [N, K] weight with K a multiple of 32, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    padded = -(-n // 32) * 32
    rows = weight.detach()
    if padded != n:
        rows = torch.cat([rows, rows.new_zeros(padded - n, k)])
    return rows.reshape(padded // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


_SAMPLES = 128  # weight elements compared with their tile copy at every forward (~10 us on a 335 MB head)


@dataclasses.dataclass(frozen=True)
class TileCopy:
    """A weight's :func:`tile_layout` and what says it still holds the weight's values: the weight's data
    pointer, dtype, shape and version counter when it was made, and the bits of 128 elements at fixed
    pseudo-random places (every row and column band alike, whatever the shape), compared with their places in
    the copy, which also catches most edits that bypass the version counter (through ``.data``: those that
    touch a sampled element; a whole-tensor rewrite almost surely does)."""

    tiles: torch.Tensor
    key: tuple
    weight_index: torch.Tensor
    tile_index: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> TileCopy:
        tiles = tile_layout(weight)
        n, k = weight.shape
        picked = torch.randint(0, n * k, (_SAMPLES,), generator=torch.Generator().manual_seed(n * k))
        flat = torch.cat([picked, torch.tensor([0, n * k - 1])])
        row, col = flat // k, flat % k
        tile = (((row // 16 * (k // 32) + col // 32) * 16 + col % 32 // 2) * 16 + row % 16) * 2 + col % 2
        return cls(tiles, _weight_key(weight), flat, tile)

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether the copy still holds ``weight``'s values (as far as the key and the samples tell), bit for bit
        (a NaN holds as itself)."""
        if _weight_key(weight) != self.key:
            return False
        with torch.no_grad():
            held = weight.reshape(-1)[self.weight_index].view(torch.int16)
            return torch.equal(held, self.tiles.reshape(-1)[self.tile_index].view(torch.int16))


def _weight_key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), weight.dtype, tuple(weight.shape), weight._version


class KernelLinear(nn.Linear):
    """``nn.Linear`` on this package's CPU kernel; the weight stays bf16/float32 ``[out, in]``."""

    @classmethod
    def adopt(cls, module: nn.Linear) -> KernelLinear:
        """``module`` as a :class:`KernelLinear` sharing its parameters (a plain ``nn.Linear`` only)."""
        if type(module) is not nn.Linear:
            raise TypeError(f"KernelLinear adopts a plain nn.Linear, got {type(module).__name__}")
        adopted = cls.__new__(cls)
        adopted.__dict__ = module.__dict__  # the same parameters, hooks and flags: tying is kept
        adopted.__dict__.setdefault("tile_copy", None)
        adopted.__dict__.setdefault("tiles_wanted", False)
        return adopted

    @staticmethod
    def supports(module: nn.Module) -> bool:
        """Whether ``module`` is a plain CPU ``nn.Linear`` this kernel takes (bf16/float32, in_features % 16 == 0)."""
        return (type(module) is nn.Linear and module.weight.device.type == "cpu" and module.in_features % 16 == 0
                and module.weight.dtype in (torch.bfloat16, torch.float32))

    def tiles_possible(self) -> bool:
        """Whether the weight can have a tile copy: bf16, CPU, ``in_features`` a multiple of 32, a tensor that
        tracks in-place changes (not an inference-mode tensor)."""
        w = self.weight
        return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and w.shape[1] % 32 == 0
                and not w.is_inference())

    def use_tiles(self, enabled: bool = True) -> bool:
        """Keep (``enabled``) or drop a copy of the weight in the tile layout (:func:`tile_layout`), which the
        amx_bf16 path reads instead of the weight; returns whether one is kept now. It costs the weight's size.
        While enabled, a forward remakes it whenever it finds the weight changed (see :class:`TileCopy`), drops
        it while the weight does not allow one (:meth:`tiles_possible`: float32, for instance) and makes it
        again once it does. Pickles and copies of the module leave the copy out: they make their own at their
        first forward. A compiled forward (``torch.compile``) computes on the weight's own rows: the check is not
        traceable."""
        self.__dict__["tiles_wanted"] = bool(enabled)
        copy = TileCopy.of(self.weight) if enabled and self.tiles_possible() else None
        self.__dict__["tile_copy"] = copy
        return copy is not None

    @property
    def tiles(self) -> torch.Tensor | None:
        """The tile copy as it was made (``None`` if there is none); :meth:`forward` checks it first."""
        copy = self.__dict__.get("tile_copy")
        return None if copy is None else copy.tiles

    def current_tiles(self) -> torch.Tensor | None:
        """The tile copy of the weight as it is now (made or remade first where the weight changed), or ``None``."""
        if not self.__dict__.get("tiles_wanted") or torch.compiler.is_compiling():
            return None
        copy = self.__dict__.get("tile_copy")
        possible = self.tiles_possible()
        if copy is not None and possible and copy.holds(self.weight):
            return copy.tiles
        if copy is not None or possible:
            logger.info("the head's weight %s: %s its tile copy", "changed" if copy is not None else "allows a copy",
                        "dropping" if not possible else "remaking" if copy is not None else "making")
        self.__dict__["tile_copy"] = TileCopy.of(self.weight) if possible else None
        return self.tiles

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state["tile_copy"] = None  # remade from the weight where it lands (a pickle or copy would carry 2x)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, tiles=self.current_tiles())
