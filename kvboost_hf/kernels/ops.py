"""Python entry points of ``torch.ops.kvboost`` (loaded by :mod:`.build`), with fake (meta) kernels
so that the ops trace under ``torch.compile``, and the choice of ISA path."""

from __future__ import annotations

import logging
import os
import threading

import torch

from kvboost_hf.kernels.build import load_library
from kvboost_hf.kernels.layout import DenseBlocks, Int4Blocks, Int8Blocks

logger = logging.getLogger(__name__)

# avx512_bf16 differs from avx512 only for int4 weights with bf16 activations (vdpbf16ps: its own bits);
# amx_bf16 from avx512_bf16 only there too, for group sizes a multiple of 32 (AMX tiles: bits of their own).
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16")
ISA_ENV = "KVBOOST_HF_KERNEL_ISA"  # force a path (lowered to what the CPU has)
VBMI_ENV = "KVBOOST_HF_KERNEL_VBMI"  # "0": the avx512_bf16 path decodes int4 without VBMI (see set_vbmi)
_TORCH_CAPABILITY = {"AVX512": "amx_bf16", "AVX2": "avx2"}  # torch.backends.cpu.get_cpu_capability()

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations the attention and norm ops take

_registered = False
_register_lock = threading.Lock()


def loaded() -> bool:
    """Whether the ops are usable in this process (building them on first call)."""
    global _registered
    if load_library().library is None:
        return False
    with _register_lock:  # fake kernels may be registered once only
        if not _registered:
            _register_fakes()
            select_isa(None)
            if os.environ.get(VBMI_ENV) == "0":
                set_vbmi(False)
            _registered = True
    return True


def default_isa() -> str:
    """``$KVBOOST_HF_KERNEL_ISA``, else the path matching torch's own (which honours ``ATEN_CPU_CAPABILITY``)."""
    wanted = os.environ.get(ISA_ENV)
    if wanted:
        if wanted not in ISA_LEVELS:
            raise ValueError(f"{ISA_ENV}={wanted!r}: expected one of {', '.join(ISA_LEVELS)}")
        return wanted
    return _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), "scalar")


def storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s memory, on any device (c10's use count of its storage), or None where the
    ops are not loaded in this process yet (this never builds or loads them)."""
    return int(torch.ops.kvboost.storage_users(tensor)) if _registered else None


def select_isa(name: str | None) -> str:
    """Run the kernels on ``name``'s path (``None``: :func:`default_isa`), lowered to what this CPU has;
    returns the path in effect. The scalar, AVX2 and AVX-512 paths give the same bits; avx512_bf16
    gives its own for int4 weights with bf16 activations (everything else as avx512)."""
    wanted = default_isa() if name is None else name
    if wanted not in ISA_LEVELS:
        raise ValueError(f"isa must be one of {', '.join(ISA_LEVELS)}, got {wanted!r}")
    if load_library().library is None:
        raise RuntimeError("kvboost_hf kernels are not built: see kvboost_hf.kernels.available()")
    level = torch.ops.kvboost.set_isa_level(ISA_LEVELS.index(wanted))
    if ISA_LEVELS[level] != wanted:
        logger.info("kernel path %s is not available on this CPU; using %s", wanted, ISA_LEVELS[level])
    return ISA_LEVELS[level]


def set_vbmi(allowed: bool) -> bool:
    """Let the avx512_bf16 path decode int4 codes with AVX-512 VBMI where the CPU has it (the default), or make it
    decode them as on a CPU with AVX-512 BF16 but no VBMI (Cooper Lake): the same bits, another speed; for tests
    and benchmarks of that decoding on any host (``$KVBOOST_HF_KERNEL_VBMI=0`` at load). Returns whether VBMI
    decoding is now in effect."""
    if load_library().library is None:
        raise RuntimeError("kvboost_hf kernels are not built: see kvboost_hf.kernels.available()")
    return bool(torch.ops.kvboost.set_vbmi(bool(allowed)))


def set_one_row_passes(rows: int | None) -> int:
    """Make the avx512_bf16 path's row-major bf16 kernel (an int4 model's LM head) pass over one weight row at a
    time for forwards of at most ``rows`` rows, two weight rows from 4 rows on beyond that; ``None``: this host's
    choice (up to 9 rows on AMD Zen 5 and later, where it was measured faster; 0 elsewhere). The same bits either
    way; for tests and benchmarks of both passes on any host. Returns the value now in effect."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows < 2**31):
        raise ValueError(f"set_one_row_passes(rows=...) takes a row count >= 0 or None, got {rows!r}")
    if load_library().library is None:
        raise RuntimeError("kvboost_hf kernels are not built: see kvboost_hf.kernels.available()")
    return int(torch.ops.kvboost.set_one_row_passes(-1 if rows is None else rows))


def int4_numerics() -> str:
    """The name of the bits the int4 op computes now (bf16 activations, as AWQ linears give it): the
    avx512_bf16 path has its own (``vdpbf16ps``, scale per group); amx_bf16 too (``TDPBF16PS``), named with a
    fingerprint of how this CPU's tiles round (also for a model whose groups are not a multiple of 32, which
    computes avx512_bf16's bits there: such a model's entries are not shared between the two paths); scalar,
    avx2 and avx512 share theirs, whose version the built library says (one built from sources older than that
    op computes v1). Without a built library no int4 op computes anything: ``"kvboost-int4-unbuilt"``."""
    if not loaded():
        return "kvboost-int4-unbuilt"
    if current_isa() == "avx512_bf16":
        return "kvboost-int4-bf16dot-v1"
    if current_isa() == "amx_bf16":  # how TDPBF16PS rounds is the CPU's: its fingerprint names it
        return f"kvboost-int4-amx-v1-{torch.ops.kvboost.amx_fingerprint():016x}"
    version = torch.ops.kvboost.int4_numerics_version() if hasattr(torch.ops.kvboost, "int4_numerics_version") else 1
    return f"kvboost-int4-fma-v{version}"


def current_isa() -> str:
    return ISA_LEVELS[torch.ops.kvboost.isa_level()]


def host_isa() -> str:
    return ISA_LEVELS[torch.ops.kvboost.host_isa_level()]


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    return x.reshape(-1, k)


def int4_linear(x: torch.Tensor, w: Int4Blocks) -> torch.Tensor:
    """``x @ W.T`` for an int4 weight, in ``x``'s dtype (float32 accumulation, rows independent)."""
    k = w.qweight.shape[1]
    out = torch.ops.kvboost.int4_linear(_rows(x, k), w.qweight, w.scales, w.zeros, w.group_size, w.out_features)
    return out.reshape(*x.shape[:-1], w.out_features)


def int8_linear(x: torch.Tensor, w: Int8Blocks) -> torch.Tensor:
    """``x @ W.T`` for an int8 weight with per-output-row scales, in ``x``'s dtype."""
    k = w.qweight.shape[1]
    out = torch.ops.kvboost.int8_linear(_rows(x, k), w.qweight, w.scales, w.out_features)
    return out.reshape(*x.shape[:-1], w.out_features)


def dense_linear(x: torch.Tensor, w: DenseBlocks) -> torch.Tensor:
    """``x @ W.T`` for a bf16 or float32 weight, in ``x``'s dtype (float32 accumulation, rows independent)."""
    k = w.weight.shape[1]
    out = torch.ops.kvboost.dense_linear(_rows(x, k), w.weight, w.out_features)
    return out.reshape(*x.shape[:-1], w.out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           tiles: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a bf16/float32 ``[N, K]`` weight as it is (``K`` a multiple of 16), in ``x``'s dtype:
    16 interleaved float32 partial sums over ``k`` added in a fixed tree, so rows stay bit-independent. With
    ``tiles`` (the weight's :func:`~kvboost_hf.kernels.linear.tile_layout`, which must hold this very weight's
    current values: the op checks only its shape, and two weights of one padded shape pass), the amx_bf16 path
    computes a bf16 ``x`` on AMX tiles instead (one chain over ``k`` per element, rows still independent); the
    other paths ignore them. :class:`~kvboost_hf.kernels.KernelLinear` keeps such a copy and checks it."""
    out = torch.ops.kvboost.linear(_rows(x, weight.shape[1]), weight, tiles)
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None, *,
              scale: float | None = None, causal: bool = False, window: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[B, H, M, D]`` over ``key``/``value`` ``[B, Hkv, N, D]`` (``H`` a multiple of
    ``Hkv``), returned as ``[B, M, H, D]`` in ``query``'s dtype (transformers' attention output layout).

    Query row ``i`` sits at position ``N - M + i``: with ``causal`` it reads keys up to there, with
    ``window`` only the last ``window`` of those; ``mask`` (bool, True = read, or float added to the
    scores; broadcast to ``[B, H, M, N]``) removes more. Each row is computed alone in float32 from its
    query and the keys it reads, in key order (``csrc/attention_body.inc``): the same bits for any row
    count, thread count, ISA path, and whatever else the cache holds."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return torch.ops.kvboost.attention(query, key, value, mask, float(scale), causal, window or 0)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * scale`` over the last dimension, in ``x``'s dtype (float32 inside; each
    row alone, its sum of squares in the dot-product order of ``csrc/norm_body.inc``)."""
    return torch.ops.kvboost.rms_norm(x, scale, float(eps))


def _register_fakes() -> None:
    def fake(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))

    torch.library.register_fake("kvboost::int4_linear")(lambda x, q, s, z, g, n: fake(x, n))
    torch.library.register_fake("kvboost::int8_linear")(lambda x, q, s, n: fake(x, n))
    torch.library.register_fake("kvboost::dense_linear")(lambda x, w, n: fake(x, n))
    torch.library.register_fake("kvboost::linear")(lambda x, w, tiles=None: fake(x, w.shape[0]))
    torch.library.register_fake("kvboost::rms_norm")(lambda x, scale, eps: x.new_empty(x.shape))  # contiguous
    torch.library.register_fake("kvboost::attention")(
        lambda q, k, v, mask, scale, causal, window: q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3])))

    def attention_inputs(hidden, norm, eps, qweights, sides, outs, groups, biases, q_norm, k_norm, head_eps, cos,
                         sin, head_dim):
        batch, rows = hidden.shape[:2]
        return tuple(hidden.new_empty((batch, out // head_dim, rows, head_dim)) for out in outs)

    torch.library.register_fake("kvboost::layer_attention_inputs")(attention_inputs)
    torch.library.register_fake("kvboost::layer_output")(
        lambda residual, attn, *args: residual.new_empty(residual.shape))


    def layer_step(hidden, qweights, sides, outs, groups, biases, *args):
        batch, rows = hidden.shape[:2]
        head_dim = args[10]
        kv = hidden.new_empty((batch, outs[1] // head_dim, rows, head_dim))
        return hidden.new_empty(hidden.shape), kv, torch.empty_like(kv)

    torch.library.register_fake("kvboost::layer_step")(layer_step)

    def decoder_step(hidden, qweights, sides, outs, groups, biases, norms, eps, head_norms, head_eps, head_dims,
                     *args):
        batch, rows = hidden.shape[:2]
        keys = [hidden.new_empty((batch, outs[7 * i + 1] // dim, rows, dim)) for i, dim in enumerate(head_dims)]
        return hidden.new_empty(hidden.shape), keys, [torch.empty_like(k) for k in keys]

    torch.library.register_fake("kvboost::decoder_step")(decoder_step)

    def draft_round(first, steps, embedding, embed_scale, final_norm, final_eps, head_q, head_scales, head_n,
                    head_tokens, ends_at, qweights, sides, outs, groups, biases, norms, eps, head_norms, head_eps,
                    head_dims, *args):
        n = torch.library.get_ctx().new_dynamic_size(min=1, max=steps)  # (it stops after an end token)
        keys = [embedding.new_empty((1, outs[7 * i + 1] // dim, n, dim)) for i, dim in enumerate(head_dims)]
        return (head_q.new_empty((n,), dtype=torch.long), embedding.new_empty((1, n, embedding.shape[1])), keys,
                [torch.empty_like(k) for k in keys])

    torch.library.register_fake("kvboost::draft_round")(draft_round)
