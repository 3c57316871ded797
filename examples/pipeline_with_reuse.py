#!/usr/bin/env python
"""``pipeline("text-generation")`` over many prompts that share a long preamble.

    python examples/pipeline_with_reuse.py
    python examples/pipeline_with_reuse.py --model_name_or_path gpt2 --preamble_file context.txt

The preamble is warmed into the store once; every pipeline call then forwards only its own
question. Outputs are the same as without reuse (``--check`` verifies it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, pipeline

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm
from kvboost_hf.models import load_model

DEFAULT_PREAMBLE = (
    "Field notes from the coastal survey. The northern beach is 2.4 km long and faces west. Its dunes "
    "reach 14 m and are planted with marram grass. The southern cove is rocky, with tide pools that hold "
    "anemones, crabs and small fish. A footpath links the two along the cliff top; it is 3.1 km long and "
    "closed in strong winds. The lighthouse between them was automated in 1987.\n\n"
)


@dataclass
class Arguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "HF model id or path; default: embedded Gemma-3-270M"})
    preamble_file: str | None = field(default=None, metadata={"help": "text file shared by every prompt"})
    questions: list[str] = field(
        default_factory=lambda: [
            "Question: How long is the northern beach? Answer:",
            "Question: What lives in the tide pools? Answer:",
            "Question: When was the lighthouse automated? Answer:",
        ]
    )
    max_new_tokens: int = 16
    check: bool = field(default=True, metadata={"help": "also run without reuse and compare outputs"})


def main() -> None:
    (args,) = HfArgumentParser(Arguments).parse_args_into_dataclasses()
    logging.basicConfig(level=logging.WARNING)
    model, tokenizer = load_model(args.model_name_or_path)
    preamble = open(args.preamble_file).read() if args.preamble_file else DEFAULT_PREAMBLE
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_full_text=False)

    store = ChunkStore(max_bytes=1_000_000_000)
    stats = warm(model, preamble, store, tokenizer=tokenizer)
    print(f"warmed the preamble: {stats.prompt_tokens} tokens, {stats.stored_chunks} chunks")
    enable_chunk_reuse(model, store)
    answers = []
    for question in args.questions:
        start = time.perf_counter()
        with torch.no_grad():
            text = pipe(preamble + question, **gen)[0]["generated_text"]
        s = last_request_stats(model)
        answers.append(text)
        print(f"{question}{text!r}\n   [{s.reused_tokens}/{s.prompt_tokens} prompt tokens reused, {time.perf_counter() - start:.2f} s]")
    if args.check:
        disable_chunk_reuse(model)
        same = all(pipe(preamble + q, **gen)[0]["generated_text"] == a for q, a in zip(args.questions, answers))
        print(f"identical to the pipeline without reuse: {same}")


if __name__ == "__main__":
    main()
