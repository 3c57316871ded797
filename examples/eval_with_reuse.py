#!/usr/bin/env python
"""Distributed evaluation that shares one K/V tier across processes: ``accelerate launch`` runs a
``pipeline("text-generation")`` eval in each process over its share of prompts that reuse a few long
documents; every process reads and writes one disk directory (or one Redis), so a document one
process prefilled is reused by the others.

    accelerate launch --num_processes 2 examples/eval_with_reuse.py            # on GPUs
    accelerate launch --multi_gpu --num_processes 2 examples/eval_with_reuse.py  # 2 CPU processes (gloo)
    accelerate launch --num_processes 2 examples/eval_with_reuse.py --remote redis://127.0.0.1:6379/0
    python examples/eval_with_reuse.py --model_name_or_path gpt2 --shared_dir /tmp/kv

Greedy outputs are those of the pipeline without reuse (``--check`` compares them in each process).
The main process prints the gathered answers and how many prompt tokens each process reused.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from transformers import HfArgumentParser, pipeline

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.models import load_model

DOCUMENTS = [
    "The northern beach is 2.4 km long and faces west. Its dunes reach 14 m and are planted with marram grass. "
    "A footpath along the cliff top, 3.1 km long, links it to the southern cove; it closes in strong winds. ",
    "The mill was built in 1822 on the river's east bank. It ground grain until 1951, then made paper until 1978. "
    "Its wheel, 6 m across, was restored in 2004 and turns on summer weekends. ",
    "The orchard holds 140 trees: 90 apple, 30 pear and 20 plum. Harvest runs from late August to October, and "
    "the cider press in the barn takes visitors' apples on the first Saturday of each month. ",
]
QUESTIONS = ["Question: How long is it? Answer:", "Question: What year is mentioned first? Answer:",
             "Question: What happens in summer? Answer:", "Question: Name one number in the text. Answer:"]


@dataclass
class Arguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "HF model id or path; default: embedded Gemma-3-270M"})
    shared_dir: str | None = field(default=None, metadata={"help": "disk tier every process shares (default: a temp dir)"})
    remote: str | None = field(default=None, metadata={"help": "Redis URL of a tier every process shares instead"})
    repeat: int = field(default=4, metadata={"help": "copies of each document in the preamble (longer prefixes)"})
    max_new_tokens: int = 12
    check: bool = field(default=True, metadata={"help": "also run without reuse and compare outputs"})


def main() -> None:
    (args,) = HfArgumentParser(Arguments).parse_args_into_dataclasses()
    logging.basicConfig(level=logging.WARNING)
    state = PartialState(cpu=not torch.cuda.is_available())  # CPU processes join over gloo
    shared_dir = args.shared_dir
    if shared_dir is None and args.remote is None:  # one temp dir, named by the main process for all
        name = [tempfile.mkdtemp(prefix="kvboost-eval-")] if state.is_main_process else [None]
        shared_dir = broadcast(name, state)[0]
    store = ChunkStore(max_bytes=1_000_000_000, chunk_size=32,
                       **({"remote": args.remote} if args.remote else {"disk_path": shared_dir}))
    model, tokenizer = load_model(args.model_name_or_path)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_full_text=False)
    prompts = [doc * args.repeat + q for doc in DOCUMENTS for q in QUESTIONS]
    enable_chunk_reuse(model, store)
    rows = []
    # Prompts go out round robin: each document's questions land in every process.
    with state.split_between_processes(list(range(len(prompts)))) as mine:
        for index in sorted(mine, key=lambda i: (i % len(QUESTIONS), i)):
            if state.num_processes > 1:
                state.wait_for_everyone()  # lock-step: one process's stored chunks are there for the next round
            with torch.no_grad():
                text = pipe(prompts[index], **gen)[0]["generated_text"]
            stats = last_request_stats(model)
            rows.append({"prompt": index, "process": state.process_index, "answer": text,
                         "reused": stats.reused_tokens, "prompt_tokens": stats.prompt_tokens})
    store.flush(timeout_s=10.0)
    if args.check:
        disable_chunk_reuse(model)
        for row in rows:
            row["same_without_reuse"] = pipe(prompts[row["prompt"]], **gen)[0]["generated_text"] == row["answer"]
    everything = sorted(gather_object(rows), key=lambda r: r["prompt"])
    if state.is_main_process:
        for process in range(state.num_processes):
            own = [r for r in everything if r["process"] == process]
            print(f"process {process}: {len(own)} prompts, {sum(r['reused'] for r in own)}/"
                  f"{sum(r['prompt_tokens'] for r in own)} prompt tokens reused")
        print(json.dumps({"identical_to_no_reuse": all(r.get("same_without_reuse", True) for r in everything),
                          "answers": [r["answer"] for r in everything]}, indent=1))


def broadcast(values: list, state: PartialState) -> list:
    """``values`` of the main process, in every process."""
    if state.num_processes == 1:
        return values
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list(values)


if __name__ == "__main__":
    main()
