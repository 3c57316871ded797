"""``kvboost-hf demo``: a question-answering session over a product sheet, each turn timed with and without reuse.

The embedded model is a base (pretrained) model, so the demo speaks the format base models
answer well: a short document, two worked question/answer pairs, then the user's questions one
by one, each reply appended before the next question. Every turn's prompt extends the previous
prompt and reply, which is what reuse serves from the store.
"""

from __future__ import annotations

import sys

import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.generation.timing import FirstTokenTimer

DEMO_DOCUMENT = (
    "Tessellate makes modular shelving. Shelves come in oak, walnut and white ash. A standard module is "
    "80 cm wide and 30 cm deep. Each shelf holds 25 kg. Wall anchors for drywall and brick are included. "
    "Delivery inside the EU takes five to eight working days. Returns are free within 60 days if the parts "
    "are unused. The warranty covers manufacturing defects for ten years. Replacement screws can be ordered "
    "from the parts page. Assembly takes about twenty minutes per module with a single screwdriver."
)
DEMO_EXAMPLES = [
    ("How deep is a module?", "A module is 30 cm deep."),
    ("Are wall anchors included?", "Yes, anchors for drywall and brick are included."),
]
DEMO_TURNS = [
    "How wide is one module?",
    "And how much weight can a shelf carry?",
    "Which woods can I choose from?",
    "Can I return it if I change my mind?",
    "How long will delivery take to Berlin?",
]


def demo_preamble() -> str:
    """The document and worked examples every turn's prompt starts with."""
    examples = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in DEMO_EXAMPLES)
    return f"Product sheet:\n{DEMO_DOCUMENT}\n\n{examples}"


def _line_end_ids(tokenizer) -> list[int]:
    """End of sequence, and the tokens that are one or more line breaks."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in ("\n", "\n\n", "\n\n\n"):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1 and encoded[0] not in ids:
            ids.append(encoded[0])
    return ids


def run_demo(model, tokenizer, turns: list[str] = DEMO_TURNS, max_new_tokens: int = 24, out=sys.stdout) -> list[dict]:
    """Ask ``turns`` one by one; per turn, time the same greedy request without and with reuse."""
    store = ChunkStore(max_bytes=1_000_000_000, chunk_size=128)
    # An answer ends at a line break. Stopping on newline token ids, not stop_strings: transformers'
    # StopStringCriteria scans the whole vocabulary on every call (about a second for Gemma's 262k).
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=_line_end_ids(tokenizer),
              pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():  # untimed: the first generate of a process pays one-time costs
        model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=2, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)
    rows = []
    header = f"{'turn':>4} {'prompt':>7} {'reused':>7} {'TTFT plain':>11} {'TTFT reuse':>11} {'speed-up':>9}  identical"
    print(header, file=out)
    print("-" * len(header), file=out)
    text = demo_preamble()
    for i, question in enumerate(turns, 1):
        text += f"Question: {question}\nAnswer:"
        inputs = tokenizer(text, return_tensors="pt")
        timer = FirstTokenTimer()
        disable_chunk_reuse(model)
        with torch.no_grad():
            plain_out = model.generate(**inputs, streamer=timer.start(), **kw)
        plain_ttft = timer.ttft
        enable_chunk_reuse(model, store)
        with torch.no_grad():
            reuse_out = model.generate(**inputs, streamer=timer.start(), **kw)
        reuse_ttft = timer.ttft
        stats = last_request_stats(model)
        identical = torch.equal(plain_out, reuse_out)
        reply = tokenizer.decode(reuse_out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        rows.append(dict(
            turn=i, prompt_tokens=stats.prompt_tokens, reused_tokens=stats.reused_tokens,
            ttft_plain_s=plain_ttft, ttft_reuse_s=reuse_ttft, identical=identical, reply=reply,
        ))
        print(
            f"{i:>4} {stats.prompt_tokens:>7} {stats.reused_tokens:>7} {plain_ttft * 1000:>9.0f}ms "
            f"{reuse_ttft * 1000:>9.0f}ms {plain_ttft / reuse_ttft:>8.1f}x  {'yes' if identical else 'NO'}",
            file=out,
        )
        print(f"      Q: {question}\n      A: {reply}", file=out)
        text += f" {reply}\n\n"
    disable_chunk_reuse(model)
    return rows
