"""How often exact reuse changes greedy output in bf16, against full prefill and against HF's prompt cache.

For each model (the four tiny families and Gemma-3-270M), all in bfloat16: an earlier prompt
shares a prefix with the measured prompt; the measured prompt is generated greedily

- plain:        without reuse (one forward over the whole prompt);
- reuse:        with reuse on, after the earlier prompt was stored (the prefix K/V come from the
                earlier request's prefill, the rest is forwarded);
- prompt cache: HF's own pattern, a DynamicCache pre-filled with the prefix, then generate.

reuse vs prompt cache is bit-for-bit by construction when the prefix was computed in one forward
of exactly the prefix (``warm``; tests/generation/test_exactness.py); here the prefix comes from a longer
earlier prompt, so the stored rows come out of a differently shaped matmul. A "mismatch" is a
prompt whose greedy continuation differs. ``hf_prompt_cache_mismatch_vs_plain`` is HF's own
prompt-cache pattern against a full prefill: the same effect without kvboost. Writes docs/benchmarks/bf16_exactness.json.

Usage: ``python benchmarks/bf16_exactness.py [--tiny-prompts 200] [--gemma-prompts 30]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import environment, essays, write_json  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats  # noqa: E402


def tiny_prompts(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        prefix = torch.randint(3, vocab, (1, 48), generator=g)
        earlier = torch.cat([prefix, torch.randint(3, vocab, (1, 16), generator=g)], dim=1)
        timed = torch.cat([prefix, torch.randint(3, vocab, (1, 12), generator=g)], dim=1)
        yield prefix, earlier, timed


def gemma_prompts(tokenizer, n: int):
    texts = essays()
    for i in range(n):
        ids = tokenizer(texts[i % len(texts)], return_tensors="pt")["input_ids"]
        start = 40 * (i // len(texts))
        prefix = torch.cat([ids[:, :1], ids[:, 1 + start : 1 + start + 150]], dim=1)
        other = tokenizer(texts[(i + 5) % len(texts)], add_special_tokens=False, return_tensors="pt")["input_ids"]
        question = tokenizer(" In one sentence, the main point is", add_special_tokens=False, return_tensors="pt")["input_ids"]
        yield prefix, torch.cat([prefix, other[:, :40]], dim=1), torch.cat([prefix, question], dim=1)


def measure(model, prompts, new_tokens: int) -> dict:
    greedy = dict(max_new_tokens=new_tokens, do_sample=False)
    total = vs_plain = vs_prompt_cache = first_token = prompt_cache_vs_plain = 0
    for prefix, earlier, timed in prompts:
        disable_chunk_reuse(model)
        with torch.no_grad():
            plain = model.generate(timed, **greedy)
            cache = DynamicCache(config=model.config)
            model(prefix, past_key_values=cache, use_cache=True)
            via_prompt_cache = model.generate(timed, past_key_values=copy.deepcopy(cache), **greedy)
            enable_chunk_reuse(model, ChunkStore(max_bytes=10**9, chunk_size=16))
            model.generate(earlier, **greedy)
            reused = model.generate(timed, **greedy)
        assert last_request_stats(model).reused_tokens >= prefix.shape[1]
        disable_chunk_reuse(model)
        n = timed.shape[1]
        total += 1
        vs_plain += not torch.equal(reused, plain)
        vs_prompt_cache += not torch.equal(reused, via_prompt_cache)
        prompt_cache_vs_plain += not torch.equal(via_prompt_cache, plain)
        first_token += int(reused[0, n] != plain[0, n])
    return {"prompts": total, "greedy_mismatch_vs_plain": vs_plain, "first_token_mismatch_vs_plain": first_token,
            "greedy_mismatch_vs_prompt_cache": vs_prompt_cache,
            "hf_prompt_cache_mismatch_vs_plain": prompt_cache_vs_plain, "new_tokens": new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-prompts", type=int, default=200)
    parser.add_argument("--gemma-prompts", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    from tests.conftest import FAMILIES, make_tiny

    results = {}
    for family in FAMILIES:
        model = make_tiny(family, seed=11).to(torch.bfloat16)
        results[f"tiny-{family}"] = measure(model, tiny_prompts(args.tiny_prompts, model.config.vocab_size, 5),
                                            args.new_tokens)
        print(family, results[f"tiny-{family}"], flush=True)
    if args.gemma_prompts:
        from kvboost_hf.models import load_default_model

        model, tokenizer = load_default_model()
        model = model.to(torch.bfloat16)
        results["gemma-3-270m"] = measure(model, gemma_prompts(tokenizer, args.gemma_prompts), args.new_tokens)
        print("gemma-3-270m", results["gemma-3-270m"], flush=True)
    path = write_json("bf16_exactness.json", {"dtype": "bfloat16", "results": results, "environment": environment()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
