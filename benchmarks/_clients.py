"""Streaming ``openai`` SDK clients in a process of their own, as real clients are.

A server measured with its clients in its own process shares its GIL with them: every SSE
chunk the clients parse delays the scheduler thread between torch calls. The benchmarks start
this file as a subprocess (:func:`run_clients`), so only the CPU is shared, as on any machine
that runs clients next to a server. Token times come from ``time.perf_counter`` in this process
(CLOCK_MONOTONIC: comparable with the parent's).

Run as ``python _clients.py JSON``: ``{"kind": "load" | "admission", ...}``; prints JSON rows.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

MODEL_NAME = "gemma-3-270m"


async def stream_one(client, messages: list[dict], max_tokens: int) -> dict:
    """One streaming chat request: its start, the arrival time of each content chunk, usage."""
    start = time.perf_counter()
    times, usage = [], None
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    return {"start": start, "end": time.perf_counter(), "times": times,
            "usage": None if usage is None else {
                "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0}}


async def load(url: str, system: str, questions: list[str], max_tokens: list[int], clients: int) -> dict:
    """``clients`` concurrent clients work through ``questions`` (one request each, in order)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    todo, rows = list(zip(questions, max_tokens)), []

    async def one_client():
        while todo:
            question, n = todo.pop(0)
            rows.append(await stream_one(client, [{"role": "system", "content": system},
                                                  {"role": "user", "content": question}], n))

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return {"wall_s": wall, "rows": rows}


async def admission(url: str, system: str, questions: list[str], stream_tokens: int, long_ids: list[int]) -> dict:
    """Streams decode; once all run, one long prompt is admitted. Returns the streams and when it was."""
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    tasks = [asyncio.create_task(stream_one(
        client, [{"role": "system", "content": system}, {"role": "user", "content": q}], stream_tokens))
        for q in questions]
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(base_url=url.removesuffix("/v1"), timeout=30) as http:
        for _ in range(6000):  # every stream is running (the server's own counters)
            stats = (await http.get("/v1/stats")).json()
            if stats["queue"]["running"] >= min(len(questions), stats["queue"]["workers"]) \
                    and stats["queue"]["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
    await asyncio.sleep(2.0)  # a few tokens into every stream
    sent = time.perf_counter()
    await client.completions.create(model=MODEL_NAME, prompt=long_ids, max_tokens=1, temperature=0)
    admitted = time.perf_counter()
    rows = await asyncio.gather(*tasks)
    await client.close()
    return {"sent": sent, "admitted": admitted, "rows": rows}


def run_clients(**spec) -> dict:
    """Run the clients described by ``spec`` in a subprocess; their JSON result."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"client process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    spec = json.loads(sys.argv[1])
    kind = spec.pop("kind")
    result = asyncio.run({"load": load, "admission": admission}[kind](**spec))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
