"""Two ISA paths of kvboost_hf's kernels on one model in one process: decode step and prefill, interleaved.

The packed Gemma-3-270M (``_common.resident_int4_gemma``) is loaded once; each pair of samples runs both
paths (``kernels.select_isa``, switched per sample, order alternating), a sample being a greedy ``generate``
of 1 and of 33 tokens after a 200-token prompt: the prefill is the first, a step (33 - 1) / 32 of the
difference. Cross-process runs of ``benchmarks/kernels.py`` move with the host's memory bandwidth; this
does not (both paths see the same moments).

    python benchmarks/isa_ab.py [--paths amx_bf16,avx512_bf16] [--pairs 9]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default="amx_bf16,avx512_bf16")
    parser.add_argument("--pairs", type=int, default=9)
    args = parser.parse_args()
    paths = args.paths.split(",")
    if len(paths) != 2:
        raise SystemExit("--paths takes two paths, e.g. amx_bf16,avx512_bf16")
    model, _ = resident_int4_gemma()
    for path in paths:
        if kernels.select_isa(path) != path:
            raise SystemExit(f"path {path} does not run on this CPU (best: {kernels.available().host_isa})")
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
