#!/usr/bin/env python
"""Multi-turn chat where every turn reuses the K/V of the whole previous conversation.

    python examples/chat_with_reuse.py                                   # embedded Gemma-3-270M
    python examples/chat_with_reuse.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct
    python examples/chat_with_reuse.py --interactive

Each turn prints the prompt length, how many prompt tokens came from the store and the time
to first token. Generation settings are plain ``generate`` arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser

from kvboost_hf import ChunkStore, enable_chunk_reuse, last_request_stats
from kvboost_hf.generation.timing import FirstTokenTimer
from kvboost_hf.models import load_model


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "HF model id or path; default: embedded Gemma-3-270M"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})


@dataclass
class ChatArguments:
    system_prompt: str = field(default="You are a concise assistant for a public library.")
    turns: list[str] = field(
        default_factory=lambda: [
            "What are your opening hours?",
            "Can I borrow e-books?",
            "How many books can I take at once?",
            "Do you have study rooms?",
        ]
    )
    interactive: bool = field(default=False, metadata={"help": "read user turns from stdin instead of --turns"})
    max_new_tokens: int = 48
    cache_bytes: int = 1_000_000_000
    chunk_size: int = 128


def main() -> None:
    model_args, chat_args = HfArgumentParser((ModelArguments, ChatArguments)).parse_args_into_dataclasses()
    logging.basicConfig(level=logging.WARNING)
    model, tokenizer = load_model(model_args.model_name_or_path, dtype=getattr(torch, model_args.dtype))
    store = ChunkStore(max_bytes=chat_args.cache_bytes, chunk_size=chat_args.chunk_size)
    enable_chunk_reuse(model, store)

    messages = [{"role": "system", "content": chat_args.system_prompt}]
    turns = iter(lambda: input("you> "), "") if chat_args.interactive else iter(chat_args.turns)
    for question in turns:
        messages.append({"role": "user", "content": question})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        inputs = inputs.to(model.device)
        timer = FirstTokenTimer()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=chat_args.max_new_tokens, do_sample=False, streamer=timer.start())
        reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        stats = last_request_stats(model)
        if not chat_args.interactive:
            print(f"you> {question}")
        print(f"model> {reply}")
        print(f"       [{stats.prompt_tokens} prompt tokens, {stats.reused_tokens} reused, TTFT {timer.ttft * 1000:.0f} ms]")
        messages.append({"role": "assistant", "content": reply})
    print(f"store: {store.stats()}")


if __name__ == "__main__":
    main()
