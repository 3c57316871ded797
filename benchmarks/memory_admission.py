"""Concurrent requests against the memory planner's budget: planned total and measured peak (Gemma-3-270M, CPU).

The real server (in this process, on loopback) plans into a budget of ``--budget-requests`` times one
request's planned peak (margin 0); ``--requests`` clients send a ``--prompt-tokens`` prompt each (distinct
essays' text) at once, ``--new-tokens`` greedy tokens. Reported per scheduler: the status of each (200 when
served, after waiting for memory when it fitted alone but not beside the others), the wall time of the
burst, the sum of the admitted requests' planned peaks (as admitted together) over the
budget, and the process's peak resident set during the burst above its level before it, over the budget
(glibc's mmap threshold fixed at 128 KiB so the resident set follows live memory, as
benchmarks/memory_planner.py does), and how much of it is the chunk store's growth (the store has a
budget of its own, ``--max-cache-bytes``, outside the planner's). ``--echo`` makes every request an
``echo`` + ``logprobs`` scoring (lm-eval's loglikelihood) instead.

Usage: ``MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory_admission.py --scheduler batch``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import essays  # noqa: E402

MIB = 2**20


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", choices=("batch", "workers"), default="batch")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--budget-requests", type=float, default=2.5)
    parser.add_argument("--echo", action="store_true")
    args = parser.parse_args()

    import httpx
    import torch

    from kvboost_hf import ChunkStore
    from kvboost_hf.models import load_default_model
    from kvboost_hf.planner import ModelShape
    from kvboost_hf.planner.memory import MemoryPlanner
    from kvboost_hf.server import ServerSettings, create_app
    from kvboost_hf.server.routes.background import serve_in_background
    from kvboost_hf.server.scheduling.admission import MemoryAdmission

    model, tokenizer = load_default_model()
    texts = essays()
    prompts = []
    for k in range(args.requests):
        ids = tokenizer("\n\n".join(texts[k * 2:k * 2 + 6]))["input_ids"][: args.prompt_tokens]
        assert len(ids) == args.prompt_tokens
        prompts.append(ids)
    store = ChunkStore(max_bytes=2_000_000_000, chunk_size=128)
    settings = ServerSettings(model_name="gemma", scheduler=args.scheduler, workers=2, torch_threads=2)
    app = create_app(model, tokenizer, store, settings)
    shape = ModelShape.from_config(model.config, dtype="float32")
    scored = {"score_prompt": True} if args.echo else {}
    new = max(1, args.new_tokens)
    try:
        one = MemoryPlanner(shape, 2**40, margin=0.0).plan(args.prompt_tokens, new, **scored).predicted_peak_bytes
    except TypeError:  # a planner without prompt scoring plans echo as a generation
        one = MemoryPlanner(shape, 2**40, margin=0.0).plan(args.prompt_tokens, new).predicted_peak_bytes
    budget = int(one * args.budget_requests)
    admission = MemoryAdmission(MemoryPlanner(shape, budget, margin=0.0))
    app.state.service.admission = admission
    server = serve_in_background(app, startup_timeout=120)
    body = {"model": "gemma", "max_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    if args.echo:
        body.update(echo=True, logprobs=0)
    try:
        with torch.no_grad():
            model.generate(torch.tensor([prompts[0][:16]]), max_new_tokens=2, do_sample=False)  # pages weights in
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        base, store_before = rss(), store.nbytes
        peak = base
        reserved = 0  # the most planned bytes held at once (a planner without reservations: admitted x one)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak, reserved
            while not done.is_set():
                peak = max(peak, rss())
                if hasattr(admission, "reserved_bytes"):
                    reserved = max(reserved, admission.reserved_bytes())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def post(ids: list[int]) -> int:
            response = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": ids}, timeout=1200)
            return response.status_code

        began = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            statuses = list(pool.map(post, prompts))
        seconds = time.perf_counter() - began
        done.set()
        sampler.join()
        admitted = statuses.count(200)
        total = reserved if hasattr(admission, "reserved_bytes") else admitted * one
        stats = httpx.get(f"{server.url}/v1/stats", timeout=30).json().get("memory", {})
        print(json.dumps({
            "scheduler": args.scheduler, "echo": args.echo, "requests": args.requests,
            "prompt_tokens": args.prompt_tokens, "one_request_planned_mb": round(one / MIB, 1),
            "budget_mb": round(budget / MIB, 1), "statuses": statuses, "admitted": admitted,
            "seconds": round(seconds, 1), "waited_for_memory": stats.get("waited"),
            "planned_total_over_budget": round(total / budget, 2),
            "measured_peak_mb": round((peak - base) / MIB, 1),
            "measured_over_budget": round((peak - base) / budget, 2),
            "store_growth_mb": round((store.nbytes - store_before) / MIB, 1),  # in the resident set, not the plan
            "calibration": {k: stats.get(k) for k in ("requests", "batch_windows", "residual_median", "kinds")},
        }, indent=1))
    finally:
        server.stop(timeout=60)


if __name__ == "__main__":
    main()
