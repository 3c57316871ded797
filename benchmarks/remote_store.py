"""The shared Redis tier on Gemma-3-270M: what a remote hit costs, and what two replicas gain from sharing.

Part 1, per 128-token chunk (lossless fp32 and int4): turning a stored chunk into dense per-layer
K/V from local RAM; looking it up in Redis from a replica whose RAM is empty (successor list,
blob read, checksum and key verification, decode, promotion); and recomputing it (a forward of
the chunk at position 512 on top of a cache of what precedes it).

Part 2, a round-robin replay: conversations of several turns (an essay passage, then questions,
each turn appending the model's reply), where turn t of conversation c lands on replica
(c + t) mod 2. Both replicas are the same model with their own store; "local" stores are RAM
only, "shared" ones also use one Redis. Per request: TTFT (lookup included) and cached/prompt
tokens. Modes alternate per conversation; mean, p90 and per-turn medians over requests after
the first turn (turn 1 is the first hand-over to the other replica).

Needs a redis-server binary (the Makefile installs Debian's). Writes docs/benchmarks/remote_store.json.
Usage: ``python benchmarks/remote_store.py [--reps 5] [--conversations 6] [--turns 4]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import environment, essays, median, write_json  # noqa: E402
from store import CHUNK, cold_chunk_ms, load_chunk_ms, recompute_chunk_ms  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm  # noqa: E402
from kvboost_hf.generation.timing import FirstTokenTimer  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402
from kvboost_hf.models.namespace import namespace  # noqa: E402
from tests.conftest import start_redis  # noqa: E402

SETTINGS = {"fp32 (kv_bits=None)": {}, "int4": {"kv_bits": 4}}
QUESTIONS = [" What is the main claim here?", " Which example supports it?", " What would a critic say?",
             " Summarise it in one sentence.", " What follows from this?"]


def chunk_costs(model, tokenizer, url: str, reps: int) -> dict:
    ids = tokenizer(essays()[3], return_tensors="pt")["input_ids"][:, : 5 * CHUNK]
    ns = namespace(model)
    out = {"recompute_chunk_ms": recompute_chunk_ms(model, ids, 4 * CHUNK, reps)}
    for name, settings in SETTINGS.items():
        prefix = f"bench-{name.split()[0]}-{time.time_ns()}"
        writer = ChunkStore(max_bytes=2_000_000_000, chunk_size=CHUNK, remote=url, remote_prefix=prefix, **settings)
        warm(model, ids, writer)
        assert writer.flush(60)
        out[name] = {
            "ram_chunk_ms": load_chunk_ms(writer, ns, ids[0].tolist(), reps),
            "redis_chunk_ms": cold_chunk_ms({"remote": url, "remote_prefix": prefix}, settings, ns, ids[0].tolist(),
                                            reps),
        }
        out[name]["redis_vs_recompute"] = out[name]["redis_chunk_ms"] / out["recompute_chunk_ms"]
        print(name, out[name], flush=True)
    return out


def conversation(tokenizer, c: int, turns: int):
    passage = tokenizer.decode(tokenizer(essays()[10 + c])["input_ids"][1:400])
    return [("Passage:\n" + passage + "\n" if t == 0 else "") + QUESTIONS[t % len(QUESTIONS)] + "\nAnswer:"
            for t in range(turns)]


def replay(model, tokenizer, url: str | None, c: int, turns: int, new_tokens: int) -> list[dict]:
    prefix = f"replay-{c}-{time.time_ns()}"
    stores = [ChunkStore(max_bytes=2_000_000_000, chunk_size=CHUNK, remote=url, remote_prefix=prefix)
              if url else ChunkStore(max_bytes=2_000_000_000, chunk_size=CHUNK) for _ in range(2)]
    text, rows = "", []
    for t, piece in enumerate(conversation(tokenizer, c, turns)):
        text += piece
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        store = stores[(c + t) % 2]
        enable_chunk_reuse(model, store)
        timer = FirstTokenTimer()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=timer.start())
        stats = last_request_stats(model)
        store.flush(60)  # the other replica sees this turn once it is written (asynchronously)
        rows.append({"turn": t, "ttft_ms": timer.ttft * 1000, "prompt": stats.prompt_tokens,
                     "cached": stats.reused_tokens})
        text += tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    disable_chunk_reuse(model)
    return rows


def summarize(rows: dict) -> dict:
    """Per mode: TTFT mean, p90 and per-turn medians, and cached/prompt tokens, over turns after the first."""
    summary = {}
    for mode, rs in rows.items():
        later = [r for r in rs if r["turn"] > 0]
        ttfts = sorted(r["ttft_ms"] for r in later)
        turns = sorted({r["turn"] for r in later})
        summary[mode] = {
            "ttft_ms_mean": sum(ttfts) / len(ttfts),
            "ttft_ms_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "ttft_ms_median_by_turn": {t: median([r["ttft_ms"] for r in later if r["turn"] == t]) for t in turns},
            "cached_over_prompt": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
            "requests": len(later),
        }
    summary["ttft_mean_shared_over_local"] = summary["shared"]["ttft_ms_mean"] / summary["local"]["ttft_ms_mean"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    proc, url = start_redis()
    try:
        with torch.no_grad():
            model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=2, do_sample=False)
        costs = chunk_costs(model, tokenizer, url, args.reps)
        rows = {"local": [], "shared": []}
        for c in range(args.conversations):
            order = ["local", "shared"] if c % 2 == 0 else ["shared", "local"]
            for mode in order:
                rows[mode] += replay(model, tokenizer, url if mode == "shared" else None, c, args.turns, args.new_tokens)
    finally:
        proc.kill()
        proc.wait()
    summary = summarize(rows)
    print(summary, flush=True)
    path = write_json("remote_store.json", {"chunk_tokens": CHUNK, "chunk_costs": costs, "replay": summary,
                                            "replay_rows": rows, "args": vars(args), "environment": environment()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
