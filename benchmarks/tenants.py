"""Tenants on the server (``--api-keys``), on the embedded Gemma-3-270M: what isolation costs, and what a
prefix prober learns.

Two parts, one process, greedy, the app served by uvicorn on 127.0.0.1 in a thread:

- ``cost``: 4 tenants hold multi-turn chats (their turns interleaved) that open with one company system
  prompt, once on a one-key server (everything shared; the system prompt warmed) and once with
  ``--api-keys`` (each tenant its own entries; the system prompt warmed by an admin as shared). Rounds
  alternate the order; each figure is the median over rounds. Reported: median TTFT of the turns after
  the first, the reuse ratio (cached / prompt tokens), and the spread between rounds of one setting.
- ``attack``: tenant A sends a prompt. Tenant B knows its opening and, for each of the next ``--positions``
  tokens, 8 candidates of which one is A's; it appends each candidate to what it has recovered and keeps
  the one with the most ``cached_tokens`` (none when they tie), or the fastest (timing). Each probe runs
  under a fresh ``cache_salt``, so B's own entries never help it. Bits recovered: 3 per position
  identified by ``cached_tokens``; the timing guess is compared with chance (1 in 8) by a binomial tail.
  The same attack on the one-key server is the control: it must recover the prompt.

Usage: ``python benchmarks/tenants.py [--rounds 3] [--turns 4] [--positions 12]``; writes
``docs/benchmarks/tenants.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, rank_sum_p, serve_in_thread, write_json  # noqa: E402
from server_load import SYSTEM_PROMPT, TOPICS  # noqa: E402

from kvboost_hf import ChunkStore  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402

MODEL = "gemma-3-270m"
KEYS = {f"sk-tenant-{k}": {"tenant": f"t{k}"} for k in range(4)} | {"sk-admin": {"tenant": "ops", "admin": True}}
SINGLE_KEY = "sk-one"
FILLER = 1000  # a token id B appends after each candidate


def start(model, tokenizer, tenants: bool, keys_dir: Path):
    """A fresh store and app: ``--api-keys`` (tenants) or one ``--api-key``; (server, thread, base URL)."""
    from kvboost_hf.server import ServerSettings, create_app

    path = keys_dir / "keys.json"
    path.write_text(json.dumps(KEYS))
    settings = ServerSettings(model_name=MODEL, api_keys_file=str(path) if tenants else None,
                              api_key=None if tenants else SINGLE_KEY, workers=1)
    app = create_app(model, tokenizer, ChunkStore(max_bytes=1_000_000_000, chunk_size=64), settings)
    server, thread, url = serve_in_thread(app, startup_timeout=60)
    return server, thread, url.removesuffix("/v1")


def stop(server, thread) -> None:
    server.should_exit = True
    thread.join(timeout=60)


def ask(client: httpx.Client, base: str, key: str, path: str, body: dict) -> tuple[dict, float]:
    start = time.perf_counter()
    reply = client.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    elapsed = time.perf_counter() - start
    reply.raise_for_status()
    return reply.json(), elapsed


def chat_round(model, tokenizer, tenants: bool, turns: int, keys_dir: Path) -> dict:
    """One pass of the 4 tenants' chats; per-turn TTFT (a 1-token reply: arrival to first token) and reuse."""
    server, thread, base = start(model, tokenizer, tenants, keys_dir)
    keys = [k for k, v in KEYS.items() if not v.get("admin")] if tenants else [SINGLE_KEY] * 4
    rows = []
    try:
        with httpx.Client() as client:
            warm = {"messages": [{"role": "system", "content": SYSTEM_PROMPT}], **({"shared": True} if tenants else {})}
            ask(client, base, "sk-admin" if tenants else SINGLE_KEY, "/v1/warm", warm)
            chats = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in keys]
            for turn in range(turns):
                for t, key in enumerate(keys):
                    chats[t].append({"role": "user", "content": f"Tell me {TOPICS[(5 * t + turn) % len(TOPICS)]}."})
                    body = {"model": MODEL, "messages": chats[t], "max_tokens": 1, "temperature": 0}
                    reply, seconds = ask(client, base, key, "/v1/chat/completions", body)
                    usage = reply["usage"]
                    rows.append({"tenant": t, "turn": turn, "ttft_s": seconds, "prompt_tokens": usage["prompt_tokens"],
                                 "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
                    # the next turn continues the chat with a fixed assistant answer (the same in both settings)
                    chats[t].append({"role": "assistant", "content": "Here is the short answer you asked for."})
    finally:
        stop(server, thread)
    later = [r for r in rows if r["turn"] > 0]
    return {"ttft_median_s": statistics.median(r["ttft_s"] for r in later),
            "reuse_ratio": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
            "first_turn_ttft_median_s": statistics.median(r["ttft_s"] for r in rows if r["turn"] == 0)}


def cost_part(model, tokenizer, args, keys_dir: Path) -> dict:
    runs: dict[str, list[dict]] = {"one_key": [], "tenants": []}
    for r in range(args.rounds):
        order = ["one_key", "tenants"] if r % 2 == 0 else ["tenants", "one_key"]
        for name in order:
            runs[name].append(chat_round(model, tokenizer, name == "tenants", args.turns, keys_dir))
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    out = {}
    for name, rows in runs.items():
        ttfts = [x["ttft_median_s"] for x in rows]
        out[name] = {"ttft_median_s": statistics.median(ttfts), "ttft_round_spread": (max(ttfts) - min(ttfts)) / min(ttfts),
                     "reuse_ratio": statistics.median(x["reuse_ratio"] for x in rows),
                     "first_turn_ttft_median_s": statistics.median(x["first_turn_ttft_median_s"] for x in rows),
                     "rounds": rows}
    out["ttft_ratio_tenants_over_one_key"] = out["tenants"]["ttft_median_s"] / out["one_key"]["ttft_median_s"]
    return out


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def attack(model, tokenizer, tenants: bool, positions: int, keys_dir: Path) -> dict:
    server, thread, base = start(model, tokenizer, tenants, keys_dir)
    victim, prober = ("sk-tenant-0", "sk-tenant-1") if tenants else (SINGLE_KEY, SINGLE_KEY)
    rng = random.Random(11)
    secret = tokenizer(SYSTEM_PROMPT)["input_ids"][:200]  # A's prompt (B knows its first 150 tokens)
    known = secret[:150]
    vocab = model.config.get_text_config(decoder=True).vocab_size
    by_cache = by_time = 0
    probe_times, miss_times = [], []
    try:
        with httpx.Client() as client:
            ask(client, base, victim, "/v1/completions", {"model": MODEL, "prompt": secret, "max_tokens": 1})
            for i in range(positions):
                truth = secret[150 + i]
                candidates = [truth] + rng.sample(range(1000, vocab), 7)
                rng.shuffle(candidates)
                seen = []
                for c in candidates:
                    # a token after the candidate: the last prompt token is always forwarded, never cached
                    body = {"model": MODEL, "prompt": known + [c, FILLER], "max_tokens": 1,
                            "cache_salt": f"probe-{i}-{c}"}
                    if not tenants:
                        body.pop("cache_salt")  # one tenant: B probes the shared cache as any client does
                    reply, seconds = ask(client, base, prober, "/v1/completions", body)
                    seen.append((reply["usage"]["prompt_tokens_details"]["cached_tokens"], seconds, c))
                    (probe_times if c == truth else miss_times).append(seconds)
                top = max(s[0] for s in seen)
                leaders = [s for s in seen if s[0] == top]
                by_cache += len(leaders) == 1 and leaders[0][2] == truth
                by_time += min(seen, key=lambda s: s[1])[2] == truth
                known = known + [truth]  # B proceeds as if it had guessed right: the worst case for us
    finally:
        stop(server, thread)
    return {"positions": positions, "bits_recovered_by_cached_tokens": 3 * by_cache,
            "positions_identified_by_cached_tokens": by_cache, "positions_guessed_by_timing": by_time,
            "timing_guess_p_vs_chance": binomial_tail(by_time, positions, 1 / 8),
            "timing_rank_sum_p_true_vs_other_candidates": rank_sum_p(probe_times, miss_times),
            "median_probe_s": statistics.median(probe_times + miss_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--positions", type=int, default=12)
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    with tempfile.TemporaryDirectory() as keys_dir:
        cost = cost_part(model, tokenizer, args, Path(keys_dir))
        attacks = {name: attack(model, tokenizer, name == "tenants", args.positions, Path(keys_dir))
                   for name in ("one_key", "tenants")}
    result = {"environment": environment(), "args": vars(args), "cost": cost, "attack": attacks}
    path = write_json("tenants.json", result)
    print(f"\n| setting | median TTFT, turns 2+ | reuse ratio | first-turn TTFT | round spread |")
    print("|---|---|---|---|---|")
    for name in ("one_key", "tenants"):
        c = cost[name]
        print(f"| {name} | {c['ttft_median_s'] * 1000:.0f} ms | {c['reuse_ratio']:.3f} | "
              f"{c['first_turn_ttft_median_s'] * 1000:.0f} ms | {c['ttft_round_spread']:.1%} |")
    print(f"TTFT ratio tenants / one key: {cost['ttft_ratio_tenants_over_one_key']:.3f}")
    for name, a in attacks.items():
        print(f"attack on {name}: {a['bits_recovered_by_cached_tokens']} bits by cached_tokens "
              f"({a['positions_identified_by_cached_tokens']}/{a['positions']} positions), timing guesses right "
              f"{a['positions_guessed_by_timing']}/{a['positions']} (p vs chance {a['timing_guess_p_vs_chance']:.3f})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
