"""Two kernel sources against each other: one-thread and two-thread int4 GEMM times, alternating processes.

A kernel change that should be faster is measured here before the whole-model benchmark
(``benchmarks/kernels.py``), whose decode step moves by 20% between runs on a shared 2-core VM. Each
round runs one process per source tree (``KVBOOST_HF_CSRC`` points the build at it; the build is
cached by the sources' hash), ``--rounds`` times, in the order base, new, then new, base (ABBA: a
drift of the host's speed falls on both); each process times Gemma-3-270M's int4 layer shapes
(group 128, weights hot in cache) at M = 1, 9 and 256 rows, the minimum of 7 batches. The report
gives each source's median over rounds and the median and range of the per-round ratios base / new
(a round's two processes ran back to back, so their ratio is the least disturbed figure). Where the host moves
more between two processes than a change is worth (a shared 2-vCPU VM: rounds spread 0.6-2.0 on 2026-11-29),
``benchmarks/kernel_ab_inprocess.py`` alternates the two trees call by call in one process instead.

    git archive HEAD csrc | tar -x -C /tmp/base        # the sources to compare against
    python benchmarks/kernel_sources_ab.py --base /tmp/base/csrc [--new csrc] [--rounds 3] [--head]

``--head`` times the bf16 LM head instead (262k x 640 in nn.Linear's [N, K] layout, as an int4 Gemma's tied head
runs, two threads; 335 MB, so read from DRAM on every call) at M = 1, 4, 6, 9 and 12 rows, the median of 5 calls.
``--attention`` times the attention op over Gemma-3-270M's heads (4 query heads, one key head, dim 256, bf16), two
threads, as a forward calls it: 18 calls, each layer its own K/V, after reading 64 MB (a step's weights evict the
K/V): a decode row over 300 and 2000 keys, 9 rows over 300 (a verification), a 256-token prefill; the median of 15.

The activations are bf16, as an AWQ linear gives them: on an avx512_bf16 host they take that path's own
kernel; set ``KVBOOST_HF_KERNEL_ISA=avx512`` (or avx2) to compare the float32 paths there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

SHAPES = {"gate+up 4096x640": (4096, 640), "down 640x2048": (640, 2048), "q_proj 1024x640": (1024, 640)}
ROWS = (1, 9, 256)
HEAD_ROWS = (1, 4, 6, 9, 12)


def built_kernels():
    """``kvboost_hf.kernels``, built from ``$KVBOOST_HF_CSRC`` (the worker's sources), or exit saying why not."""
    from kvboost_hf import kernels

    if not kernels.available().built:
        raise SystemExit(f"kernels not built: {kernels.available().reason}")
    return kernels


def head_worker() -> dict:
    import torch

    kernels = built_kernels()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(262144, 640, generator=gen).to(torch.bfloat16)
    xs = {m: torch.randn(m, 640, generator=gen).to(torch.bfloat16) for m in HEAD_ROWS}
    times: dict[int, list[float]] = {m: [] for m in HEAD_ROWS}
    for _ in range(5):
        for m, x in xs.items():
            start = time.perf_counter()
            kernels.linear(x, weight)
            times[m].append((time.perf_counter() - start) * 1e6)
    return {f"lm_head 262144x640 M={m} threads={torch.get_num_threads()}": median(t) for m, t in times.items()}


ATTENTION_CASES = {"decode row, 300 keys": (1, 300), "9 rows, 300 keys": (9, 300), "256-token prefill": (256, 256),
                   "decode row, 2000 keys": (1, 2000)}


def attention_worker() -> dict:
    import torch

    built_kernels()
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    evict = torch.zeros(16 * 1024 * 1024)
    out = {}
    for name, (rows, keys) in ATTENTION_CASES.items():
        layers = [(torch.randn(1, 4, rows, 256, generator=gen).bfloat16(),
                   torch.randn(1, 1, keys, 256, generator=gen).bfloat16(),
                   torch.randn(1, 1, keys, 256, generator=gen).bfloat16()) for _ in range(18)]
        times = []
        for _ in range(15):
            evict.sum()
            start = time.perf_counter()
            for q, k, v in layers:
                torch.ops.kvboost.attention(q, k, v, None, 0.0625, True, 0)
            times.append((time.perf_counter() - start) * 1e6)
        out[f"attention x18, {name}"] = median(times)
    return out


def worker() -> dict:
    import torch

    kernels = built_kernels()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (n, k) in SHAPES.items():
            codes = torch.randint(0, 16, (n, k), generator=gen)
            zeros = torch.randint(0, 16, (k // 128, n), generator=gen).float()
            blocks = kernels.pack_int4(codes, zeros, torch.rand(k // 128, n, generator=gen) * 0.02, 128)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                calls = max(2, 400 // m)
                batches = []
                for _ in range(7):
                    start = time.perf_counter()
                    for _ in range(calls):
                        kernels.int4_linear(x, blocks)
                    batches.append((time.perf_counter() - start) / calls * 1e6)
                out[f"{name} M={m} threads={threads}"] = min(batches)
    return out


def run(csrc: str, what: list[str]) -> dict:
    env = dict(os.environ, KVBOOST_HF_CSRC=str(Path(csrc).resolve()))
    command = [sys.executable, __file__, "--worker", *what]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="csrc directory of the sources to compare against")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parent.parent / "csrc"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head", action="store_true", help="time the bf16 LM head instead of the int4 layers")
    parser.add_argument("--attention", action="store_true", help="time the attention op instead of the int4 layers")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(head_worker() if args.head else attention_worker() if args.attention else worker()))
        return
    what = ["--head"] if args.head else ["--attention"] if args.attention else []
    if not args.base:
        parser.error("--base is required")
    samples: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    order = [("base", args.base), ("new", args.new)]
    for round_ in range(args.rounds):
        for label, csrc in order if round_ % 2 == 0 else order[::-1]:
            for key, us in run(csrc, what).items():
                samples[label].setdefault(key, []).append(us)
    print(f"{'shape, rows, threads':40s} {'base us':>10s} {'new us':>10s} {'base/new: median':>17s} {'range':>12s}")
    for key, base in samples["base"].items():
        new = samples["new"][key]
        ratios = sorted(b / n for b, n in zip(base, new))
        print(f"{key:40s} {median(base):10.1f} {median(new):10.1f} {median(ratios):17.2f} "
              f"{ratios[0]:5.2f}-{ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
