#!/usr/bin/env python
"""Several prompts decoded together, each reusing stored K/V: the batching pieces behind
``kvboost-hf serve --scheduler batch``, used in-process.

    python examples/batched_decoding.py            # embedded Gemma-3-270M

Every prompt shares a system prompt; the first request stores it, the others load it from the
store. Each step decodes every running request in one forward; greedy replies equal one
``generate`` call per prompt.
"""

from __future__ import annotations

from kvboost_hf import ChunkStore, enable_chunk_reuse
from kvboost_hf.batching import BatchLimits, BatchRunner, RowSampling, Sequence, group_chunks, plan_step
from kvboost_hf.models import load_model
from kvboost_hf.server.engine.generation import stop_token_ids

SYSTEM = ("You are a concise assistant for a bicycle shop. Opening hours: Monday to Saturday, 9 to 18. "
          "Repairs take two working days. A basic service costs 49 euros. ")
QUESTIONS = ["When are you open?", "How long does a repair take?", "What does a service cost?",
             "Do you open on Sundays?"]


def run(runner: BatchRunner, waiting: list[Sequence], limits: BatchLimits) -> None:
    """Step until every sequence finished: admit, decode the decoding rows, prefill chunks, commit."""
    running: list[Sequence] = []
    while waiting or running:
        decoding = [s for s in running if s.decoding]
        prefilling = [s for s in running if s.prefilling]
        for _ in range(plan_step(len(running), len(waiting), len(decoding), [], limits).admit):
            seq = waiting.pop(0)
            runner.start(seq)  # its own cache, with what the store holds of its prompt
            running.append(seq)
            prefilling.append(seq)
        chunks = plan_step(len(running), 0, len(decoding), [s.prefill.remaining for s in prefilling], limits).chunks
        if decoding:
            for seq, logits in zip(decoding, runner.decode(decoding)):  # one forward for every row
                seq.sample(logits)
        for group in group_chunks(chunks):
            rows = [prefilling[i] for i in group]
            for seq, logits in zip(rows, runner.prefill(rows, [chunks[i] for i in group])):
                if logits is not None:  # the prompt is all in: its first token
                    seq.sample(logits)
        for seq in [s for s in running if s.finished]:
            runner.finish(seq)  # store its confirmed K/V
            running.remove(seq)


def main() -> None:
    model, tokenizer = load_model(None)
    store = ChunkStore(max_bytes=500_000_000, chunk_size=16)
    enable_chunk_reuse(model, store)
    runner, limits = BatchRunner(model, store), BatchLimits(max_batch_size=4, max_batched_tokens=64)
    eos = stop_token_ids(model, tokenizer)
    seqs = [Sequence(tokenizer(SYSTEM + q)["input_ids"], 24, RowSampling(temperature=0.7 if i % 2 else 0, seed=i),
                     eos) for i, q in enumerate(QUESTIONS)]
    run(runner, seqs[:1], limits)  # the first request stores the system prompt...
    run(runner, seqs[1:], limits)  # ...the others load it, decoded together
    for seq in seqs:
        reused = seq.cache.stats.reused_tokens
        reply = tokenizer.decode(seq.generated, skip_special_tokens=True)
        print(f"[{reused:>3}/{len(seq.prompt_ids)} prompt tokens from the store] "
              f"{tokenizer.decode(seq.prompt_ids[-8:])!r} -> {reply!r}")


if __name__ == "__main__":
    main()
