"""Prefix reuse on Gemma-3-270M: cold, warm, ideal and plain TTFT, in one process, interleaved.

Scenario: an earlier ~1,000-token prompt shares its first ~900 tokens with the timed
~1,000-token prompt. Each repetition uses fresh text and fresh stores, and rotates the order
of the four measurements:

- plain: ``model.generate`` without reuse (the whole prompt is forwarded);
- cold:  reuse enabled, empty store (nothing to hit; measures the overhead of capturing K/V);
- warm:  reuse enabled, the store holds the earlier prompt (lookup + load + suffix forward);
- ideal: HF's prompt-cache pattern with a pre-built DynamicCache of exactly the shared prefix,
         built outside the timing, so only the uncached suffix is forwarded.

TTFT is wall time from the generate call to the first generated token (a streamer marks it),
so it includes lookup and loading. Usage: ``python benchmarks/prefix_reuse.py [--reps 7]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, essays, median, write_json  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats  # noqa: E402
from kvboost_hf.generation.timing import FirstTokenTimer  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402


def build_prompts(tokenizer, rep: int, prefix_len: int, suffix_len: int):
    texts = essays()
    ids = tokenizer(texts[rep % len(texts)] + "\n\n" + texts[(rep + 1) % len(texts)], return_tensors="pt")["input_ids"]
    other = tokenizer(texts[(rep + 7) % len(texts)], add_special_tokens=False, return_tensors="pt")["input_ids"]
    prefix = ids[:, :prefix_len]
    earlier = torch.cat([prefix, other[:, :suffix_len]], dim=1)
    timed = ids[:, : prefix_len + suffix_len]
    assert earlier[0, prefix_len] != timed[0, prefix_len]
    return prefix, earlier, timed


CALL_S: dict[str, list[float]] = {}


def ttft(model, ids, record: str | None = None, **kw) -> float:
    """TTFT of a one-token generate; the whole call's time (incl. storing K/V) goes to CALL_S[record]."""
    timer = FirstTokenTimer()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False, streamer=timer.start(), **kw)
    if record:
        CALL_S.setdefault(record, []).append(time.perf_counter() - timer.started_at)
    return timer.ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=900)
    parser.add_argument("--suffix", type=int, default=100)
    parser.add_argument("--chunk-size", type=int, default=128)
    args = parser.parse_args()

    model, tokenizer = load_default_model()
    results = {"plain": [], "cold": [], "warm": [], "ideal": []}
    reused, lookup_ms = [], []

    def plain(timed, prefix, earlier):
        disable_chunk_reuse(model)
        return ttft(model, timed, record="plain")

    def cold(timed, prefix, earlier):
        enable_chunk_reuse(model, ChunkStore(max_bytes=1_000_000_000, chunk_size=args.chunk_size))
        t = ttft(model, timed, record="cold")
        disable_chunk_reuse(model)
        return t

    def warm(timed, prefix, earlier):
        enable_chunk_reuse(model, ChunkStore(max_bytes=1_000_000_000, chunk_size=args.chunk_size))
        ttft(model, earlier)  # the earlier request fills the store (untimed)
        t = ttft(model, timed)
        stats = last_request_stats(model)
        reused.append(stats.reused_tokens)
        lookup_ms.append(stats.lookup_ms)
        disable_chunk_reuse(model)
        return t

    def ideal(timed, prefix, earlier):
        disable_chunk_reuse(model)
        prompt_cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(prefix, past_key_values=prompt_cache, use_cache=True)
        cache = copy.deepcopy(prompt_cache)
        return ttft(model, timed, past_key_values=cache)

    runners = [plain, cold, warm, ideal]
    warm_up_prompts = build_prompts(tokenizer, 99, args.prefix, args.suffix)
    for runner in runners:  # one untimed pass of each, so no measurement pays first-call costs
        runner(warm_up_prompts[2], warm_up_prompts[0], warm_up_prompts[1])

    for rep in range(args.reps):
        prefix, earlier, timed = build_prompts(tokenizer, rep, args.prefix, args.suffix)
        order = runners[rep % 4 :] + runners[: rep % 4]
        for runner in order:
            results[runner.__name__].append(runner(timed, prefix, earlier))
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1] * 1000:.0f}ms" for k, v in results.items()), flush=True)

    med = {k: median(v) for k, v in results.items()}
    prompt_len = args.prefix + args.suffix
    payload = {
        "model": "Gemma-3-270M (float32, CPU)",
        "prompt_tokens": prompt_len,
        "shared_prefix_tokens": args.prefix,
        "chunk_size": args.chunk_size,
        "reps": args.reps,
        "median_ttft_s": med,
        "all_ttft_s": results,
        "tokens_forwarded": {"plain": prompt_len, "cold": prompt_len, "warm": prompt_len - median(reused),
                             "ideal": args.suffix},
        "median_call_s": {k: median(v[-args.reps:]) for k, v in CALL_S.items()},
        "reused_tokens_median": median(reused),
        "lookup_ms_median": median(lookup_ms),
        "ratios": {
            "warm_over_ideal": med["warm"] / med["ideal"],
            "cold_over_plain": med["cold"] / med["plain"],
            "plain_over_warm": med["plain"] / med["warm"],
        },
        "environment": environment(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path = write_json("prefix_reuse.json", payload)
    print()
    print("| run | TTFT (median) | tokens forwarded |")
    print("|---|---:|---:|")
    for name in ("plain", "cold", "warm", "ideal"):
        print(f"| {name} | {med[name] * 1000:.0f} ms | {payload['tokens_forwarded'][name]:.0f} |")
    r = payload["ratios"]
    print(f"\nwarm/ideal = {r['warm_over_ideal']:.3f} (target <= 1.25)   "
          f"cold/plain = {r['cold_over_plain']:.3f} (target <= 1.05)   "
          f"plain/warm = {r['plain_over_warm']:.1f}x   lookup+load = {payload['lookup_ms_median']:.1f} ms")
    calls = payload["median_call_s"]
    print(f"whole call incl. storing K/V: cold {calls['cold'] * 1000:.0f} ms vs plain {calls['plain'] * 1000:.0f} ms")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
