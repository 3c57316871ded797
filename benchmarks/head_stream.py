"""How fast the one-row LM head streams its weights against the bandwidth probe, in one process.

A decode step's floor (benchmarks/kernels.py) is its bytes over the probe's speed (``torch.sum`` over 512 MB on huge
pages). The step reads most of those bytes in the head, so how close the head op comes to the probe decides how much
of the step's time is left for the decoder. Here a Gemma-3-270M-sized bf16 head (262144 x 640, random values, on
huge pages) is read by ``torch.ops.kvboost.linear`` at one row, alternated round by round with ``torch.sum`` over
512 MB and 335 MB of float32 and over the head's own bf16: medians and ranges of GB/s, and the head's share of the
512 MB probe within each round.

    python benchmarks/head_stream.py [--rounds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from kvboost_hf import kernels
    from kvboost_hf.models.huge_pages import back_with_huge_pages

    status = kernels.available()
    if not status.built:
        raise SystemExit(f"kernels not built: {status.reason}")
    vocab, width = 262144, 640
    head = (torch.randn(vocab, width, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    probe = torch.ones(128 * 1024 * 1024)
    same_bytes = torch.ones(vocab * width // 2)  # float32 of the head's 335 MB
    back_with_huge_pages([head, probe, same_bytes])
    x = torch.randn(1, width).to(torch.bfloat16)
    reads = {
        "head op, one row": (lambda: torch.ops.kvboost.linear(x, head, None), head.numel() * 2),
        "torch.sum 512 MB float32 (the probe)": (probe.sum, probe.numel() * 4),
        "torch.sum 335 MB float32": (same_bytes.sum, same_bytes.numel() * 4),
        "torch.sum the head (335 MB bf16)": (head.sum, head.numel() * 2),
    }
    for read, _ in reads.values():  # untimed: first calls
        read()
    speeds: dict[str, list[float]] = {name: [] for name in reads}
    for r in range(args.rounds):
        for name in reads if r % 2 == 0 else reversed(reads):
            read, nbytes = reads[name]
            start = time.perf_counter()
            read()
            speeds[name].append(nbytes / (time.perf_counter() - start) / 1e9)
    print(f"{status.isa} kernels, {args.threads} threads, {args.rounds} rounds (alternated, order flipped each round)")
    for name, values in speeds.items():
        print(f"{name:38s} median {statistics.median(values):5.1f} GB/s  ({min(values):.1f}-{max(values):.1f})")
    shares = [h / p for h, p in zip(speeds["head op, one row"], speeds["torch.sum 512 MB float32 (the probe)"])]
    print(f"head op / probe, per round: median {statistics.median(shares):.2f} ({min(shares):.2f}-{max(shares):.2f})")


if __name__ == "__main__":
    main()
