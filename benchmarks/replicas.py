"""Replicas on Ray Serve: 1 replica with 2 CPUs against 2 replicas with 1 CPU each, routed by the exact
prefix router or by power of two choices, with and without a shared Redis tier.

Workload: ``--clients`` concurrent clients, each holding ``--conversations`` multi-turn chats whose
first message carries a long document of its own (``--doc-words`` words of an essay), ``--turns`` turns
each, greedy replies of ``--max-tokens`` tokens, streamed. Reports per setting: the cached fraction of
follow-up turns' prompts, TTFT p50/p95 (client side: request sent to first content token), completion
tokens per second over the run, and hand-overs (follow-up turns served by another replica than the
turn before). Greedy replies are compared across settings.

    python benchmarks/replicas.py --clients 4 --conversations 2 --turns 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import DOCS_BENCH, environment, essays, write_json  # noqa: E402
from kvboost_hf.cli import build_parser  # noqa: E402

SETTINGS = [  # (name, replicas, cpus per replica, router, redis)
    ("1 replica x 2 CPUs", 1, 2.0, "pow2", False),
    ("2 x 1 CPU, prefix", 2, 1.0, "prefix", False),
    ("2 x 1 CPU, pow2", 2, 1.0, "pow2", False),
    ("4 x 0.5 CPU, prefix", 4, 0.5, "prefix", False),
    ("4 x 0.5 CPU, pow2", 4, 0.5, "pow2", False),
    ("2 x 1 CPU, prefix + Redis", 2, 1.0, "prefix", True),
    ("2 x 1 CPU, pow2 + Redis", 2, 1.0, "pow2", True),
]
METRICS = ("cached_fraction", "ttft_p50_ms", "ttft_p95_ms", "completion_tok_s", "handovers", "wall_s")


def start(port: int, replicas: int, cpus: float, router: str, redis_url: str | None, chunk: int):
    from kvboost_hf.cluster.app import serve_on_ray

    flags = ["serve", "--ray", "--port", str(port), "--replicas", str(replicas), "--cpus-per-replica", str(cpus),
             "--router", router, "--served-model-name", "gemma", "--chunk-size", str(chunk), "--max-cache-bytes", "1GB"]
    if redis_url:
        flags += ["--remote-store", redis_url, "--remote-prefix", f"bench-{time.time_ns()}"]
    args = build_parser().parse_args(flags)
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=serve_on_ray, args=(args, ready, stop), daemon=True)
    thread.start()
    if not ready.wait(600):
        raise RuntimeError("the application did not start")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # every replica loaded (the ingress answers before they are)
        try:
            seen = {httpx.get(url + "/health", timeout=30).headers.get("x-kvboost-replica") for _ in range(8)}
            if len(seen) >= replicas or router == "prefix":
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    time.sleep(5)
    return url, stop, thread


def one_turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "gemma", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, first, text, usage, replica = time.perf_counter(), None, [], None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        replica = reply.headers["x-kvboost-replica"]
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    return {"ttft": (first or time.perf_counter()) - sent, "text": "".join(text), "replica": replica,
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "completion": usage["completion_tokens"]}


def client(url: str, docs: list[str], questions: list[str], turns: int, max_tokens: int, think: random.Random,
           think_ms: float) -> list[list[dict]]:
    """One client's conversations, turn by turn, round robin over its conversations."""
    histories = [[{"role": "user", "content": f"{doc}\n\n{questions[0]}"}] for doc in docs]
    results: list[list[dict]] = [[] for _ in docs]
    for turn in range(turns):
        for c, history in enumerate(histories):
            if turn:
                history.append({"role": "user", "content": questions[turn % len(questions)]})
                if think_ms:
                    time.sleep(think.expovariate(1000 / think_ms))
            got = one_turn(url, history, max_tokens)
            history.append({"role": "assistant", "content": got["text"]})
            results[c].append(got)
    return results


def run_setting(url: str, work: list[list[str]], questions: list[str], turns: int, max_tokens: int,
                think_ms: float) -> dict:
    started = time.perf_counter()
    with ThreadPoolExecutor(len(work)) as pool:
        per_client = list(pool.map(lambda c: client(url, work[c], questions, turns, max_tokens, random.Random(c),
                                                    think_ms), range(len(work))))
    wall = time.perf_counter() - started
    chats = [chat for conversations in per_client for chat in conversations]
    follow = [t for chat in chats for t in chat[1:]]
    ttfts = sorted(t["ttft"] for chat in chats for t in chat[1:])
    handovers = sum(chat[i]["replica"] != chat[i - 1]["replica"] for chat in chats for i in range(1, len(chat)))
    return {"cached_fraction": sum(t["cached"] for t in follow) / sum(t["prompt"] for t in follow),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p95_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "completion_tok_s": sum(t["completion"] for chat in chats for t in chat) / wall,
            "handovers": handovers, "follow_up_turns": len(follow), "wall_s": wall,
            "turns_per_replica": dict(Counter(t["replica"] for chat in chats for t in chat)),
            "replies": [[t["text"] for t in chat] for chat in chats]}


def remote_counters(url: str) -> dict[str, float]:
    """The Redis tier's counters summed over replicas, from the ingress's merged ``/metrics`` (scraped
    twice: the first scrape makes replicas push every second, the second reads their latest push)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvboost_hf.cluster.metrics import IDLE_PUSH_PERIOD_S

    httpx.get(url + "/metrics", timeout=60)
    time.sleep(IDLE_PUSH_PERIOD_S + 2)
    totals: Counter = Counter()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for sample in family.samples:
            if sample.name.startswith("kvboost_remote_"):
                totals[sample.name.removeprefix("kvboost_remote_")] += sample.value
    return dict(totals)


def summarise(runs: list[dict]) -> dict:
    """Median over rounds of each metric, with every round's figures kept."""
    summary = {key: statistics.median(run[key] for run in runs) for key in METRICS}
    summary["follow_up_turns"] = runs[0]["follow_up_turns"]
    summary["rounds"] = [{key: run[key] for key in (*METRICS, "turns_per_replica", "remote")} for run in runs]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=2, help="per client")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--think-ms", type=float, default=1000.0, help="mean think time before a follow-up turn")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats of the settings without Redis")
    parser.add_argument("--port", type=int, default=8520)
    parser.add_argument("--only", nargs="*", default=None, help="run only these settings (by index)")
    opts = parser.parse_args()
    texts = essays()
    docs = [" ".join(texts[i].split()[:opts.doc_words]) for i in range(opts.clients * opts.conversations)]
    work = [docs[c * opts.conversations:(c + 1) * opts.conversations] for c in range(opts.clients)]
    questions = ["Summarise the text above in one sentence.", "What is the main claim?", "Give one example from it.",
                 "Who would disagree, and why?", "Name one open question it leaves."]
    chosen = [i for i in range(len(SETTINGS)) if opts.only is None or str(i) in opts.only]
    repeated = [i for i in chosen if not SETTINGS[i][4]]
    order = [repeated[r % len(repeated):] + repeated[:r % len(repeated)] for r in range(opts.rounds if repeated else 0)]
    order.append([i for i in chosen if SETTINGS[i][4]])  # the Redis settings once, at the end
    runs: dict[str, list[dict]] = {}
    for round_order in order:
        for index in round_order:
            name, replicas, cpus, router, redis = SETTINGS[index]
            redis_proc = redis_url = None
            if redis:
                from tests.conftest import start_redis

                redis_proc, redis_url = start_redis()
            url, stop, thread = start(opts.port, replicas, cpus, router, redis_url, opts.chunk_size)
            try:
                run = run_setting(url, work, questions, opts.turns, opts.max_tokens, opts.think_ms)
                try:
                    run["remote"] = remote_counters(url) if redis else None
                except Exception as err:  # noqa: BLE001 - the timings stand without the counters
                    print("could not read the Redis counters:", err, flush=True)
                    run["remote"] = None
            finally:
                stop.set()
                thread.join(300)
                if redis_proc is not None:
                    redis_proc.terminate()
            runs.setdefault(name, []).append(run)
            print(name, json.dumps({k: v for k, v in run.items() if k != "replies"}), flush=True)
    first = next(iter(runs.values()))[0]["replies"]
    identical = {name: all(run["replies"] == first for run in rs) for name, rs in runs.items()}
    payload = {"environment": environment(), "options": vars(opts), "identical_replies": identical,
               "results": {name: summarise(rs) for name, rs in runs.items()}}
    path = write_json("replicas.json", payload)
    print("identical greedy replies:", identical, "->", path)
    plot(payload["results"], DOCS_BENCH / "replicas.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in zip(axes, ("cached_fraction", "ttft_p50_ms", "completion_tok_s"),
                              ("cached fraction, follow-up turns", "TTFT p50 (ms)", "completion tokens/s")):
        ax.barh(names, [results[n][key] for n in names])
        ax.set_xlabel(label)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
