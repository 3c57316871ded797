"""Server load on Gemma-3-270M: a shared system prompt, many short questions, N concurrent clients.

Two parts, both on the embedded Gemma-3-270M (float32, CPU), greedy, one process:

- ``server`` (default): starts ``kvboost-hf serve``'s app (uvicorn on a free 127.0.0.1 port)
  once with reuse and once with ``enable_chunk_reuse`` off, and drives each with
  ``--clients`` concurrent streaming chat clients (the official ``openai`` SDK) sending
  ``--requests`` requests in all. Reports throughput and TTFT / latency p50 and p95 as seen
  by the clients (HTTP, queueing and tokenization included), and the reused prompt tokens
  the server reported in ``usage.prompt_tokens_details.cached_tokens``. ``--server-rounds``
  rounds alternate the order; each figure is the median over rounds.
- ``schedulers``: the scheduling decision behind the server, without HTTP. The same requests,
  ``--clients`` in flight at a time, through (a) one worker per core calling ``model.generate``
  per request, one torch thread each, with kvboost reuse (what the server does on a CPU),
  (b) the same without reuse, (c) one worker with all torch threads, with reuse, (d) the same
  without reuse, (e) transformers' continuous batching (``model.init_continuous_batching``,
  paged cache) with its own prefix block sharing, (f) continuous batching without block
  sharing. Rounds are interleaved (the order rotates).

Usage: ``python benchmarks/server_load.py [--part server|schedulers|both]``; results are
merged into ``docs/benchmarks/server_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS_BENCH, environment, serve_in_thread, started_continuous_batching, write_json  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402

SYSTEM_PROMPT = (
    "You are the support assistant of Tessellate, a company that makes modular shelving for homes, "
    "offices and small shops. Answer in one or two short sentences and never invent facts. "
    "Facts you may use. Shelves come in oak, walnut and white ash, and in a painted black or white "
    "finish. A standard module is 80 cm wide, 30 cm deep and 38 cm high; a tall module is 76 cm high. "
    "Each shelf holds 25 kg when the load is spread evenly, and 15 kg when it sits in the middle. "
    "Wall anchors are included for drywall and brick; concrete walls need the separate anchor kit "
    "T-21. Modules can be stacked up to six high when the top module is anchored to the wall. "
    "Delivery inside the EU takes five to eight working days and costs 19 euros per order; orders "
    "over 400 euros ship for free. Delivery to Switzerland and Norway takes ten working days. "
    "Returns are free within 60 days if the parts are unused and in their original boxes. The "
    "warranty covers manufacturing defects for ten years and does not cover water damage. "
    "Replacement screws, dowels and feet can be ordered from the parts page with the code printed "
    "on the inside of each panel. Assembly takes about twenty minutes per module with a single "
    "screwdriver, which is included. Oak and walnut should be cleaned with a dry cloth; painted "
    "finishes may be cleaned with a damp cloth and mild soap. Customer service is open Monday to "
    "Friday from 9:00 to 17:00 Central European Time and answers e-mail within one working day."
)

TOPICS = [
    "how wide a standard module is", "how much weight a shelf carries", "which woods I can choose",
    "whether I can return an opened box", "how long delivery to Berlin takes", "what delivery costs",
    "whether concrete walls need other anchors", "how high I can stack modules", "how to clean walnut",
    "what the warranty covers", "when customer service is open", "how to order a lost screw",
    "how long assembly takes", "whether a screwdriver is included", "how tall a tall module is",
    "whether water damage is covered",
]


def questions(n: int) -> list[str]:
    """``n`` short distinct user questions."""
    return [f"Question {i + 1}: please tell me {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def cpu_pressure() -> float | None:
    """Linux PSI 'some' avg10 for the CPU: % of the last 10 s a runnable task waited (noise indicator)."""
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; values must be non-empty."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summary(seconds: list[float]) -> dict:
    return {"p50_s": percentile(seconds, 50), "p95_s": percentile(seconds, 95), "mean_s": statistics.fmean(seconds)}


# ----------------------------------------------------------------------------- schedulers part
def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def run_generate(model, tokenizer, prompts: list[list[int]], max_tokens: int, reuse: bool, workers: int = 1,
                 threads: int | None = None) -> dict:
    """``workers`` threads, each calling ``model.generate`` per request in arrival order (what the server does);
    with reuse each request gets its own ChunkReuseCache on a shared store."""
    import queue

    from kvboost_hf import ChunkReuseCache
    from kvboost_hf.generation.timing import FirstTokenTimer

    store = ChunkStore(max_bytes=1_000_000_000, chunk_size=128)
    if reuse:
        enable_chunk_reuse(model, store)
    else:
        disable_chunk_reuse(model)
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    eos = eos_ids(tokenizer)
    todo: queue.Queue = queue.Queue()
    for item in enumerate(prompts):
        todo.put(item)
    outputs: dict[int, list[int]] = {}
    ttfts: dict[int, float] = {}

    def worker():
        while True:
            try:
                i, ids = todo.get_nowait()
            except queue.Empty:
                return
            timer = FirstTokenTimer()
            cache = ChunkReuseCache(model.config, store) if reuse else None
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, streamer=timer.start(),
                                     past_key_values=cache)
            ttfts[i] = timer.first_token_at - start
            outputs[i] = out[0, len(ids):].tolist()

    start = time.perf_counter()  # all requests arrived now; FIFO
    pool = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    wall = time.perf_counter() - start
    torch.set_num_threads(threads_before)
    disable_chunk_reuse(model)
    return {"wall_s": wall, "outputs": [outputs[i] for i in range(len(prompts))],
            "ttft_from_arrival": [ttfts[i] for i in range(len(prompts))]}


def run_continuous_batching(model, tokenizer, prompts: list[list[int]], max_tokens: int, in_flight: int,
                            block_sharing: bool) -> dict:
    """transformers' continuous batching manager, ``in_flight`` requests submitted at a time."""
    from transformers import GenerationConfig

    disable_chunk_reuse(model)
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos_ids(tokenizer),
                              pad_token_id=tokenizer.pad_token_id)
    manager = started_continuous_batching(model, config, block_sharing, warm_prompt=prompts[0])
    start = time.perf_counter()
    outputs: dict[str, list[int]] = {}
    first_token: dict[str, float] = {}
    ids_in_order = []
    pending = list(enumerate(prompts))
    try:
        active = 0
        while pending or active:
            while pending and active < in_flight:
                i, ids = pending.pop(0)
                ids_in_order.append(manager.add_request(ids, request_id=f"r{i}", max_new_tokens=max_tokens,
                                                        streaming=True))
                active += 1
            result = manager.get_result(timeout=1.0)
            if result is None:
                if time.perf_counter() - start > 1800:
                    raise RuntimeError("continuous batching run did not finish in 30 minutes")
                continue
            if result.generated_tokens and result.request_id not in first_token:
                first_token[result.request_id] = time.perf_counter() - start
            if result.is_finished():
                if result.error:
                    raise RuntimeError(result.error)
                outputs[result.request_id] = list(result.generated_tokens)
                active -= 1
    finally:
        manager.stop(block=True)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "outputs": [outputs[r] for r in ids_in_order],
            "ttft_from_arrival": [first_token[r] for r in ids_in_order]}


def eos_ids(tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id]
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.append(end_of_turn)
    return ids


def schedulers_part(model, tokenizer, args) -> dict:
    cores = torch.get_num_threads()
    runners = {
        f"generate_reuse_{cores}_workers_1_thread": lambda p: run_generate(
            model, tokenizer, p, args.max_tokens, reuse=True, workers=cores, threads=1),
        f"generate_no_reuse_{cores}_workers_1_thread": lambda p: run_generate(
            model, tokenizer, p, args.max_tokens, reuse=False, workers=cores, threads=1),
        f"generate_reuse_1_worker_{cores}_threads": lambda p: run_generate(
            model, tokenizer, p, args.max_tokens, reuse=True),
        "generate_no_reuse": lambda p: run_generate(model, tokenizer, p, args.max_tokens, reuse=False),
        "continuous_batching_block_sharing": lambda p: run_continuous_batching(
            model, tokenizer, p, args.max_tokens, args.clients, block_sharing=True),
        "continuous_batching_no_sharing": lambda p: run_continuous_batching(
            model, tokenizer, p, args.max_tokens, args.clients, block_sharing=False),
    }
    per_round = args.scheduler_requests
    run_generate(model, tokenizer, [chat_ids(tokenizer, "warm-up")], 2, reuse=False)  # first-call costs, untimed
    results: dict[str, list[dict]] = {name: [] for name in runners}
    reference = None
    for rnd in range(args.rounds):
        prompts = [chat_ids(tokenizer, q + f" (round {rnd})") for q in questions(per_round)]
        names = list(runners)
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        outputs = {}
        for name in order:
            run = runners[name](prompts)
            tokens = sum(len(o) for o in run["outputs"])
            outputs[name] = run["outputs"]
            results[name].append({"wall_s": run["wall_s"], "completion_tokens": tokens, "cpu_pressure": cpu_pressure(),
                                  "tokens_per_s": tokens / run["wall_s"],
                                  "ttft_from_arrival": summary(run["ttft_from_arrival"])})
            print(f"round {rnd} {name}: {run['wall_s']:.1f}s, {tokens / run['wall_s']:.2f} tok/s "
                  f"(cpu pressure {cpu_pressure()})", flush=True)
        reference = outputs["generate_no_reuse"]
        for name in names:
            same = sum(a == b for a, b in zip(outputs[name], reference))
            results[name][-1]["outputs_equal_to_generate_no_reuse"] = f"{same}/{len(reference)}"
    table = {}
    for name, runs in results.items():
        table[name] = {
            "median_wall_s": statistics.median(r["wall_s"] for r in runs),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "median_ttft_p50_s": statistics.median(r["ttft_from_arrival"]["p50_s"] for r in runs),
            "runs": runs,
        }
    return {"requests_per_round": per_round, "rounds": args.rounds, "in_flight": args.clients,
            "prompt_tokens": len(chat_ids(tokenizer, questions(1)[0])), "max_tokens": args.max_tokens,
            "results": table}


# ----------------------------------------------------------------------------- server part
def start_server(model, tokenizer, reuse: bool, max_queue: int):
    """The app on a free 127.0.0.1 port in a background thread, set up as ``kvboost-hf serve`` sets it up
    on this machine (one worker per core, one torch thread each); returns (server, thread, base_url)."""
    from kvboost_hf.server import ServerSettings, create_app
    from kvboost_hf.server.command import available_cores

    store = ChunkStore(max_bytes=1_000_000_000, chunk_size=128)
    cores = available_cores()
    settings = ServerSettings(model_name="gemma-3-270m", reuse=reuse, max_queue=max_queue, request_timeout=600.0,
                              workers=cores, torch_threads=1)
    app = create_app(model, tokenizer, store, settings)
    return serve_in_thread(app, startup_timeout=60)


async def drive(base_url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """``clients`` concurrent streaming chat clients sending ``prompts``; per-request TTFT and latency."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    todo = list(enumerate(prompts))
    rows: list[dict] = []

    async def one_client():
        while todo:
            i, question = todo.pop(0)
            start = time.perf_counter()
            first = None
            text, usage = "", None
            stream = await client.chat.completions.create(
                model="gemma-3-270m", temperature=0, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter()
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
            end = time.perf_counter()
            rows.append({"i": i, "ttft_s": (first or end) - start, "latency_s": end - start, "text": text,
                         "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                         "cached_tokens": usage.prompt_tokens_details.cached_tokens})

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    rows.sort(key=lambda r: r["i"])
    return {"wall_s": wall, "rows": rows}


def server_run(model, tokenizer, args, reuse: bool) -> dict:
    """One fresh server (fresh store), an untimed warm-up, then the timed requests."""
    server, thread, base_url = start_server(model, tokenizer, reuse, max_queue=max(64, args.requests))
    try:
        warm_up = ["Warm-up. " + q for q in questions(args.clients)]  # untimed; differs right after the system prompt
        asyncio.run(drive(base_url, warm_up, args.clients, args.max_tokens))
        run = asyncio.run(drive(base_url, questions(args.requests), args.clients, args.max_tokens))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        disable_chunk_reuse(model)
    rows = run["rows"]
    completion = sum(r["completion_tokens"] for r in rows)
    return {
        "wall_s": run["wall_s"],
        "requests_per_s": len(rows) / run["wall_s"],
        "completion_tokens_per_s": completion / run["wall_s"],
        "ttft": summary([r["ttft_s"] for r in rows]),
        "latency": summary([r["latency_s"] for r in rows]),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in rows),
        "cached_tokens_mean": statistics.fmean(r["cached_tokens"] for r in rows),
        "completion_tokens": completion,
        "cpu_pressure": cpu_pressure(),
        "texts": [r["text"] for r in rows],
    }


def _median_figures(runs: list[dict]) -> dict:
    """Median over rounds of every figure (nested dicts too); texts of the first round."""
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _median_figures([r[key] for r in runs])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs if r[key] is not None)
        else:
            out[key] = value
    return out


def server_part(model, tokenizer, args) -> dict:
    runs: dict[str, list[dict]] = {"reuse": [], "no_reuse": []}
    for rnd in range(args.server_rounds):
        order = [("reuse", True), ("no_reuse", False)]
        for name, reuse in order[rnd % 2:] + order[: rnd % 2]:
            run = server_run(model, tokenizer, args, reuse)
            runs[name].append(run)
            print(f"round {rnd} {name}: {run['requests_per_s']:.3f} req/s, TTFT p50 {run['ttft']['p50_s']:.2f}s "
                  f"p95 {run['ttft']['p95_s']:.2f}s (cpu pressure {run['cpu_pressure']})", flush=True)
    out = {name: {**_median_figures(r), "rounds": [{k: v for k, v in x.items() if k != "texts"} for x in r]}
           for name, r in runs.items()}
    texts = [run["texts"] for r in runs.values() for run in r]
    out["identical_texts"] = all(t == texts[0] for t in texts)
    return {"clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
            "rounds": args.server_rounds, **out}


def print_server_table(result: dict) -> None:
    print("| server | requests/s | completion tok/s | TTFT p50 | TTFT p95 | latency p50 | latency p95 | cached / prompt tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("reuse", "no_reuse"):
        r = result[name]
        print(f"| {name.replace('_', ' ')} | {r['requests_per_s']:.3f} | {r['completion_tokens_per_s']:.2f} | "
              f"{r['ttft']['p50_s']:.2f} s | {r['ttft']['p95_s']:.2f} s | {r['latency']['p50_s']:.2f} s | "
              f"{r['latency']['p95_s']:.2f} s | {r['cached_tokens_mean']:.0f} / {r['prompt_tokens_mean']:.0f} |")


def print_scheduler_table(result: dict) -> None:
    print("| scheduler | wall (median) | completion tok/s | TTFT p50 from arrival | outputs = plain generate |")
    print("|---|---:|---:|---:|---:|")
    for name, r in result["results"].items():
        equal = ", ".join(run["outputs_equal_to_generate_no_reuse"] for run in r["runs"])
        print(f"| {name} | {r['median_wall_s']:.1f} s | {r['median_tokens_per_s']:.2f} | "
              f"{r['median_ttft_p50_s']:.2f} s | {equal} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["server", "schedulers", "both"], default="server")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--scheduler-requests", type=int, default=16, help="requests per round (schedulers part)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (schedulers part)")
    parser.add_argument("--server-rounds", type=int, default=2, help="interleaved rounds (server part)")
    args = parser.parse_args()

    model, tokenizer = load_default_model()
    path = DOCS_BENCH / "server_load.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    payload.update({"model": "Gemma-3-270M (float32, CPU)", "environment": environment(),
                    "system_prompt_tokens": len(tokenizer(SYSTEM_PROMPT)["input_ids"])})
    print(f"system prompt: {payload['system_prompt_tokens']} tokens", flush=True)
    if args.part in ("schedulers", "both"):
        payload["schedulers"] = schedulers_part(model, tokenizer, args)
        payload["schedulers"]["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        print_scheduler_table(payload["schedulers"])
    if args.part in ("server", "both"):
        payload["server"] = server_part(model, tokenizer, args)
        payload["server"]["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        print_server_table(payload["server"])
    print(f"written to {write_json('server_load.json', payload)}")


if __name__ == "__main__":
    main()
