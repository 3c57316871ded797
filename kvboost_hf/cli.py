"""``kvboost-hf`` command line: ``demo`` (multi-turn chat with and without reuse), ``model``, ``serve`` and ``awq-pack``."""

from __future__ import annotations

import argparse
import logging
import sys

DEMO_SYSTEM = (
    "You are the support assistant of Tessellate, a company that makes modular shelving. "
    "Answer in one or two short sentences. Facts you may use: shelves come in oak, walnut and "
    "white ash; a standard module is 80 cm wide and 30 cm deep; each shelf holds 25 kg; wall "
    "anchors are included for drywall and brick; delivery inside the EU takes five to eight "
    "working days; returns are free within 60 days if the parts are unused; the warranty covers "
    "manufacturing defects for ten years; replacement screws can be ordered from the parts page; "
    "assembly takes about twenty minutes per module with a single screwdriver."
)
DEMO_TURNS = [
    "How wide is one module?",
    "And how much weight can a shelf carry?",
    "Which woods can I choose from?",
    "Can I return it if I change my mind?",
    "How long will delivery take to Berlin?",
]


def run_demo(model, tokenizer, turns: list[str] = DEMO_TURNS, max_new_tokens: int = 24, out=sys.stdout) -> list[dict]:
    """Chat turn by turn; per turn, time the same greedy request without and with reuse."""
    import torch

    from . import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
    from .telemetry import FirstTokenTimer

    store = ChunkStore(max_bytes=1_000_000_000, chunk_size=128)
    eos = [tokenizer.eos_token_id]
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        eos.append(end_of_turn)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    messages = [{"role": "system", "content": DEMO_SYSTEM}]
    with torch.no_grad():  # untimed: the first generate of a process pays one-time costs
        model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=2, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)
    rows = []
    header = f"{'turn':>4} {'prompt':>7} {'reused':>7} {'TTFT plain':>11} {'TTFT reuse':>11} {'speed-up':>9}  identical"
    print(header, file=out)
    print("-" * len(header), file=out)
    for i, question in enumerate(turns, 1):
        messages.append({"role": "user", "content": question})
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
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
        row = dict(
            turn=i,
            prompt_tokens=stats.prompt_tokens,
            reused_tokens=stats.reused_tokens,
            ttft_plain_s=plain_ttft,
            ttft_reuse_s=reuse_ttft,
            identical=identical,
            reply=reply,
        )
        rows.append(row)
        print(
            f"{i:>4} {stats.prompt_tokens:>7} {stats.reused_tokens:>7} {plain_ttft * 1000:>9.0f}ms "
            f"{reuse_ttft * 1000:>9.0f}ms {plain_ttft / reuse_ttft:>8.1f}x  {'yes' if identical else 'NO'}",
            file=out,
        )
        print(f"      user: {question}\n      model: {reply!r}", file=out)
        messages.append({"role": "assistant", "content": reply})
    disable_chunk_reuse(model)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvboost-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="multi-turn chat, timed with and without reuse")
    demo.add_argument("--model", default=None, help="HF model id or local path (default: embedded Gemma-3-270M)")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    sub.add_parser("model", help="assemble and convert the embedded default model; print its path")
    from .server.command import add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server with cross-request reuse"))
    from .streaming.pack import add_awq_pack_arguments

    add_awq_pack_arguments(sub.add_parser("awq-pack", help="write an AutoAWQ GEMM int4 checkpoint from a float model"))
    args = parser.parse_args(argv)
    if args.command == "awq-pack":
        from .streaming.pack import awq_pack_command

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        print(awq_pack_command(args))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.command == "serve":
        from .server.command import ServeError, serve

        logging.getLogger("kvboost_hf").setLevel(args.log_level.upper())
        try:
            return serve(args)
        except ServeError as err:
            print(f"kvboost-hf serve: error: {err}", file=sys.stderr)
            return 2

    if args.command == "model":
        from .models import default_model_path

        logging.getLogger("kvboost_hf").setLevel(logging.INFO)
        print(default_model_path())
        return 0
    if args.command == "demo":
        from .models import load_model

        model, tokenizer = load_model(args.model)
        print(f"model: {args.model or 'embedded Gemma-3-270M (base model)'}; greedy, same request timed twice per turn\n")
        rows = run_demo(model, tokenizer, max_new_tokens=args.max_new_tokens)
        ok = all(r["identical"] for r in rows)
        print(f"\noutputs identical with and without reuse on every turn: {'yes' if ok else 'NO'}")
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
