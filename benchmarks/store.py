"""ChunkStore at rest on Gemma-3-270M: bytes per token, load time per chunk (RAM / disk) vs
recomputing it, and the quality of int8 / int4 reuse against full prefill.

Usage: ``python benchmarks/store.py [--prompts 8] [--reps 5]``. Writes docs/benchmarks/store.json.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, essays, median, write_json  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402
from kvboost_hf.models.fingerprint import model_namespace  # noqa: E402
from kvboost_hf.models.target import target_model  # noqa: E402

SETTINGS = {
    "fp32 (kv_bits=None)": dict(kv_bits=None),
    "int8": dict(kv_bits=8),
    "int4": dict(kv_bits=4),
    "int4, 16 sink tokens": dict(kv_bits=4, sink_tokens=16),
}
CHUNK = 128


def load_chunk_ms(store: ChunkStore, namespace, ids: list[int], reps: int) -> float:
    """Median time to turn one stored chunk into dense per-layer K/V (what a hit costs)."""
    hits = store.lookup(namespace, ids)
    times = []
    for _ in range(reps):
        for hit in hits:
            t = time.perf_counter()
            for layer in range(hit.chunk.num_layers):
                hit.chunk.layer_states(layer, hit.num_tokens)
            times.append((time.perf_counter() - t) * 1000 / hit.num_tokens * CHUNK)
    return median(times)


def cold_chunk_ms(tier: dict, settings: dict, namespace, ids: list[int], reps: int) -> float:
    """Median time per chunk to look a prompt up in a store whose RAM is empty and decode it: from
    the disk tier (``tier={"disk_path": ...}``: read, verify) or Redis (``{"remote": ..., ...}``)."""
    times = []
    for _ in range(reps):
        store = ChunkStore(max_bytes=2_000_000_000, chunk_size=CHUNK, **tier, **settings)
        t = time.perf_counter()
        hits = store.lookup(namespace, ids)
        assert hits, "nothing found in the cold tier"
        for hit in hits:
            for layer in range(hit.chunk.num_layers):
                hit.chunk.layer_states(layer, hit.num_tokens)
        times.append((time.perf_counter() - t) * 1000 / len(hits))
    return median(times)


def recompute_chunk_ms(model, ids: torch.Tensor, start: int, reps: int) -> float:
    """Median time to forward one chunk at position ``start`` on top of a cache of what precedes it."""
    prefix_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :start], past_key_values=prefix_cache, use_cache=True)
        times = []
        for _ in range(reps):
            cache = copy.deepcopy(prefix_cache)
            t = time.perf_counter()
            model(ids[:, start : start + CHUNK], past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append((time.perf_counter() - t) * 1000)
    return median(times)


def quality(model, prompts, settings: dict, new_tokens: int) -> dict:
    """First-token KL and greedy agreement of reuse from this store vs full prefill, per prompt."""
    kls, agree, exact = [], [], []
    for prefix, full in prompts:
        disable_chunk_reuse(model)
        with torch.no_grad():
            ref = model.generate(full, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        store = ChunkStore(max_bytes=2_000_000_000, chunk_size=CHUNK, **settings)
        warm(model, prefix, store)
        enable_chunk_reuse(model, store)
        with torch.no_grad():
            out = model.generate(full, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        reused = last_request_stats(model).reused_tokens
        assert reused == prefix.shape[1], (reused, prefix.shape, store.stats())
        disable_chunk_reuse(model)
        p = F.log_softmax(ref.logits[0][0].float(), -1)
        q = F.log_softmax(out.logits[0][0].float(), -1)
        kls.append(F.kl_div(q, p, log_target=True, reduction="sum").item())
        a, b = ref.sequences[0, full.shape[1]:], out.sequences[0, full.shape[1]:]
        n = min(len(a), len(b))
        agree.append((a[:n] == b[:n]).float().mean().item())
        exact.append(float(torch.equal(a, b)))
    return {"first_token_kl": median(kls), "first_token_kl_max": max(kls),
            "greedy_token_agreement": sum(agree) / len(agree), "greedy_exact_match": sum(exact) / len(exact)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    model, tokenizer = load_default_model()
    namespace = model_namespace(target_model(model))
    texts = essays()
    ids = tokenizer(texts[0], return_tensors="pt")["input_ids"][:, :1024]
    prompts = []
    for i in range(args.prompts):
        text = texts[(i + 3) % len(texts)] + "\n\n" + texts[(i + 4) % len(texts)]
        full = tokenizer(text, return_tensors="pt")["input_ids"][:, :1000]
        prompts.append((full[:, :900], full))

    recompute = recompute_chunk_ms(model, ids, 512, args.reps)
    dense_bytes_per_token = None
    rows = {}
    for name, settings in SETTINGS.items():
        with tempfile.TemporaryDirectory() as path:
            store = ChunkStore(max_bytes=2_000_000_000, chunk_size=CHUNK, disk_path=path, **settings)
            warm(model, ids, store)
            per_token = store.nbytes / ids.shape[1]
            dense_bytes_per_token = dense_bytes_per_token or per_token
            row = {
                "bytes_per_token": per_token,
                "ratio_to_model_dtype": per_token / dense_bytes_per_token,
                "load_chunk_ram_ms": load_chunk_ms(store, namespace, ids[0].tolist(), args.reps),
                "load_chunk_disk_ms": cold_chunk_ms({"disk_path": path}, settings, namespace, ids[0].tolist(), args.reps),
                "recompute_chunk_ms": recompute,
            }
        row.update(quality(model, prompts, settings, args.new_tokens))
        rows[name] = row
        print(name, {k: round(v, 4) for k, v in row.items()}, flush=True)

    payload = {"model": "Gemma-3-270M (float32, CPU)", "chunk_size": CHUNK, "prompt_tokens": int(ids.shape[1]),
               "quality_prompts": args.prompts, "quality_prefix_tokens": 900, "quality_prompt_tokens": 1000,
               "new_tokens": args.new_tokens, "settings": rows, "environment": environment(),
               "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = write_json("store.json", payload)
    print("\n| setting | bytes/token | vs fp32 | load chunk, RAM | load chunk, disk | recompute chunk | "
          "first-token KL | greedy agreement | exact match |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['bytes_per_token']:.0f} | {r['ratio_to_model_dtype']:.3f} | {r['load_chunk_ram_ms']:.2f} ms | "
              f"{r['load_chunk_disk_ms']:.2f} ms | {r['recompute_chunk_ms']:.0f} ms | {r['first_token_kl']:.2e} | "
              f"{r['greedy_token_agreement']:.1%} | {r['greedy_exact_match']:.0%} |")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
