"""Two ISA paths of kvboost_hf's kernels on one model in one process: decode step and prefill, interleaved.

The packed Gemma-3-270M (``_common.resident_int4_gemma``) is loaded once; each pair of samples runs both
paths (``kernels.select_isa``, switched per sample, order alternating), a sample being a greedy ``generate``
of 1 and of 33 tokens after a 200-token prompt: the prefill is the first, a step (33 - 1) / 32 of the
difference. Cross-process runs of ``benchmarks/kernels.py`` move with the host's memory bandwidth; this
does not (both paths see the same moments).

    python benchmarks/isa_ab.py [--paths amx_bf16,avx512_bf16] [--pairs 9]
    python benchmarks/isa_ab.py --kernel   # the int4 op alone per Gemma layer shape and row count

``--kernel`` times ``torch.ops.kvboost.int4_linear`` on random int4 weights of Gemma-3-270M's shapes (group 128,
weights hot in cache, 2 threads) at 1-256 rows, each path's median of 7 batches of 50 calls, paths alternating per
shape; the ratio is the second path's time over the first's (above 1: the first is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from _common import resident_int4_gemma  # noqa: E402
from kvboost_hf import kernels  # noqa: E402


def timed_generate(model, ids: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return time.perf_counter() - start


KERNEL_SHAPES = ((1024, 640), (2048, 640), (640, 2048))
KERNEL_ROWS = (1, 4, 9, 16, 64, 256)


def kernel_ab(paths: list[str]) -> None:
    """Per shape and row count: each path's median ms per int4_linear call, and the ratio second / first."""
    from kvboost_hf.kernels import pack_int4

    gen = torch.Generator().manual_seed(6)
    for n, k in KERNEL_SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=gen)
        zeros = torch.randint(0, 16, (k // 128, n), generator=gen).float()
        scales = (torch.rand(k // 128, n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16).float()
        w = pack_int4(codes, zeros, scales, 128)
        for m in KERNEL_ROWS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            ms = {}
            for path in paths:
                kernels.select_isa(path)

                def call() -> torch.Tensor:
                    return torch.ops.kvboost.int4_linear(x, w.qweight, w.scales, w.zeros, 128, n)

                for _ in range(20):
                    call()
                batches = []
                for _ in range(7):
                    start = time.perf_counter()
                    for _ in range(50):
                        call()
                    batches.append((time.perf_counter() - start) / 50 * 1000)
                ms[path] = statistics.median(batches)
            a, b = paths
            print(f"{n}x{k} M={m:<4d} {a} {ms[a]:.3f} ms  {b} {ms[b]:.3f} ms  {b}/{a} {ms[b] / ms[a]:.2f}")
    kernels.select_isa(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default="amx_bf16,avx512_bf16")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--kernel", action="store_true", help="time the int4 op alone instead of the model")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if len(paths) != 2:
        raise SystemExit("--paths takes two paths, e.g. amx_bf16,avx512_bf16")
    for path in paths:
        if kernels.select_isa(path) != path:
            raise SystemExit(f"path {path} does not run on this CPU (best: {kernels.available().host_isa})")
    if args.kernel:
        kernel_ab(paths)
        return
    model, _ = resident_int4_gemma()
    ids = torch.randint(10, 20000, (1, 200), generator=torch.Generator().manual_seed(0))
    steps: dict[str, list[float]] = {p: [] for p in paths}
    prefills: dict[str, list[float]] = {p: [] for p in paths}
    for path in paths:  # warm-up
        kernels.select_isa(path)
        timed_generate(model, ids, 3)
    for i in range(args.pairs):
        for path in paths if i % 2 else paths[::-1]:
            kernels.select_isa(path)
            prefill = timed_generate(model, ids, 1)
            whole = timed_generate(model, ids, 33)
            steps[path].append((whole - prefill) / 32 * 1000)
            prefills[path].append(prefill * 1000)
    kernels.select_isa(None)
    for path in paths:
        print(f"{path:12s} step {statistics.median(steps[path]):7.2f} ms   prefill200 "
              f"{statistics.median(prefills[path]):7.1f} ms")
    a, b = paths
    ratios = [x / y for x, y in zip(steps[a], steps[b])]
    print(f"step {a}/{b} per pair: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
    ratios = [x / y for x, y in zip(prefills[a], prefills[b])]
    print(f"prefill {a}/{b} per pair: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
