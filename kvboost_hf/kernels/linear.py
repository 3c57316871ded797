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
    pointer, dtype, shape and version counter when it was made, and a strided sample of elements (their flat
    indices in the weight and in the copy), which also catches most edits that bypass the version counter
    (through ``.data``: only those that touch a sampled element)."""

    tiles: torch.Tensor
    key: tuple
    weight_index: torch.Tensor
    tile_index: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> TileCopy:
        tiles = tile_layout(weight)
        n, k = weight.shape
        step = max(1, n * k // _SAMPLES)
        flat = torch.arange(0, n * k, step)
        row, col = flat // k, flat % k
        tile = (((row // 16 * (k // 32) + col // 32) * 16 + col % 32 // 2) * 16 + row % 16) * 2 + col % 2
        return cls(tiles, _weight_key(weight), flat, tile)

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether the copy still holds ``weight``'s values (as far as the key and the samples tell)."""
        if _weight_key(weight) != self.key:
            return False
        with torch.no_grad():
            return torch.equal(weight.reshape(-1)[self.weight_index], self.tiles.reshape(-1)[self.tile_index])


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
        amx_bf16 path reads instead of the weight; returns whether one is kept. It costs the weight's size. It
        is remade whenever the weight is found changed (see :class:`TileCopy`), and dropped where the weight no
        longer allows one (not bf16 any more, for instance)."""
        copy = TileCopy.of(self.weight) if enabled and self.tiles_possible() else None
        self.__dict__["tile_copy"] = copy
        return copy is not None

    @property
    def tiles(self) -> torch.Tensor | None:
        """The tile copy as it was made (``None`` if there is none); :meth:`forward` checks it first."""
        copy = self.__dict__.get("tile_copy")
        return None if copy is None else copy.tiles

    def current_tiles(self) -> torch.Tensor | None:
        """The tile copy of the weight as it is now (remade first if the weight changed), or ``None``."""
        copy = self.__dict__.get("tile_copy")
        if copy is None:
            return None
        if not self.tiles_possible() or not copy.holds(self.weight):
            possible = self.tiles_possible()
            logger.info("the head's weight changed since its tile copy was made: %s it",
                        "remaking" if possible else "dropping")
            self.use_tiles(possible)
        return self.tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, tiles=self.current_tiles())
