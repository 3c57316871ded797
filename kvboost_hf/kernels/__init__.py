"""CPU GEMM kernels for the weights kvboost_hf owns (int4 AWQ, int8, and their models' bf16/fp32 LM head).

Built from ``csrc/`` on first use (or by ``python -m kvboost_hf.kernels``), registered as
``torch.ops.kvboost.*``. Every path (scalar, AVX2, AVX-512) accumulates each output element in the
same fixed order, so a row's result does not depend on how many rows are computed with it, on
the thread count, or on the ISA path. Without a compiler, :func:`available` says why and callers
keep torch's kernels.

    >>> from kvboost_hf import kernels
    >>> kernels.available()  # doctest: +SKIP
    KernelStatus(built=True, isa='avx512', host_isa='avx512', reason='')
"""

from __future__ import annotations

from dataclasses import dataclass

from kvboost_hf.kernels.build import load_library
from kvboost_hf.kernels.layout import (
    DenseBlocks,
    Int4Blocks,
    Int8Blocks,
    int4_groups,
    int4_qweight,
    pack_dense,
    pack_int4,
    pack_int8,
    unpack_int4,
)
from kvboost_hf.kernels.decoder import fuse_decoder, unfuse_decoder
from kvboost_hf.kernels.layer import fuse_layers, unfuse_layers
from kvboost_hf.kernels.linear import KernelLinear, tile_layout
from kvboost_hf.kernels.ops import (
    ISA_LEVELS,
    current_isa,
    dense_linear,
    host_isa,
    int4_linear,
    int4_numerics,
    int8_linear,
    linear,
    loaded,
    select_isa,
    set_one_row_passes,
    set_vbmi,
)


@dataclass(frozen=True)
class KernelStatus:
    """``built``: the ops are loaded; ``isa``: the path in effect; ``host_isa``: the best this CPU has."""

    built: bool
    isa: str | None
    host_isa: str | None
    reason: str = ""


def available() -> KernelStatus:
    """Whether the kernels are built and loaded (building them once if needed), and which ISA runs."""
    if not loaded():
        return KernelStatus(False, None, None, load_library().reason)
    return KernelStatus(True, current_isa(), host_isa())


__all__ = [
    "ISA_LEVELS", "DenseBlocks", "Int4Blocks", "Int8Blocks", "KernelLinear", "KernelStatus", "available",
    "current_isa", "dense_linear", "fuse_decoder", "fuse_layers", "host_isa", "int4_groups", "int4_linear",
    "int4_numerics", "int4_qweight", "int8_linear", "linear", "pack_dense", "pack_int4", "pack_int8", "select_isa",
    "set_one_row_passes", "set_vbmi", "tile_layout", "unfuse_decoder", "unfuse_layers", "unpack_int4",
]
