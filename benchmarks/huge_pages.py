"""Weights on transparent huge pages against the same weights on 4 KiB pages, in one process.

Gemma-3-270M packed by ``awq-pack`` (int4, group 128, resident, kvboost kernels) is loaded twice,
``StreamingAWQConfig(huge_pages=False)`` and ``huge_pages=True``, and the bf16 float model twice, one copy
put on huge pages by ``back_with_huge_pages``. The four alternate sample by sample (order flipped every
round): a decode step after a 200-token prompt (after three warm steps, as in decoding), a 9-row forward
routed as speculation verifies, a 256-token prefill; then the 262k x 640 bf16 head alone, read back to
back and after the process slept 0.2 s and 1 s. A bandwidth probe runs on 4 KiB and on huge pages.
Greedy continuations of each pair are compared (the placement changes no value).

    python benchmarks/huge_pages.py [--reps 9] [--name huge_pages]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (  # noqa: E402
    ForwardTimes, environment, median, memory_bandwidth_gbs, resident_int4_gemma, write_json)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--name", default="huge_pages")
    args = parser.parse_args()

    from transformers import DynamicCache

    from kvboost_hf.models import load_default_model
    from kvboost_hf.models.huge_pages import back_with_huge_pages

    bandwidth = {"4k": memory_bandwidth_gbs(), "huge": memory_bandwidth_gbs(huge_pages=True)}
    models = {"int4 4k": resident_int4_gemma(huge_pages=False)[0], "int4 huge": resident_int4_gemma()[0]}
    for name in ("bf16 float 4k", "bf16 float huge"):
        models[name] = load_default_model()[0].to(torch.bfloat16).eval()
    report = back_with_huge_pages(models["bf16 float huge"])
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 20000, (1, 200), generator=gen)
    long = torch.randint(10, 20000, (1, 256), generator=gen)

    def prefilled(m):
        cache = DynamicCache(config=m.config)
        m(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(3):  # decoding touches every weight each step: time a step in that state
            m(prompt[:, -1:], past_key_values=cache, use_cache=True)
        return cache

    times = ForwardTimes(prompt, long, prefilled, warm_prefill=True)

    def head_after(idle: float):
        def run(m):
            head, x = m.get_output_embeddings(), torch.randn(1, 1, m.config.hidden_size, dtype=torch.bfloat16)
            head(x)
            time.sleep(idle)
            start = time.perf_counter()
            head(x)
            return time.perf_counter() - start
        return run

    what = {"step": times.step, "verify9_exact": functools.partial(times.verify, exact=True),
            "prefill256": times.prefill, "head": head_after(0.0),
            "head after 0.2 s idle": head_after(0.2), "head after 1 s idle": head_after(1.0)}
    samples = {name: {w: [] for w in what} for name in models}
    order = list(models)
    for rep in range(args.reps):
        for w, fn in what.items():
            if w == "verify9_exact":
                names = [n for n in order if n.startswith("int4")]  # a float model verifies with one SDPA a row
            else:
                names = order
            for name in names:
                samples[name][w].append(fn(models[name]) * 1e3)
        order.reverse()
    text = {name: m.generate(prompt[:, :64], max_new_tokens=24, do_sample=False)[0, 64:].tolist()
            for name, m in models.items()}
    ms = {name: {w: median(v) for w, v in s.items() if v} for name, s in samples.items()}
    out = {"environment": environment(), "bandwidth_gbs": bandwidth, "float_model_huge_pages": vars(report),
           "ms": ms, "greedy_same": {"int4": text["int4 4k"] == text["int4 huge"],
                                     "bf16 float": text["bf16 float 4k"] == text["bf16 float huge"]}}
    print(f"bandwidth probe: 4 KiB pages {bandwidth['4k']:.1f} GB/s, huge pages {bandwidth['huge']:.1f} GB/s")
    for w in what:
        for kind in ("int4", "bf16 float"):
            a, b = ms[f"{kind} 4k"].get(w), ms[f"{kind} huge"].get(w)
            if a is not None:
                print(f"{kind:10s} {w:22s} 4k {a:8.1f} ms  huge {b:8.1f} ms  4k/huge {a / b:.2f}x")
    print("greedy identical:", out["greedy_same"])
    print("written", write_json(f"{args.name}.json", out))


if __name__ == "__main__":
    main()
