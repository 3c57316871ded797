"""A plain step loop over the batching pieces (what the server's scheduler thread does, minus HTTP)."""

from __future__ import annotations

import torch

from kvboost_hf.batching import BatchLimits, BatchRunner, Sequence, plan_step


def run_batch(runner: BatchRunner, seqs: list[Sequence], limits: BatchLimits, on_step=None) -> list[dict]:
    """Run ``seqs`` to completion (admitted in order); returns one record per step."""
    waiting, running, steps = list(seqs), [], []
    while waiting or running:
        decoding = [s for s in running if s.decoding]
        prefilling = [s for s in running if s.prefilling]
        plan = plan_step(len(running), len(waiting), len(decoding), [], limits)
        for _ in range(plan.admit):
            seq = waiting.pop(0)
            runner.start(seq)
            running.append(seq)
            if seq.prefilling:
                prefilling.append(seq)
        chunks = plan_step(len(running), 0, len(decoding), [s.prefill.remaining for s in prefilling], limits).chunks
        logits, ends = runner.step(decoding, prefilling, chunks)
        for seq, row in zip(decoding, logits if logits is not None else ()):
            seq.sample(row)
        for seq, end in zip(prefilling, ends):
            if end is not None:
                seq.sample(end)
        steps.append({"decoded": [id(s) for s in decoding],
                      "chunks": {id(s): n for s, n in zip(prefilling, chunks) if n}})
        if on_step is not None:
            on_step(steps[-1])
        for seq in [s for s in running if s.finished]:
            runner.finish(seq)
            running.remove(seq)
    return steps


def generate_alone(model, prompt_ids: list[int], max_tokens: int, eos_ids: list[int]) -> list[int]:
    """Greedy tokens of one plain ``model.generate`` call."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=eos_ids, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
