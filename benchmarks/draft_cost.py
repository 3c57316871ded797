"""Cost of a self-draft of Gemma-3-270M: one draft token and the draft's prompt prefill, per setting.

One process; the settings are interleaved per repetition; medians. The draft is the int4
FR-Spec self-draft the speculative benchmark uses (``make_draft(bits=4, vocab=32768)``), run with
a plain ``DynamicCache`` after a document prompt, so this is the forward alone (a request adds
HF's generate loop). Settings: float32 or bf16 activations, with HF's RMSNorm modules or the
fused ``FusedRMSNorm`` (``make_draft`` fuses them; "hf norms" puts the originals back).
Greedy draft tokens are compared with the float32 / HF-norm draft's.

    python benchmarks/draft_cost.py [--reps 5] [--tokens 30]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _common import DOCS_BENCH, environment, median
from speculative import document_prompts
from transformers import DynamicCache

from kvboost_hf import make_draft
from kvboost_hf.models import load_default_model
from kvboost_hf.models.fused_norm import FusedRMSNorm
from kvboost_hf.speculative.self_draft import clone_structure


def with_hf_norms(draft, model):
    """``draft`` with the target's RMSNorm module objects put back in place of every FusedRMSNorm."""
    originals = dict(clone_structure(model).named_modules())
    for name, module in list(draft.named_modules()):
        if isinstance(module, FusedRMSNorm):
            parent, _, child = name.rpartition(".")
            setattr(draft.get_submodule(parent) if parent else draft, child, originals[name])
    return draft


@torch.no_grad()
def measure(draft, ids: torch.Tensor, tokens: int) -> tuple[float, float, list[int]]:
    cache = DynamicCache(config=draft.config)
    start = time.perf_counter()
    out = draft(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    step = out.logits[:, -1:].argmax(-1)
    times, chosen = [], []
    for _ in range(tokens):
        start = time.perf_counter()
        out = draft(step, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
        step = out.logits[:, -1:].argmax(-1)
        chosen.append(int(step))
    return prefill * 1e3, median(times) * 1e3, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--doc-tokens", type=int, default=600)
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    ids = document_prompts(tokenizer, 1, args.doc_tokens)[0]
    ids = ids if ids.dim() == 2 else ids[None]
    drafts = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = "bf16" if dtype == torch.bfloat16 else "float32"
        fused = make_draft(model, bits=4, vocab=32768, tokenizer=tokenizer, activations=dtype)
        drafts[f"{name}, hf norms"] = with_hf_norms(make_draft(model, bits=4, vocab=32768, tokenizer=tokenizer,
                                                               activations=dtype), model)
        drafts[f"{name}, fused norms"] = fused
    samples = {name: ([], []) for name in drafts}
    tokens = {}
    for _ in range(args.reps):
        for name, draft in drafts.items():
            prefill, step, chosen = measure(draft, ids, args.tokens)
            samples[name][0].append(prefill)
            samples[name][1].append(step)
            tokens[name] = chosen
    reference = tokens["float32, hf norms"]
    rows = {name: {"prefill_ms": median(pre), "token_ms": median(step),
                   "same_tokens": sum(a == b for a, b in zip(tokens[name], reference)), "of": len(reference)}
            for name, (pre, step) in samples.items()}
    print(f"prompt {ids.shape[1]} tokens, {args.reps} reps, medians")
    for name, row in rows.items():
        print(f"{name:22s} prefill {row['prefill_ms']:7.1f} ms   token {row['token_ms']:5.1f} ms   "
              f"greedy tokens as float32/hf {row['same_tokens']}/{row['of']}")
    DOCS_BENCH.mkdir(parents=True, exist_ok=True)
    out = {"environment": environment(), "settings": vars(args), "prompt_tokens": ids.shape[1], "rows": rows}
    (DOCS_BENCH / "draft_cost.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
