"""``kvboost-hf serve`` past its flag checks: load the model, build the app, warm the store, run uvicorn.

:func:`build_app` is what one process serves, and what each Ray Serve replica runs
(:mod:`kvboost_hf.cluster`); :func:`serve` runs it under uvicorn.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

from kvboost_hf.cli_checks import first_line
from kvboost_hf.server.command import (
    ServeError,
    build_store,
    check_memory_limit,
    check_serve_args,
    omp_threads,
    scheduler_of,
    serve_sizes,
    served_model_name,
    worker_settings,
)

logger = logging.getLogger(__name__)

WARM_BLOCK_TOKENS = 512  # tokens forwarded per step when warming a file (one progress-bar step)

# ServerSettings fields named in its ValueErrors, and the flags that set them.
_SETTING_FLAGS = {"max_prompt_tokens": "--max-prompt-tokens", "default_max_tokens": "--default-max-tokens",
                  "torch_threads": "--torch-threads", "grammar_compile_slots": "--grammar-compile-slots",
                  "workers": "--workers", "max_queue": "--max-queue", "request_timeout": "--request-timeout",
                  "grammar_compile_timeout": "--grammar-compile-timeout", "max_batch_size": "--max-batch-size",
                  "max_batched_tokens": "--max-batched-tokens"}


def warm_texts(
    model, tokenizer, store, texts: list[str], files: list[str], limit: int | None,
    block_tokens: int = WARM_BLOCK_TOKENS, scope=None,
) -> int:
    """Store the K/V of each text and each file (under ``scope``: with tenants, the shared one every
    tenant reads); returns the tokens warmed. Raises ServeError.

    A long text is forwarded ``block_tokens`` at a time (rounded to whole chunks), each step
    loading what the previous one stored, with a tqdm progress bar over the blocks.
    """
    from tqdm.auto import tqdm

    from kvboost_hf.generation.warm import warm

    total = 0
    sources = [(f"--warm #{i + 1}", text) for i, text in enumerate(texts)]
    for name in files:
        path = Path(name)
        try:
            sources.append((str(path), path.read_text(encoding="utf-8")))
        except OSError as err:
            raise ServeError(f"cannot read --warm-file {name}: {err}") from err
    for name, text in sources:
        ids = tokenizer(text)["input_ids"]
        if not text.strip() or not ids:
            raise ServeError(f"{name} is empty")
        if limit is not None and len(ids) > limit:
            raise ServeError(f"{name} has {len(ids)} tokens, more than the prompt limit of {limit}")
        # Growing prefixes: each step loads what the previous one stored and forwards one block.
        block = max(block_tokens // store.chunk_size, 1) * store.chunk_size
        ends = list(range(block, len(ids), block)) + [len(ids)]
        for end in tqdm(ends, desc=f"warming {name}", unit="block", disable=len(ends) < 2):
            warm(model, ids[:end], store, cache_salt=scope)
        logger.info("warmed %s: %d tokens", name, len(ids))
        total += len(ids)
    return total


def load_served_model(args: argparse.Namespace):
    """``(model, tokenizer)``: a plain load, or an AWQ-streamed one with ``--awq-streaming``. Raises ServeError."""
    from kvboost_hf.models import load_model
    from kvboost_hf.models.huge_pages import back_with_huge_pages

    if getattr(args, "awq_streaming", None) is None:
        try:
            model, tokenizer = load_model(args.model)
        except (OSError, ValueError) as err:  # not a model directory, an id not on the hub or offline, bad config
            what = f"--model {args.model}" if args.model else "the embedded model"
            raise ServeError(f"{what} does not load ({first_line(err)}); pass a local model directory "
                             "or a Hugging Face model id") from err
        back_with_huge_pages(model)  # a server decodes for long: weights read faster (CPU tensors only)
        return model, tokenizer
    if args.model is None:
        raise ServeError("--awq-streaming needs --model PATH of an AutoAWQ GEMM checkpoint (see kvboost-hf awq-pack)")
    from kvboost_hf.streaming import StreamingAWQConfig, load_awq_model

    try:
        config = StreamingAWQConfig(residency_mode=args.awq_streaming, keep_first_k=args.keep_first_k,
                                    keep_last_k=args.keep_last_k, n_staging_slots=args.staging_slots,
                                    host=args.awq_host, kernel=getattr(args, "awq_kernel", "auto"))
        return load_awq_model(args.model, config)
    except (ValueError, RuntimeError) as err:  # RuntimeError: --awq-kernel kvboost without built kernels
        raise ServeError(f"--awq-streaming: {err}") from err


def _flag_names(message: str) -> str:
    """A ServerSettings error in terms of the flags that set the fields it names."""
    for field, flag in _SETTING_FLAGS.items():
        message = re.sub(rf"(?<![\w'-]){field}(?![\w'])", flag, message)
    return message


def build_app(args: argparse.Namespace, torch_threads: int | None = None):
    """Check the flags, build the store and settings, load the model, build the app and warm the store:
    the app one ``kvboost-hf serve`` process runs (not started: its lifespan starts the scheduler).
    ``torch_threads`` overrides the thread default (a Ray replica gets its CPUs). Every set-up problem
    is a ServeError, raised before the slow steps it would otherwise follow."""
    check_serve_args(args)
    _schedule_for_rope(args)
    sizes = serve_sizes(args)
    try:
        from kvboost_hf.server.routes.app import context_length, create_app
        from kvboost_hf.server.settings import ServerSettings
    except ImportError as err:
        raise ServeError(f"the server needs its extra: pip install 'kvboost_hf[server]' ({err})") from err

    store = build_store(args)
    model_device = "cpu"  # load_model keeps the model on the CPU
    threads = worker_settings(args, model_device)
    if torch_threads is not None and args.torch_threads is None:
        threads["torch_threads"] = torch_threads
    try:
        settings = ServerSettings(
            model_name=served_model_name(args),
            api_key=args.api_key,
            api_keys_file=getattr(args, "api_keys", None),
            reuse=not args.no_reuse,
            max_prompt_tokens=args.max_prompt_tokens,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout,
            default_max_tokens=args.default_max_tokens,
            recompute_strategy=args.recompute_strategy,
            plan_memory=not args.no_memory_planning,
            memory_limit=sizes["memory_limit"],
            auto_truncate=args.auto_truncate,
            kv_bits_fallback=tuple(args.kv_bits_fallback),
            scheduler=scheduler_of(args),
            max_batch_size=args.max_batch_size,
            max_batched_tokens=args.max_batched_tokens,
            max_body_bytes=sizes["max_body_size"],
            grammar_cache_bytes=sizes["grammar_cache"],
            grammar_compile_timeout=args.grammar_compile_timeout,
            grammar_compile_slots=args.grammar_compile_slots,
            **threads,
        )
    except ValueError as err:
        raise ServeError(_flag_names(str(err))) from err
    source = ("--torch-threads" if args.torch_threads else "OMP_NUM_THREADS" if omp_threads() else "default")
    logger.info("scheduler %s, %d worker(s), torch threads %s (%s)", settings.scheduler, settings.workers,
                settings.torch_threads or "unchanged", source)
    logger.info("loading %s", args.model or "the embedded Gemma-3-270M")
    model, tokenizer = load_served_model(args)
    if next(model.parameters()).device.type == "cpu":
        check_memory_limit(sizes["memory_limit"], "with the model loaded")
    try:
        app = create_app(model, tokenizer, store, settings)
        if args.draft:
            from kvboost_hf.server.engine.speculation import attach_speculation, build_draft

            attach_speculation(app, model, build_draft(args.draft, model, tokenizer, args.draft_vocab,
                                                       args.draft_layers))
    except (ValueError, TypeError) as err:
        raise ServeError(str(err)) from err
    if args.warm or args.warm_file:
        limits = [v for v in (context_length(model), args.max_prompt_tokens) if v is not None]
        warm_texts(model, tokenizer, store, args.warm, args.warm_file, min(limits) if limits else None,
                   scope=app.state.tenancy.startup_scope())
    return app


def _schedule_for_rope(args: argparse.Namespace) -> None:
    """``--scheduler batch`` forwards the rows of many requests at once, and a RoPE whose frequencies depend on a
    forward's longest position (:func:`~kvboost_hf.models.rope.length_dependent_rope`) would rotate each row by
    the longest row's: such a model is served by the workers scheduler (one ``generate`` a request, the reply
    plain ``generate`` gives), by default, and an explicit ``--scheduler batch`` is refused."""
    if args.model is None or scheduler_of(args) != "batch":
        return
    from transformers import AutoConfig

    from kvboost_hf.models.rope import length_dependent_rope

    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError):
        return  # loading the model says what is wrong
    rope = length_dependent_rope(config)
    if rope is None:
        return
    if args.scheduler == "batch":
        raise ServeError(f"--scheduler batch: the model's rope_type {rope!r} rotates each row of a batched forward "
                         "by the longest row's positions, so replies would differ from generate's: use "
                         "--scheduler workers")
    logger.info("rope_type %r rotates by a forward's longest position: serving with --scheduler workers", rope)
    args.scheduler = "workers"


def serve(args: argparse.Namespace) -> int:
    """:func:`build_app`, then uvicorn until interrupted (``SIGHUP`` re-reads ``--api-keys``)."""
    try:
        import uvicorn
    except ImportError as err:
        raise ServeError(f"the server needs its extra: pip install 'kvboost_hf[server]' ({err})") from err
    from kvboost_hf.server.routes.tenancy import reload_on_sighup

    app = build_app(args)
    settings = app.state.settings
    if settings.api_keys_file:
        reload_on_sighup(app.state.tenancy)
    print(f"serving {settings.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
