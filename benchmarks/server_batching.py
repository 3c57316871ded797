"""Continuous batching in the server (``--scheduler batch``) vs the worker scheduler vs transformers'
``generate_batch``, on the embedded Gemma-3-270M (float32, CPU), greedy, one process.

Clients are ``openai`` SDK streaming clients in a process of their own (``_clients.py``), as real
clients are; the server runs in this process.

Parts (``--part``, default ``all``):

- ``load``: for each of ``--clients`` (1, 8, 16, 32 concurrent streaming SDK clients, loopback),
  a fresh real server per scheduler (``batch``, ``workers``) and an untimed warm-up, then
  ``--requests-per-client`` requests per client: the shared system prompt plus a distinct
  question, 32-64 new tokens (``ignore_eos``). Figures: req/s, completion tok/s, TTFT p50/p95,
  inter-token p50/p95 (gaps between streamed chunks), cached / prompt tokens; ``--repeats``
  interleaved rounds (default 3), the round with the median tok/s reported. transformers'
  continuous batching (``init_continuous_batching``, paged cache, block sharing; no HTTP, no
  store) runs the same requests with the same number in flight.
- ``admission``: ``--admission-streams`` streams decode while one ``--long-prompt``-token prompt
  is admitted; inter-token p50 of the streams over the run and p95 while the long prompt is
  prefilled (from its submission to its first token), per scheduler.
- ``burst``: ``--burst`` simultaneous chats whose system prompt is new to the server (a new system
  prompt deployed: distinct text per round, so nothing of it is in the store), each with its own
  question, ``--burst-tokens`` new tokens; per scheduler, a fresh server, ``--repeats`` interleaved
  rounds (median wall): burst wall time, TTFT p50/p95, cached tokens per request (how many of the
  burst reused the shared prompt).
- ``mechanism``: the justification of the step mechanism: ms per decode step over per-request
  caches, packed (one ``[1, tokens]`` forward, SDPA per row: the SDPA path) and padded (rows
  right-padded with a mask: the eager path), against one transformers forward over a shared
  batched ``DynamicCache`` (equal lengths, no per-row caches); and a step that also admits a
  32-token prompt, packed into the decode forward vs in a forward of its own; batch 1/4/8/16,
  400-token contexts.

``--quick`` shrinks everything to a smoke run (written to a temporary folder). Writes
docs/benchmarks/server_batching.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _clients import run_clients  # noqa: E402
from _common import DOCS_BENCH, environment, serve_in_thread, started_continuous_batching, write_json  # noqa: E402
from server_load import SYSTEM_PROMPT, chat_ids, cpu_pressure, percentile, questions  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402

SCHEDULERS = ("batch", "workers")
MODEL_NAME = "gemma-3-270m"


def new_tokens(i: int, low: int, high: int) -> int:
    """The i-th request's max_tokens, spread over [low, high]."""
    return low + (i * 7) % (high - low + 1)


def quantiles(values: list[float]) -> dict:
    if not values:
        return {"p50_s": None, "p95_s": None}
    return {"p50_s": percentile(values, 50), "p95_s": percentile(values, 95)}


# ----------------------------------------------------------------------------- a real server
def start_server(model, tokenizer, scheduler: str, max_queue: int = 256):
    """The app as ``kvboost-hf serve --scheduler SCHEDULER`` sets it up here; returns (server, thread, url)."""
    from kvboost_hf.server import ServerSettings, create_app
    from kvboost_hf.server.command import available_cores

    cores = available_cores()
    per_scheduler = (dict(workers=1, torch_threads=cores) if scheduler == "batch"
                     else dict(workers=cores, torch_threads=1))
    settings = ServerSettings(model_name=MODEL_NAME, max_queue=max_queue, scheduler=scheduler, **per_scheduler)
    app = create_app(model, tokenizer, ChunkStore(max_bytes=1_000_000_000, chunk_size=128), settings)
    return serve_in_thread(app, startup_timeout=120)


def stop_server(server, thread, model) -> None:
    server.should_exit = True
    thread.join(timeout=60)
    disable_chunk_reuse(model)


def drive(base_url: str, prompts: list[str], clients: int, low: int, high: int) -> dict:
    """``clients`` streaming SDK clients (in their own process) send ``prompts`` after the system prompt."""
    return run_clients(kind="load", url=base_url, system=SYSTEM_PROMPT, questions=prompts,
                       max_tokens=[new_tokens(i, low, high) for i in range(len(prompts))], clients=clients)


def load_figures(wall: float, rows: list[dict]) -> dict:
    ttfts = [r["times"][0] - r["start"] for r in rows if r["times"]]
    gaps = [b - a for r in rows for a, b in zip(r["times"], r["times"][1:])]
    completion = sum(r["usage"]["completion_tokens"] for r in rows)
    return {
        "requests_per_s": len(rows) / wall, "completion_tokens_per_s": completion / wall,
        "ttft": quantiles(ttfts), "inter_token": quantiles(gaps),
        "cached_tokens_mean": statistics.fmean(r["usage"]["cached_tokens"] for r in rows),
        "prompt_tokens_mean": statistics.fmean(r["usage"]["prompt_tokens"] for r in rows),
        "completion_tokens": completion, "wall_s": wall, "cpu_pressure": cpu_pressure(),
    }


def server_load(model, tokenizer, scheduler: str, clients: int, requests: int, low: int, high: int) -> dict:
    server, thread, url = start_server(model, tokenizer, scheduler)
    try:
        drive(url, ["Warm-up. " + q for q in questions(clients)], clients, 2, 2)  # untimed
        run = drive(url, [f"{q} (client run {clients})" for q in questions(requests)], clients, low, high)
    finally:
        stop_server(server, thread, model)
    return load_figures(run["wall_s"], run["rows"])


def generate_batch_load(model, tokenizer, clients: int, requests: int, low: int, high: int) -> dict:
    """transformers' continuous batching, ``clients`` requests in flight, token times from streaming results."""
    from transformers import GenerationConfig

    disable_chunk_reuse(model)
    prompts = [chat_ids(tokenizer, f"{q} (client run {clients})") for q in questions(requests)]
    config = GenerationConfig(max_new_tokens=high, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    manager = started_continuous_batching(model, config, block_sharing=True, warm_prompt=prompts[0])
    pending, active, rows = list(enumerate(prompts)), {}, []
    start = time.perf_counter()
    try:
        while pending or active:
            while pending and len(active) < clients:
                i, ids = pending.pop(0)
                rid = manager.add_request(ids, request_id=f"r{i}", max_new_tokens=new_tokens(i, low, high),
                                          streaming=True)
                active[rid] = {"start": time.perf_counter(), "times": [], "seen": 0, "prompt": len(ids)}
            result = manager.get_result(timeout=1.0)
            if result is None or result.request_id not in active:
                continue
            row = active[result.request_id]
            now = time.perf_counter()
            row["times"] += [now] * (len(result.generated_tokens) - row["seen"])
            row["seen"] = len(result.generated_tokens)
            if result.is_finished():
                rows.append(active.pop(result.request_id))
    finally:
        manager.stop(block=True)
    wall = time.perf_counter() - start
    ttfts = [r["times"][0] - r["start"] for r in rows if r["times"]]
    gaps = [b - a for r in rows for a, b in zip(r["times"], r["times"][1:])]
    completion = sum(r["seen"] for r in rows)
    return {"requests_per_s": len(rows) / wall, "completion_tokens_per_s": completion / wall,
            "ttft": quantiles(ttfts), "inter_token": quantiles(gaps), "cached_tokens_mean": None,
            "prompt_tokens_mean": statistics.fmean(r["prompt"] for r in rows), "completion_tokens": completion,
            "wall_s": wall, "cpu_pressure": cpu_pressure()}


def median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s (its other figures kept with it), and every run's tok/s."""
    ranked = sorted(runs, key=lambda r: r["completion_tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "runs_tokens_per_s": [r["completion_tokens_per_s"] for r in runs]}


def load_part(model, tokenizer, args) -> dict:
    """Per client count, ``--repeats`` interleaved rounds of every scheduler; the median round of each."""
    out: dict[str, dict] = {}
    for clients in args.clients:
        requests = max(clients * args.requests_per_client, args.min_requests)
        runs: dict[str, list] = {name: [] for name in (*SCHEDULERS, "generate_batch")}
        for _ in range(args.repeats):
            for name in runs:
                if name == "generate_batch":
                    r = generate_batch_load(model, tokenizer, clients, requests, args.min_new, args.max_new)
                else:
                    r = server_load(model, tokenizer, name, clients, requests, args.min_new, args.max_new)
                runs[name].append(r)
                print(f"{clients:>3} clients {name:>14}: {r['requests_per_s']:.3f} req/s, "
                      f"{r['completion_tokens_per_s']:.2f} tok/s, TTFT p50 {r['ttft']['p50_s']:.2f}s, "
                      f"ITL p95 {r['inter_token']['p95_s']:.3f}s (cpu pressure {r['cpu_pressure']})", flush=True)
        out[str(clients)] = {name: median_run(r) for name, r in runs.items()}
    return out


# ----------------------------------------------------------------------------- a long prompt admitted
def long_prompt_ids(tokenizer, n: int) -> list[int]:
    text, k = "", 0
    while len(tokenizer(text)["input_ids"]) < n:
        k += 1
        text += f"Document section {k}. " + SYSTEM_PROMPT + " "
    return tokenizer(text)["input_ids"][:n]


def admission_run(url: str, streams: int, stream_tokens: int, long_ids: list[int]) -> dict:
    run = run_clients(kind="admission", url=url, system=SYSTEM_PROMPT, questions=questions(streams),
                      stream_tokens=stream_tokens, long_ids=long_ids)
    sent, admitted = run["sent"], run["admitted"]
    gaps = [(a, b) for r in run["rows"] for a, b in zip(r["times"], r["times"][1:])]
    during = [b - a for a, b in gaps if sent < b <= admitted]
    overall = [b - a for a, b in gaps]
    return {"admission_s": admitted - sent, "inter_token_all": quantiles(overall),
            "inter_token_during_admission": quantiles(during), "gaps_during_admission": len(during),
            "p95_during_over_p50_all": (quantiles(during)["p95_s"] / quantiles(overall)["p50_s"]) if during else None}


def admission_part(model, tokenizer, args) -> dict:
    long_ids = long_prompt_ids(tokenizer, args.long_prompt)
    out = {}
    for scheduler in SCHEDULERS:
        server, thread, url = start_server(model, tokenizer, scheduler)
        try:
            drive(url, ["Warm-up. " + q for q in questions(2)], 2, 2, 2)  # untimed
            out[scheduler] = admission_run(url, args.admission_streams, args.stream_tokens, long_ids)
        finally:
            stop_server(server, thread, model)
        r = out[scheduler]
        print(f"admission {scheduler:>8}: {len(long_ids)}-token prompt in {r['admission_s']:.2f}s; inter-token p50 "
              f"{r['inter_token_all']['p50_s']:.3f}s, p95 while admitting {r['inter_token_during_admission']['p95_s']}",
              flush=True)
    return {"long_prompt_tokens": len(long_ids), "streams": args.admission_streams, **out}


# ----------------------------------------------------------------------------- a burst on a new prefix
def burst_run(model, tokenizer, scheduler: str, system: str, requests: int, new: int) -> dict:
    server, thread, url = start_server(model, tokenizer, scheduler)
    try:
        drive(url, ["Warm-up. " + q for q in questions(2)], 2, 2, 2)  # untimed; another system prompt
        run = run_clients(kind="load", url=url, system=system, questions=questions(requests),
                          max_tokens=[new] * requests, clients=requests)
    finally:
        stop_server(server, thread, model)
    figures = load_figures(run["wall_s"], run["rows"])
    figures["cached_tokens"] = sorted(r["usage"]["cached_tokens"] for r in run["rows"])
    return figures


def burst_part(model, tokenizer, args) -> dict:
    """Per scheduler, ``--repeats`` interleaved rounds of a burst on a system prompt the server never saw."""
    runs: dict[str, list] = {name: [] for name in SCHEDULERS}
    for round_ in range(args.repeats):
        for name in SCHEDULERS:
            system = f"Deployment {round_}-{name}. " + SYSTEM_PROMPT
            r = burst_run(model, tokenizer, name, system, args.burst, args.burst_tokens)
            runs[name].append(r)
            print(f"burst {name:>8}: {r['wall_s']:.2f}s, TTFT p50 {r['ttft']['p50_s']:.2f}s p95 "
                  f"{r['ttft']['p95_s']:.2f}s, cached {r['cached_tokens']} of {r['prompt_tokens_mean']:.0f}", flush=True)
    out = {name: sorted(r, key=lambda x: x["wall_s"])[len(r) // 2] for name, r in runs.items()}
    return {"requests": args.burst, "new_tokens": args.burst_tokens, **out}


# ----------------------------------------------------------------------------- the mechanism
MECHANISMS = ("packed", "padded", "shared_dynamic_cache", "admit_packed", "admit_separate")


def mechanism_part(model, tokenizer, args) -> dict:
    """ms per step, per-request caches: packed (one ``[1, tokens]`` forward, SDPA per row) vs padded
    (rows right-padded with a mask: the first mechanism, still the eager path) vs one shared batched
    ``DynamicCache`` (equal lengths, no per-row caches); and a step that also admits a
    ``--admit-chunk``-token prompt: packed into the decode forward vs a forward of its own."""
    from transformers import DynamicCache

    from kvboost_hf.batching import BatchRunner, RowSampling, Sequence

    disable_chunk_reuse(model)
    runner = BatchRunner(model)
    out = {}

    def new_seq(ids: list[int]) -> Sequence:
        seq = Sequence(ids, 10_000, RowSampling(temperature=0), eos_ids=[])
        runner.start(seq)
        return seq

    def timed(name: str, run) -> None:
        t = time.perf_counter()
        run()
        timings[name].append(time.perf_counter() - t)

    for batch in args.mechanism_batches:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(10, 50_000, (batch, args.context), generator=g)
        timings = {name: [] for name in MECHANISMS}
        for _ in range(args.rounds):
            seqs = [new_seq(p.tolist()) for p in prompts]
            for seq in seqs:
                seq.sample(runner.prefill([seq], [args.context])[0])
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                logits = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(args.steps):
                def shared():
                    nonlocal next_ids
                    with torch.no_grad():
                        out_logits = model(input_ids=next_ids, past_key_values=cache, use_cache=True,
                                           logits_to_keep=1).logits
                    next_ids = out_logits[:, -1].argmax(-1, keepdim=True)

                chunk = [torch.randint(10, 50_000, (args.admit_chunk,), generator=g).tolist() for _ in range(2)]
                admitted = [new_seq(ids) for ids in chunk]
                rows = {"packed": lambda: runner.decode(seqs),
                        "padded": lambda: runner._padded_step(seqs, [], [], [], [])[0],
                        "admit_packed": lambda: runner.step(seqs, admitted[:1], [args.admit_chunk])[0],
                        "admit_separate": lambda: (runner.decode(seqs), runner.prefill(admitted[1:], [args.admit_chunk]))[0]}
                for name, run in rows.items():  # each one a decode step of every row (the next token fed alike)
                    timed(name, lambda: [seq.sample(r) for seq, r in zip(seqs, run())])
                timed("shared_dynamic_cache", shared)
        out[str(batch)] = {name: {"step_ms": 1000 * statistics.median(v), "tokens_per_s": batch / statistics.median(v)}
                           for name, v in timings.items()}
        print(f"batch {batch:>2}: " + ", ".join(f"{name} {r['step_ms']:.1f} ms" for name, r in out[str(batch)].items()),
              flush=True)
    return {"context_tokens": args.context, "admit_chunk_tokens": args.admit_chunk, "steps": args.steps,
            "rounds": args.rounds, "batches": out}


# ----------------------------------------------------------------------------- report
def print_tables(result: dict) -> None:
    if "burst" in result:
        print("| scheduler | burst wall | TTFT p50 | TTFT p95 | cached tokens per request |")
        print("|---|---:|---:|---:|---|")
        for name in SCHEDULERS:
            r = result["burst"][name]
            print(f"| {name} | {r['wall_s']:.2f} s | {r['ttft']['p50_s']:.2f} s | {r['ttft']['p95_s']:.2f} s | "
                  f"{', '.join(map(str, r['cached_tokens']))} of {r['prompt_tokens_mean']:.0f} |")
    if "load" in result:
        print("| clients | scheduler | req/s | tok/s | TTFT p50 | TTFT p95 | inter-token p50 | inter-token p95 "
              "| cached / prompt |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for clients, row in result["load"].items():
            for name, r in row.items():
                cached = "-" if r["cached_tokens_mean"] is None else f"{r['cached_tokens_mean']:.0f}"
                print(f"| {clients} | {name} | {r['requests_per_s']:.3f} | {r['completion_tokens_per_s']:.2f} | "
                      f"{r['ttft']['p50_s']:.2f} s | {r['ttft']['p95_s']:.2f} s | {r['inter_token']['p50_s']:.3f} s | "
                      f"{r['inter_token']['p95_s']:.3f} s | {cached} / {r['prompt_tokens_mean']:.0f} |")
    if "mechanism" in result:
        chunk = result["mechanism"]["admit_chunk_tokens"]
        print(f"| batch | packed | padded | shared DynamicCache | packed / shared | step admitting a {chunk}-token "
              "prompt: packed | same: separate forward |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for batch, r in result["mechanism"]["batches"].items():
            ms = {name: r[name]["step_ms"] for name in MECHANISMS}
            print(f"| {batch} | {ms['packed']:.1f} | {ms['padded']:.1f} | {ms['shared_dynamic_cache']:.1f} | "
                  f"{ms['packed'] / ms['shared_dynamic_cache']:.2f} | {ms['admit_packed']:.1f} | "
                  f"{ms['admit_separate']:.1f} |")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    load = result.get("load", {})
    clients = [int(c) for c in load]
    for name in (*SCHEDULERS, "generate_batch"):
        axes[0].plot(clients, [load[str(c)][name]["completion_tokens_per_s"] for c in clients], marker="o", label=name)
        axes[1].plot(clients, [load[str(c)][name]["ttft"]["p50_s"] for c in clients], marker="o", label=name)
    axes[0].set(xlabel="concurrent clients", ylabel="completion tokens / s", title="Throughput")
    axes[1].set(xlabel="concurrent clients", ylabel="TTFT p50 (s)", title="Time to first token")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("Gemma-3-270M fp32 CPU: continuous batching vs workers vs transformers generate_batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["load", "admission", "burst", "mechanism", "all"], default="all")
    parser.add_argument("--burst", type=int, default=8, help="simultaneous chats on a new system prompt")
    parser.add_argument("--burst-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, figures meaningless")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every scheduler per client count (median)")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--min-new", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--admission-streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--mechanism-batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--admit-chunk", type=int, default=32, help="prompt tokens admitted in a mechanism step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.clients, args.requests_per_client, args.min_requests, args.repeats = [1, 4], 1, 4, 1
        args.min_new, args.max_new, args.long_prompt, args.admission_streams = 4, 8, 300, 2
        args.stream_tokens, args.mechanism_batches, args.context, args.steps, args.rounds = 40, [1, 2], 64, 2, 1
        args.admit_chunk, args.burst, args.burst_tokens = 8, 3, 4

    model, tokenizer = load_default_model()
    result = {"model": "Gemma-3-270M (float32, CPU)", "environment": environment(), "quick": args.quick,
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": vars(args)}
    if args.part in ("mechanism", "all"):
        result["mechanism"] = mechanism_part(model, tokenizer, args)
    if args.part in ("load", "all"):
        result["load"] = load_part(model, tokenizer, args)
    if args.part in ("admission", "all"):
        result["admission"] = admission_part(model, tokenizer, args)
    if args.part in ("burst", "all"):
        result["burst"] = burst_part(model, tokenizer, args)
    print_tables(result)
    if args.quick:  # a smoke run never lands in docs/
        import json
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="server_batching_quick_"))
        path = folder / "server_batching.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
    else:
        earlier = DOCS_BENCH / "server_batching.json"
        if args.part != "all" and earlier.exists():  # a partial run replaces its own parts only
            import json

            kept = json.loads(earlier.read_text())
            parts = {"mechanism", "load", "admission", "burst"} - set(result)
            result = {**result, **{k: kept[k] for k in parts if k in kept},
                      "parts_measured_at": {**kept.get("parts_measured_at", {}),
                                            **{k: result["measured_at"] for k in set(result) & {"mechanism", "load",
                                                                                                "admission", "burst"}}}}
        folder, path = DOCS_BENCH, write_json("server_batching.json", result)
    if "load" in result:
        plot(result, folder / "server_batching.png")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
