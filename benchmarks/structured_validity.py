"""How often the base Gemma-3-270M's structured replies parse and validate, through the real server.

Six pydantic models (a simple record, a nested object, an array of records, an enum field,
number fields, optional fields) crossed with ``--prompts`` prompts each, sent to a live server
(``create_app`` + uvicorn, continuous batching) with the ``openai`` SDK as ``response_format``
``json_schema`` (strict), greedy and sampled (temperature 1, a seed per request), ``max_tokens``
200. A reply counts as valid when it parses, validates against the schema with ``jsonschema``
and loads into the pydantic model (what the SDK's ``.parse()`` does); ``finish_reason``
``"length"`` (cut short) is what ``.parse()`` raises ``LengthFinishReasonError`` for.

Usage: ``python benchmarks/structured_validity.py [--prompts 10] [--max-tokens 200] [--out NAME]``;
``--quick`` is a smoke run (2 prompts, nothing written). Results go to
``docs/benchmarks/NAME`` (default ``structured_validity.json``): per schema and mode the share of
valid replies, the finish reasons, and the median completion length. The script only uses the
public server API, so it runs unchanged on an older checkout (the "before" column).
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import jsonschema
from pydantic import BaseModel, Field, ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, write_json  # noqa: E402

MODEL_NAME = "gemma"


class Person(BaseModel):
    name: str
    age: int


class Address(BaseModel):
    street: str
    city: str
    zip_code: str


class Customer(BaseModel):
    name: str
    address: Address


class Order(BaseModel):
    order_id: int
    customer: Customer
    total: float


class Item(BaseModel):
    name: str
    quantity: int
    price: float


class ShoppingList(BaseModel):
    items: list[Item]


class Status(str, enum.Enum):
    open = "open"
    closed = "closed"
    pending = "pending"


class Ticket(BaseModel):
    title: str
    status: Status
    priority: int = Field(ge=1, le=5)


class Weather(BaseModel):
    city: str
    temperature: float
    humidity: float
    wind_speed: float


class Contact(BaseModel):
    name: str
    email: Optional[str] = None
    phone: Optional[str] = None
    age: Optional[int] = None


SUBJECTS = ["a baker from Lyon", "an astronaut", "a retired teacher", "a young painter", "a fisherman in Norway",
            "a software engineer", "a jazz musician", "a farmer in Kenya", "a librarian", "a marathon runner",
            "a chess champion", "a nurse in Toronto"]
CASES: dict[str, tuple[type[BaseModel], str]] = {
    "simple record": (Person, "Give the name and age of {}."),
    "nested object": (Order, "Write an order placed by {}: the customer with their address, and the total."),
    "array of records": (ShoppingList, "List what {} buys at the market, with quantity and price."),
    "enum field": (Ticket, "Open a support ticket about a problem {} has."),
    "number fields": (Weather, "Report the weather where {} lives."),
    "optional fields": (Contact, "Give the contact details of {}."),
}


def valid(text: str, schema: dict, model: type[BaseModel]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        model.model_validate_json(text)
    except (ValueError, jsonschema.ValidationError, ValidationError):
        return False
    return True


async def one(client, semaphore, model: type[BaseModel], prompt: str, sampled: bool, seed: int,
              max_tokens: int) -> dict:
    schema = model.model_json_schema()
    kw = {"temperature": 1.0, "seed": seed} if sampled else {"temperature": 0}
    async with semaphore:
        try:
            out = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": model.__name__, "schema": schema, "strict": True}}, **kw)
        except Exception as err:  # noqa: BLE001 - counted as an invalid reply, with the error kept
            return {"finish_reason": f"error: {type(err).__name__}", "completion_tokens": 0, "valid": False,
                    "text": str(err)[:300]}
    choice = out.choices[0]
    text = choice.message.content or ""
    return {"finish_reason": choice.finish_reason, "completion_tokens": out.usage.completion_tokens,
            "valid": valid(text, schema, model), "text": text}


async def run_all(base_url: str, prompts: int, max_tokens: int, concurrency: int) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
    semaphore = asyncio.Semaphore(concurrency)
    jobs, keys = [], []
    for case, (model, template) in CASES.items():
        for i in range(prompts):
            for sampled in (False, True):
                jobs.append(one(client, semaphore, model, template.format(SUBJECTS[i % len(SUBJECTS)]), sampled,
                                1000 + i, max_tokens))
                keys.append((case, "sampled" if sampled else "greedy", i))
    results = await asyncio.gather(*jobs)
    return [{"schema": case, "mode": mode, "prompt": i, **r} for (case, mode, i), r in zip(keys, results)]


def summarize(rows: list[dict]) -> dict:
    table: dict[str, dict] = {}
    for case in [*CASES, "all"]:
        for mode in ("greedy", "sampled", "all"):
            picked = [r for r in rows if case in ("all", r["schema"]) and mode in ("all", r["mode"])]
            if not picked:
                continue
            reasons: dict[str, int] = {}
            for r in picked:
                reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
            table[f"{case} / {mode}"] = {
                "requests": len(picked), "valid": sum(r["valid"] for r in picked),
                "valid_share": round(sum(r["valid"] for r in picked) / len(picked), 3),
                "finish_reasons": reasons,
                "median_completion_tokens": statistics.median(r["completion_tokens"] for r in picked)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per schema (each greedy and sampled)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (batched by the server)")
    parser.add_argument("--out", default="structured_validity.json", help="file name under docs/benchmarks")
    parser.add_argument("--label", default="", help="a note stored with the results (e.g. the commit)")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 64 tokens, nothing written")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_tokens = 2, 64

    from kvboost_hf import ChunkStore
    from kvboost_hf.models import load_default_model
    from kvboost_hf.server import ServerSettings, create_app
    from kvboost_hf.server.routes.background import serve_in_background

    model, tokenizer = load_default_model()
    store = ChunkStore(max_bytes=400_000_000, chunk_size=32)
    app = create_app(model, tokenizer, store, ServerSettings(model_name=MODEL_NAME, scheduler="batch",
                                                                 request_timeout=7200.0))
    running = serve_in_background(app, startup_timeout=300)
    try:
        start = time.perf_counter()
        rows = asyncio.run(run_all(f"{running.url}/v1", args.prompts, args.max_tokens, args.concurrency))
        seconds = time.perf_counter() - start
    finally:
        running.stop()
    table = summarize(rows)
    for key, value in table.items():
        print(f"{key:28s} valid {value['valid']:3d}/{value['requests']:3d} ({value['valid_share']:.0%})  "
              f"finish {value['finish_reasons']}  median tokens {value['median_completion_tokens']}")
    print(f"{len(rows)} requests in {seconds:.0f} s")
    if not args.quick:
        path = write_json(args.out, {
            "label": args.label, "prompts_per_schema": args.prompts, "max_tokens": args.max_tokens,
            "seconds": round(seconds, 1), "environment": environment(),
            "schemas": {case: model.model_json_schema() for case, (model, _) in CASES.items()},
            "summary": table, "replies": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
