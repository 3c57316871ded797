"""How far the int4 kernel's float32 output is from the exact product, on Gemma-3-270M's real layers.

Packs Gemma-3-270M with ``awq-pack`` defaults (round-to-nearest, group 128; the same file as
``benchmarks/kernels.py``), runs a real text through it on kernel="kvboost", captures every int4
linear's input (bf16 activations, as the linear gives the op), then per projection compares
``torch.ops.kvboost.int4_linear`` (float32, before the linear's bf16 rounding) with the exact product
``x @ ((q - z) * s).T`` in float64. Reported per projection kind, over all rows and outputs:

- the error relative to the element's natural scale ``sum_k |x| |w|`` (median and max; float32's
  epsilon is 6e-8),
- the fraction of outputs whose bf16 rounding (what the linear returns) differs from the bf16
  rounding of the exact product.

Run it per kernel source (``KVBOOST_HF_CSRC``) to compare numerics versions. The op gets float32
activations (to return float32), so it measures the float32 paths' numerics (scalar, avx2, avx512: the
same bits) even on an avx512_bf16 host, whose bf16-activation numerics this does not cover.

    python benchmarks/int4_accuracy.py [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch


def exact_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, n: int):
    """The weight ``(q - z) * s`` in float64 from the kernel layout (codes, scales, zeros exact there)."""
    nb, k = qweight.shape[:2]
    pairs = qweight.reshape(nb, k // 2, 1, 16)
    codes = torch.cat([pairs & 0xF, pairs >> 4], dim=2).reshape(nb, k, 16).double()
    w = (codes - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return w.transpose(1, 2).reshape(-1, k)[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from kvboost_hf import kernels
    from kvboost_hf.models import load_default_model
    from kvboost_hf.streaming import StreamingAWQConfig
    from kvboost_hf.streaming.linear import AWQInt4Linear

    from _common import essays, packed_gemma

    if not kernels.available().built:
        raise SystemExit(f"kernels not built: {kernels.available().reason}")
    path = packed_gemma()
    _, tokenizer = load_default_model()
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=StreamingAWQConfig(residency_mode="full_resident", kernel="kvboost"),
        dtype=torch.bfloat16).eval()
    ids = tokenizer(" ".join(essays()), return_tensors="pt").input_ids[:, : args.tokens]
    inputs: dict[str, torch.Tensor] = {}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, AWQInt4Linear)}
    hooks = [m.register_forward_pre_hook(lambda mod, a, name=name: inputs.setdefault(name, a[0].detach().clone()))
             for name, m in linears.items()]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()

    errors, flips, counts = defaultdict(list), defaultdict(float), defaultdict(int)
    for name, m in linears.items():
        x = inputs[name].reshape(-1, m.in_features).to(torch.bfloat16)
        scales, zeros = m.int4_scales_zeros[0], m.int4_scales_zeros[1]
        out = torch.ops.kvboost.int4_linear(x.float(), m.int4_weight, scales, zeros, m.group_size, m.out_features)
        w = exact_weight(m.int4_weight, scales, zeros, m.group_size, m.out_features)
        exact = x.double() @ w.T
        scale = x.double().abs() @ w.abs().T
        kind = name.rsplit(".", 1)[-1]
        errors[kind].append(((out.double() - exact).abs() / scale.clamp_min(1e-30)).flatten())
        flips[kind] += float((out.to(torch.bfloat16) != exact.to(torch.bfloat16)).sum())
        counts[kind] += out.numel()
    # (no numerics name: that is this checkout's Python, whatever sources KVBOOST_HF_CSRC built)
    report = {"csrc": os.environ.get("KVBOOST_HF_CSRC", "checkout"), "isa": f"{kernels.current_isa()}, float32 x",
              "tokens": int(ids.shape[1])}
    for kind in errors:
        e = torch.cat(errors[kind])
        report[kind] = {"median_rel": float(e.median()), "max_rel": float(e.max()),
                        "bf16_differs": flips[kind] / counts[kind]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
