#!/usr/bin/env python
"""Speculative decoding composed with chunk reuse: a self-draft, a head draft, prompt lookup and store-wide drafts.

    python examples/speculative_decoding.py                                  # embedded Gemma-3-270M
    python examples/speculative_decoding.py --draft int4 --draft_vocab 32768
    python examples/speculative_decoding.py --draft head --draft_vocab 32768  # its own layers, a small head
    python examples/speculative_decoding.py --draft store --repeat 3

Asks the same document-grounded question ``--repeat`` times. Each answer is checked identical
to plain greedy ``generate`` and printed with what speculation did: draft, rounds, acceptance,
tokens per target forward, the controller's draft lengths, and the prompt tokens the store
served to the model (and to a model draft).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser

from kvboost_hf import ChunkStore, enable_chunk_reuse, last_request_stats, make_draft, make_head_draft
from kvboost_hf.models import load_model


@dataclass
class Arguments:
    model_name_or_path: str | None = field(default=None,
                                           metadata={"help": "HF model id or path; default: Gemma-3-270M"})
    draft: str = field(default="store", metadata={"help": "int4, int8, head, prompt-lookup or store"})
    draft_vocab: int | None = field(default=None, metadata={"help": "FR-Spec head size of a self-draft or head draft"})
    draft_layers: int | None = field(default=None, metadata={"help": "self-draft keeps the first N layers"})
    max_new_tokens: int = field(default=48)
    repeat: int = field(default=2)
    document: str = field(default=(
        "The harbour museum keeps the lighthouse logs in a glass case. Every evening the keeper wrote down the "
        "wind, the colour of the sea, the ships that passed and the birds that rested on the gallery rail. "
        "Over forty years the logs grew to sixty volumes."))


def main() -> None:
    (args,) = HfArgumentParser(Arguments).parse_args_into_dataclasses()
    model, tokenizer = load_model(args.model_name_or_path)
    prompt = f"{args.document}\n\nQuote the document's second sentence exactly.\nAnswer: Every evening"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    reference = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)

    enable_chunk_reuse(model, ChunkStore(max_bytes=2_000_000_000, chunk_size=64))
    if args.draft in ("int4", "int8"):
        draft = make_draft(model, bits=int(args.draft[3]), vocab=args.draft_vocab, layers=args.draft_layers,
                           tokenizer=tokenizer)
    elif args.draft == "head":
        draft = make_head_draft(model, args.draft_vocab, tokenizer=tokenizer)
    else:
        draft = args.draft
    for i in range(args.repeat):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, draft=draft)
        seconds = time.perf_counter() - start
        stats = last_request_stats(model)
        spec = stats.speculation
        print(f"request {i + 1}: {seconds:.2f} s, identical to plain: {torch.equal(out, reference)}, "
              f"prompt tokens from the store: {stats.reused_tokens}/{stats.prompt_tokens}")
        print(f"  draft {spec.draft}: {spec.rounds} target forwards, {spec.accepted_tokens}/{spec.drafted_tokens} "
              f"draft tokens accepted, {spec.tokens_per_round:.2f} tokens per forward, draft lengths {spec.choices}"
              + (f", draft prompt tokens from the store: {spec.draft_reused_tokens}"
                 if spec.draft_reused_tokens else "")
              + (f"\n  switched off: {spec.off_reason}" if spec.off_reason else ""))
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
