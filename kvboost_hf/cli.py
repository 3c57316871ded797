"""The ``kvboost-hf`` command line: ``demo``, ``model``, ``serve``, ``awq-pack``, ``plan``.

Every command checks its flags before anything slow (importing the server, loading a model);
a bad value ends with one line on stderr, ``kvboost-hf CMD: error: ...`` saying what to change,
and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata
from typing import Any

from kvboost_hf.cli_checks import FlagError, first_line, model_path_flag, size_flag

DESCRIPTION = ("KV-cache reuse for Hugging Face transformers: an OpenAI-compatible server (serve), "
               "a capacity model (plan), AWQ int4 packing (awq-pack), a timed demo (demo) and the "
               "embedded Gemma-3-270M (model).")


def __getattr__(name: str) -> Any:
    # kvboost_hf.cli.run_demo stays importable without importing torch for --help / --version.
    if name == "run_demo":
        from kvboost_hf.demo import run_demo

        return run_demo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to an option's help unless the help already states its default or
    the default is empty (None, False, ``[]``): those say in words what happens."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        empty = action.default is None or action.default is False or action.default in ((), [])
        if "default" in text or empty or action.default is argparse.SUPPRESS:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def package_version() -> str:
    """The installed version of kvboost_hf (importlib.metadata)."""
    try:
        return metadata.version("kvboost_hf")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def build_parser() -> Parser:
    """The parser of every subcommand (what ``--help`` prints)."""
    from kvboost_hf.planner.command import add_plan_arguments
    from kvboost_hf.server.command import add_serve_arguments
    from kvboost_hf.streaming.pack import add_awq_pack_arguments

    parser = Parser(prog="kvboost-hf", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> Parser:
        return sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)

    demo = command("demo", "questions over a document, each turn timed with and without reuse")
    demo.add_argument("--model", default=None,
                      help="HF model id or local model directory (default: the embedded Gemma-3-270M)")
    demo.add_argument("--max-new-tokens", type=int, default=24, help="reply length per turn, in tokens")
    command("model", "assemble and convert the embedded default model; print its path")
    add_serve_arguments(command("serve", "OpenAI-compatible HTTP server with cross-request reuse"))
    add_awq_pack_arguments(command("awq-pack", "write an AutoAWQ GEMM int4 checkpoint from a float model"))
    add_plan_arguments(command("plan", "capacity model: K/V per token, sequences that fit, decode roofline"))
    return parser


def _fail(command: str, message: str) -> int:
    print(f"kvboost-hf {command}: error: {message}", file=sys.stderr)
    return 2


def _check_plan(args: argparse.Namespace) -> None:
    """Flag checks of ``plan`` (FlagError); ``args.memory`` becomes bytes."""
    model_path_flag("--model", args.model)
    if args.memory is not None:
        args.memory = size_flag("--memory", args.memory)
    for flag, value in (("--context", args.context), ("--bandwidth", args.bandwidth)):
        if value is not None and value <= 0:
            raise FlagError(f"{flag} {value}: must be more than 0")
    if not 0 <= args.margin < 1:
        raise FlagError(f"--margin {args.margin}: a fraction of memory, from 0 up to (not including) 1")
    if args.shared_prefix < 0:
        raise FlagError(f"--shared-prefix {args.shared_prefix}: a number of tokens, 0 or more")


def _plan(args: argparse.Namespace) -> int:
    from kvboost_hf.planner.command import PlanError, plan_command

    try:
        _check_plan(args)
        print(plan_command(args))
    except (FlagError, PlanError) as err:
        return _fail("plan", str(err))
    return 0


def _awq_pack(args: argparse.Namespace) -> int:
    from kvboost_hf.streaming.pack import PackError, awq_pack_command

    try:
        print(awq_pack_command(args))
    except PackError as err:
        return _fail("awq-pack", str(err))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvboost_hf.server.command import ServeError
    from kvboost_hf.server.launch import serve

    logging.getLogger("kvboost_hf").setLevel(args.log_level.upper())
    from kvboost_hf.server.heap_pages import log_restart

    log_restart()
    try:
        if args.ray:
            from kvboost_hf.cluster.app import serve_on_ray

            return serve_on_ray(args)
        return serve(args)
    except ServeError as err:
        return _fail("serve", str(err))


def _model(args: argparse.Namespace) -> int:
    from kvboost_hf.models import default_model_path

    logging.getLogger("kvboost_hf").setLevel(logging.INFO)
    try:
        print(default_model_path())
    except ImportError as err:
        return _fail("model", f"{first_line(err)}; pip install 'kvboost_hf[model]'")
    return 0


def _demo(args: argparse.Namespace) -> int:
    try:
        model_path_flag("--model", args.model)
        if args.max_new_tokens < 1:
            raise FlagError(f"--max-new-tokens {args.max_new_tokens}: must be 1 or more")
    except FlagError as err:
        return _fail("demo", str(err))
    from kvboost_hf.demo import run_demo
    from kvboost_hf.models import load_model

    try:
        model, tokenizer = load_model(args.model)
    except (OSError, ValueError, ImportError) as err:
        return _fail("demo", f"{'--model ' + args.model if args.model else 'the embedded model'} does not load "
                             f"({first_line(err)})")
    print(f"model: {args.model or 'embedded Gemma-3-270M (base model)'}; greedy, same request timed twice per turn\n")
    rows = run_demo(model, tokenizer, max_new_tokens=args.max_new_tokens)
    ok = all(r["identical"] for r in rows)
    print(f"\noutputs identical with and without reuse on every turn: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


_COMMANDS = {"plan": _plan, "awq-pack": _awq_pack, "serve": _serve, "model": _model, "demo": _demo}


def main(argv: list[str] | None = None) -> int:
    """Run ``kvboost-hf`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status
    (0, or 2 for a bad flag; ``--help`` and ``--version`` print and return 0). As the command line itself
    (``argv`` None), ``serve`` first restarts the process with malloc's heap on huge pages where it can
    (:mod:`kvboost_hf.server.heap_pages`)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a one-line argparse error
        return done.code if isinstance(done.code, int) else 0
    if argv is None and args.command == "serve":
        from kvboost_hf.server.heap_pages import restart_with_huge_page_heap

        restart_with_huge_page_heap()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
