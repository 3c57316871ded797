"""``kvboost-hf serve``: flags, model and store set-up, start-up warming, uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..planner.probe import parse_bytes
from .settings import RECOMPUTE_STRATEGIES

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"
WARM_BLOCK_TOKENS = 512  # tokens forwarded per step when warming a file (one progress-bar step)


class ServeError(Exception):
    """A set-up problem to report on the command line (bad flag value, store refused its settings)."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvboost-hf serve`` (also ``python -m kvboost_hf.server``)."""
    parser.add_argument("--model", default=None, help="HF model id or local path (default: embedded Gemma-3-270M)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send as 'model' (default: --model, or gemma-3-270m)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    store = parser.add_argument_group("chunk store")
    store.add_argument("--max-cache-bytes", type=int, default=2_000_000_000, help="store budget in bytes (RAM)")
    store.add_argument("--chunk-size", type=int, default=128, help="tokens per stored chunk")
    store.add_argument("--kv-bits", choices=["none", "8", "4"], default="none",
                       help="quantize stored K/V to int8 / int4 (default: keep the model's dtype)")
    store.add_argument("--disk-path", default=None, help="directory of a persistent disk tier for the store")
    store.add_argument("--remote-store", default=None, metavar="URL",
                       help="Redis URL of a tier shared by replicas (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS)")
    store.add_argument("--remote-prefix", default="kvboost",
                       help="key prefix in the shared tier; replicas of one model deployment use the same (default kvboost)")
    store.add_argument("--recompute-strategy", choices=list(RECOMPUTE_STRATEGIES), default="exact",
                       help="exact: prefix reuse only (default, token-identical); none / selective / cacheblend: also reuse moved chunks, repaired (approximate)")
    store.add_argument("--no-reuse", action="store_true", help="serve without cross-request reuse (for comparisons)")
    store.add_argument("--warm", action="append", default=[], metavar="TEXT",
                       help="store this text's K/V at start-up (tokenized like a completion prompt); repeatable")
    store.add_argument("--warm-file", action="append", default=[], metavar="PATH",
                       help="store a text file's K/V at start-up, with a progress bar; repeatable")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="refuse longer prompts with 413 (default: the model's context)")
    limits.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait behind the running one; more get 503 (default 64)")
    limits.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may take, queueing included; then 504 (default 600)")
    limits.add_argument("--default-max-tokens", type=int, default=256,
                        help="reply length for chat requests that set no max_tokens (default 256)")
    limits.add_argument("--memory-limit", default=None, metavar="SIZE",
                        help="memory requests may use, e.g. 20GiB (default: CUDA free memory, or the cgroup limit / "
                             "physical memory); requests predicted not to fit get 413")
    limits.add_argument("--auto-truncate", action="store_true",
                        help="instead of 413, keep the longest prompt prefix that fits (header X-Kvboost-Truncated-From)")
    limits.add_argument("--kv-bits-fallback", type=int, nargs="+", choices=[8, 4], default=(), metavar="BITS",
                        help="when a request fits no full-precision plan, run it with its live K/V quantized to "
                             "these bits (8 and/or 4; approximate, no reuse; header X-Kvboost-KV-Bits) instead of 413")
    limits.add_argument("--no-memory-planning", action="store_true", help="admit every request without a memory plan")
    limits.add_argument("--max-body-size", default="4MiB", metavar="SIZE",
                        help="largest request body on /v1 and the tokenizer routes; larger get 413 (default 4MiB)")
    limits.add_argument("--grammar-cache", default="512MiB", metavar="SIZE",
                        help="memory for compiled JSON-schema grammars, least recently used evicted (default 512MiB)")
    limits.add_argument("--grammar-compile-timeout", type=float, default=5.0, metavar="S",
                        help="refuse (400) a JSON schema whose grammar takes longer to compile (default 5)")
    limits.add_argument("--grammar-compile-slots", type=int, default=2, metavar="N",
                        help="grammar compiles running at once; a request that finds none free within the "
                             "timeout gets 503 (default 2)")
    limits.add_argument("--scheduler", choices=["batch", "workers"], default=None,
                        help="batch: continuous batching, every running request decoded in one forward per step "
                             "(default); workers: one model.generate per worker thread (the default with --draft)")
    limits.add_argument("--max-batch-size", type=int, default=32,
                        help="--scheduler batch: requests running at once (decoding or prefilling; default 32)")
    limits.add_argument("--max-batched-tokens", type=int, default=160,
                        help="--scheduler batch: tokens forwarded per step, one per decoding request and the rest "
                             "prompt chunks; bounds how long a long prompt delays running streams (default 160)")
    limits.add_argument("--workers", type=int, default=None,
                        help="--scheduler workers: requests generated at once, one model.generate each "
                             "(default: the CPU cores)")
    limits.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads (default on CPU: cores // workers, i.e. 1 per worker)")
    awq = parser.add_argument_group("AWQ layer streaming (--model must be an AutoAWQ GEMM checkpoint)")
    awq.add_argument("--awq-streaming", default=None,
                     choices=["full_resident", "partial_resident", "ffn_only_stream", "full_stream"],
                     help="load --model with StreamingAWQConfig in this residency mode (default: plain float load)")
    awq.add_argument("--keep-first-k", type=int, default=2, help="resident first decoder layers (default 2)")
    awq.add_argument("--keep-last-k", type=int, default=2, help="resident last decoder layers (default 2)")
    awq.add_argument("--staging-slots", type=int, default=2, help="streamed layers materialised at once (default 2)")
    awq.add_argument("--awq-host", choices=["ram", "mmap"], default="ram",
                     help="where streamed weights live: host RAM, or a converted file mapped from disk")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--draft", default=None, metavar="int4|int8|prompt-lookup|store|PATH",
                      help="draft for every request (greedy and sampling): a self-draft of the model (int4 / int8), "
                           "prompt lookup, store-wide n-gram drafts, or an assistant model sharing the tokenizer")
    spec.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                      help="self-draft LM head restricted to the N most frequent tokens (FR-Spec)")
    spec.add_argument("--draft-layers", type=int, default=None, metavar="N",
                      help="self-draft keeps the first N decoder layers")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_store(args: argparse.Namespace):
    """The ChunkStore the flags describe; only flags the user set are passed. Raises ServeError."""
    from ..store import ChunkStore
    from ..store.remote import redact

    kwargs: dict = {"max_bytes": args.max_cache_bytes, "chunk_size": args.chunk_size}
    if args.kv_bits != "none":
        kwargs["kv_bits"] = int(args.kv_bits)
    if args.disk_path:
        kwargs["disk_path"] = args.disk_path
    if getattr(args, "remote_store", None):
        kwargs["remote"], kwargs["remote_prefix"] = args.remote_store, args.remote_prefix
    try:
        return ChunkStore(**kwargs)
    except ImportError as err:
        raise ServeError(f"--remote-store needs the Redis client: pip install 'kvboost_hf[redis]' ({err})") from err
    except (TypeError, ValueError) as err:
        flags = ", ".join(f"{k}={redact(v) if k == 'remote' else v!r}" for k, v in kwargs.items())
        raise ServeError(f"the chunk store refused its settings ({flags}): {err}") from err


def warm_texts(
    model, tokenizer, store, texts: list[str], files: list[str], limit: int | None,
    block_tokens: int = WARM_BLOCK_TOKENS,
) -> int:
    """Store the K/V of each text and each file; returns the tokens warmed. Raises ServeError.

    A long text is forwarded ``block_tokens`` at a time (rounded to whole chunks), each step
    loading what the previous one stored, with a tqdm progress bar over the blocks.
    """
    from tqdm.auto import tqdm

    from ..warm import warm

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
            warm(model, ids[:end], store)
        logger.info("warmed %s: %d tokens", name, len(ids))
        total += len(ids)
    return total


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def scheduler_of(args: argparse.Namespace) -> str:
    """``--scheduler``, or its default: ``batch``, except with ``--draft`` (speculation runs per request)."""
    return getattr(args, "scheduler", None) or ("workers" if getattr(args, "draft", None) else "batch")


def worker_settings(args: argparse.Namespace, device: str) -> dict:
    """``workers`` and ``torch_threads``: on CPU one worker per core, one torch thread each (measured best);
    the batch scheduler has one thread, with every core."""
    cores = available_cores()
    if scheduler_of(args) == "batch":
        return {"workers": 1, "torch_threads": args.torch_threads or (cores if device == "cpu" else None)}
    workers = args.workers or (cores if device == "cpu" else 1)
    threads = args.torch_threads or (max(1, cores // workers) if device == "cpu" else None)
    return {"workers": workers, "torch_threads": threads}


def load_served_model(args: argparse.Namespace):
    """``(model, tokenizer)``: a plain load, or an AWQ-streamed one with ``--awq-streaming``. Raises ServeError."""
    from ..models import load_model

    if getattr(args, "awq_streaming", None) is None:
        return load_model(args.model)
    if args.model is None:
        raise ServeError("--awq-streaming needs --model PATH of an AutoAWQ GEMM checkpoint (see kvboost-hf awq-pack)")
    from ..streaming import StreamingAWQConfig, load_awq_model

    try:
        config = StreamingAWQConfig(residency_mode=args.awq_streaming, keep_first_k=args.keep_first_k,
                                    keep_last_k=args.keep_last_k, n_staging_slots=args.staging_slots,
                                    host=args.awq_host)
        return load_awq_model(args.model, config)
    except ValueError as err:
        raise ServeError(f"--awq-streaming: {err}") from err


def serve(args: argparse.Namespace) -> int:
    """Load the model, build the store and app, warm, and run uvicorn until interrupted."""
    try:
        import uvicorn

        from .app import context_length, create_app
        from .settings import ServerSettings
    except ImportError as err:
        raise ServeError(f"the server needs its extra: pip install 'kvboost_hf[server]' ({err})") from err

    store = build_store(args)
    model_device = "cpu"  # load_model keeps the model on the CPU
    if args.no_reuse and (args.warm or args.warm_file):
        raise ServeError("--warm / --warm-file need reuse; drop --no-reuse")
    if args.no_reuse and args.draft:
        raise ServeError("--draft needs reuse (the draft's prefill is reused too); drop --no-reuse")
    if args.draft and args.scheduler == "batch":
        raise ServeError("--draft runs with --scheduler workers (speculation inside a batched step is not built); "
                         "drop --scheduler batch")
    try:
        settings = ServerSettings(
            model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME,
            api_key=args.api_key,
            reuse=not args.no_reuse,
            max_prompt_tokens=args.max_prompt_tokens,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout,
            default_max_tokens=args.default_max_tokens,
            recompute_strategy=args.recompute_strategy,
            plan_memory=not args.no_memory_planning,
            memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None,
            auto_truncate=args.auto_truncate,
            kv_bits_fallback=tuple(args.kv_bits_fallback),
            scheduler=scheduler_of(args),
            max_batch_size=args.max_batch_size,
            max_batched_tokens=args.max_batched_tokens,
            max_body_bytes=parse_bytes(args.max_body_size),
            grammar_cache_bytes=parse_bytes(args.grammar_cache),
            grammar_compile_timeout=args.grammar_compile_timeout,
            grammar_compile_slots=args.grammar_compile_slots,
            **worker_settings(args, model_device),
        )
    except ValueError as err:
        raise ServeError(str(err)) from err
    logger.info("loading %s", args.model or "the embedded Gemma-3-270M")
    model, tokenizer = load_served_model(args)
    try:
        app = create_app(model, tokenizer, store, settings)
        if args.draft:
            from .speculation import attach_speculation, build_draft

            attach_speculation(app, model, build_draft(args.draft, model, tokenizer, args.draft_vocab,
                                                       args.draft_layers))
    except (ValueError, TypeError) as err:
        raise ServeError(str(err)) from err
    if args.warm or args.warm_file:
        limits = [v for v in (context_length(model), args.max_prompt_tokens) if v is not None]
        warm_texts(model, tokenizer, store, args.warm, args.warm_file, min(limits) if limits else None)
    print(f"serving {settings.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
