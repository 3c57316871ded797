"""``kvboost-hf`` command line: ``demo`` (questions over a document, with and without reuse), ``model``, ``serve``, ``awq-pack`` and ``plan``."""

from __future__ import annotations

import argparse
import logging
import sys

from .demo import run_demo  # re-exported: kvboost_hf.cli.run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvboost-hf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="questions over a document, each turn timed with and without reuse")
    demo.add_argument("--model", default=None, help="HF model id or local path (default: embedded Gemma-3-270M)")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    sub.add_parser("model", help="assemble and convert the embedded default model; print its path")
    from .server.command import add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server with cross-request reuse"))
    from .streaming.pack import add_awq_pack_arguments

    add_awq_pack_arguments(sub.add_parser("awq-pack", help="write an AutoAWQ GEMM int4 checkpoint from a float model"))
    from .planner.command import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="capacity model: K/V per token, sequences that fit, decode roofline"))
    args = parser.parse_args(argv)
    if args.command == "plan":
        from .planner.command import plan_command

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        print(plan_command(args))
        return 0
    if args.command == "awq-pack":
        from .streaming.pack import PackError, awq_pack_command

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        try:
            print(awq_pack_command(args))
        except PackError as err:
            print(f"kvboost-hf awq-pack: error: {err}", file=sys.stderr)
            return 2
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
