"""Costs of the OpenAI features on Gemma-3-270M (float32, CPU), in one process, interleaved rounds.

- ``prompt_logprobs``: scoring a prompt for ``echo`` + ``logprobs`` (lm-eval's loglikelihood
  request), on a fresh prompt per round: a full forward of the prompt plus a 16-token ending (no
  store; also what ``top_logprobs`` > 0 costs), then with a fresh store: the first scoring of the
  prompt (a forward that also stores K/V and logprobs), a second scoring of it (logprobs served
  from the store) and the prompt with the ending (stored part served, the ending forwarded on
  stored K/V; compare with the full forward).
  Reports wall time and tokens forwarded.
- ``grammar``: greedy generation of ``--new-tokens`` tokens with and without a JSON-schema
  grammar mask (xgrammar), per-token time; the first compile (vocabulary table) reported apart.

Usage: ``python benchmarks/openai_features.py [--rounds 5] [--prompt-tokens 1000]``; ``--quick``
is a smoke run (2 rounds, short prompts, nothing written). Results go to
``docs/benchmarks/openai_features.json``. Every served logprob is checked against the full
forward (1e-4) while timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, essays, write_json  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402
from kvboost_hf.server.decoding.logprobs import prompt_logprobs  # noqa: E402
from kvboost_hf.server.decoding.structured import GrammarCompilers  # noqa: E402

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
          "required": ["title", "year", "tags"]}


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def counted(model, fn) -> tuple[float, int, object]:
    """(seconds, tokens the forwards actually ran, result) of ``fn()``. The counting hook is added
    now, after reuse's own pre-hook, so it sees the inputs reuse trimmed."""
    tokens = [0]

    def count(module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens[0] += int(ids.shape[1]) if ids is not None else 0

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        seconds, out = timed(fn)
    finally:
        handle.remove()
    return seconds, tokens[0], out


def prompt_logprobs_part(model, tokenizer, texts: list[str], prompt_tokens: int, rounds: int) -> dict:
    rows: dict[str, list[tuple[float, int]]] = {"full_forward": [], "first_with_store": [], "second_same_prompt": [],
                                                "second_new_ending": []}
    for r in range(rounds):
        ids = tokenizer(texts[r % len(texts)])["input_ids"][:prompt_tokens]
        ending = tokenizer(texts[(r + 1) % len(texts)], add_special_tokens=False)["input_ids"][:16]
        disable_chunk_reuse(model)
        seconds, tokens, reference = counted(model, lambda: prompt_logprobs(model, ids + ending, 0))
        rows["full_forward"].append((seconds, tokens))
        store = ChunkStore(max_bytes=2_000_000_000, chunk_size=128)
        enable_chunk_reuse(model, store)
        try:
            for name, prompt in (("first_with_store", ids), ("second_same_prompt", ids),
                                 ("second_new_ending", ids + ending)):
                seconds, tokens, got = counted(model, lambda: prompt_logprobs(model, prompt, 0, store))
                rows[name].append((seconds, tokens))
                worst = max(abs(a.logprob - b.logprob) for a, b in zip(got[1:], reference[1:]))
                assert worst < 1e-4, f"{name}: logprobs differ from a full forward by {worst}"
        finally:
            disable_chunk_reuse(model)
    return {name: {"median_s": statistics.median(s for s, _ in vals), "tokens_forwarded": statistics.median(
        t for _, t in vals)} for name, vals in rows.items()} | {"prompt_tokens": prompt_tokens}


def grammar_part(model, tokenizer, prompt: str, new_tokens: int, rounds: int) -> dict:
    grammars = GrammarCompilers()
    vocab = model.config.get_text_config(decoder=True).vocab_size
    seconds, _ = timed(lambda: grammars.json_processor(tokenizer, vocab, [tokenizer.eos_token_id], SCHEMA))
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    per_token: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for r in range(rounds):
        order = ["unconstrained", "json_schema"] if r % 2 == 0 else ["json_schema", "unconstrained"]
        for name in order:
            processors = [grammars.json_processor(tokenizer, vocab, [tokenizer.eos_token_id], SCHEMA)] \
                if name == "json_schema" else []
            took, out = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=1, do_sample=False,
                                                     logits_processor=processors))
            per_token[name].append(took / max(1, out.shape[1] - ids.shape[1]))
    medians = {name: statistics.median(v) for name, v in per_token.items()}
    return {"first_compile_s": seconds, "per_token_s": medians,
            "overhead_ratio": medians["json_schema"] / medians["unconstrained"], "new_tokens": new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 200-token prompts, 8 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prompt_tokens, args.new_tokens = 2, 200, 8
    model, tokenizer = load_default_model()
    texts = essays()
    with torch.no_grad():
        result = {
            "environment": environment(),
            "settings": vars(args),
            "prompt_logprobs": prompt_logprobs_part(model, tokenizer, texts, args.prompt_tokens, args.rounds),
            "grammar": grammar_part(model, tokenizer, "A book, as JSON:", args.new_tokens, args.rounds),
        }
    if not args.quick:  # a smoke run proves the script works; its figures are not worth keeping
        print(f"wrote {write_json('openai_features.json', result)}")
    for name, row in result["prompt_logprobs"].items():
        print(name, row)
    print("grammar", result["grammar"])


if __name__ == "__main__":
    main()
