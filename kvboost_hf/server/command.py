"""``kvboost-hf serve``: its flags, the checks that need nothing slow, and the store they describe
(:mod:`.launch` loads the model, builds the app and runs it)."""

from __future__ import annotations

import argparse
import logging
import math
import os

from kvboost_hf.cli_checks import FlagError, model_path_flag, readable_file_flag, size_flag
from kvboost_hf.planner.probe import process_rss_bytes
from kvboost_hf.server.api.keys import KeyFileError, KeyRing
from kvboost_hf.server.settings import RECOMPUTE_STRATEGIES
from kvboost_hf.units import format_size

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"


def served_model_name(args: argparse.Namespace) -> str:
    """The name clients send as ``model``: ``--served-model-name``, else ``--model``, else the embedded model's."""
    return args.served_model_name or args.model or DEFAULT_MODEL_NAME


class ServeError(Exception):
    """A set-up problem to report on the command line (bad flag value, store refused its settings)."""


# (flag, attribute, what a bare number means: None = a unit is required)
SIZE_FLAGS = (("--max-cache-bytes", "max_cache_bytes", "B"), ("--memory-limit", "memory_limit", None),
              ("--max-body-size", "max_body_size", None), ("--grammar-cache", "grammar_cache", None))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvboost-hf serve`` (also ``python -m kvboost_hf.server``). Sizes stay strings here;
    :func:`check_serve_args` parses them."""
    parser.add_argument("--model", default=None,
                        help="HF model id or local model directory (default: the embedded Gemma-3-270M)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send as 'model' (default: --model, or gemma-3-270m)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address; the default serves this machine only")
    parser.add_argument("--port", type=int, default=8000, help="TCP port, 1-65535")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route")
    keys.add_argument("--api-keys", default=None, metavar="FILE",
                      help='tenants: a JSON file {"<key>": {"tenant": NAME, "store_bytes": N, "admin": BOOL}}; '
                           "each tenant's cache entries are its own; re-read on SIGHUP")
    store = parser.add_argument_group("chunk store")
    store.add_argument("--max-cache-bytes", default="2GB", metavar="SIZE",
                       help="store budget in RAM: a size such as 2GB or 1.5GiB, or a number of bytes")
    store.add_argument("--chunk-size", type=int, default=128, help="tokens per stored chunk")
    store.add_argument("--kv-bits", choices=["none", "8", "4"], default="none",
                       help="quantize stored K/V to int8 / int4 (none: keep the model's dtype)")
    store.add_argument("--disk-path", default=None, help="directory of a persistent disk tier for the store")
    store.add_argument("--remote-store", default=None, metavar="URL",
                       help="Redis URL of a tier shared by replicas (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS)")
    store.add_argument("--remote-prefix", default="kvboost",
                       help="key prefix in the shared tier; replicas of one model deployment use the same")
    store.add_argument("--recompute-strategy", choices=list(RECOMPUTE_STRATEGIES), default="exact",
                       help="exact: prefix reuse only (token-identical); none / selective / cacheblend: also reuse "
                            "moved chunks, repaired (approximate)")
    store.add_argument("--no-reuse", action="store_true", help="serve without cross-request reuse (for comparisons)")
    store.add_argument("--warm", action="append", default=[], metavar="TEXT",
                       help="store this text's K/V at start-up (tokenized like a completion prompt); repeatable")
    store.add_argument("--warm-file", action="append", default=[], metavar="PATH",
                       help="store a text file's K/V at start-up, with a progress bar; repeatable")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="refuse longer prompts with 413 (default: the model's context)")
    limits.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait behind the running ones; more get 503")
    limits.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                        help="seconds a request may take, queueing included; then 504")
    limits.add_argument("--default-max-tokens", type=int, default=256,
                        help="reply length for chat requests that set no max_tokens")
    limits.add_argument("--memory-limit", default=None, metavar="SIZE",
                        help="memory requests may use, with a unit: 20GiB, 512MiB, 2.5g (default: CUDA free memory, "
                             "or the cgroup limit / physical memory); must exceed what the process holds with the "
                             "model loaded; requests predicted not to fit get 413")
    limits.add_argument("--auto-truncate", action="store_true",
                        help="instead of 413, keep the longest prompt prefix that fits (header X-Kvboost-Truncated-From)")
    limits.add_argument("--kv-bits-fallback", type=int, nargs="+", choices=[8, 4], default=(), metavar="BITS",
                        help="when a request fits no full-precision plan, run it with its live K/V quantized to "
                             "these bits (8 and/or 4; approximate, no reuse; header X-Kvboost-KV-Bits) instead of 413")
    limits.add_argument("--no-memory-planning", action="store_true", help="admit every request without a memory plan")
    limits.add_argument("--max-body-size", default="4MiB", metavar="SIZE",
                        help="largest request body on /v1 and the tokenizer routes, with a unit; larger get 413")
    limits.add_argument("--grammar-cache", default="512MiB", metavar="SIZE",
                        help="memory for compiled JSON-schema grammars, with a unit; least recently used evicted")
    limits.add_argument("--grammar-compile-timeout", type=float, default=5.0, metavar="S",
                        help="refuse (400) a JSON schema whose grammar takes longer to compile")
    limits.add_argument("--grammar-compile-slots", type=int, default=2, metavar="N",
                        help="grammar compiles running at once; a request that finds none free within the "
                             "timeout gets 503")
    limits.add_argument("--scheduler", choices=["batch", "workers"], default=None,
                        help="batch: continuous batching, every running request decoded in one forward per step "
                             "(the default); workers: one model.generate per worker thread (the default with --draft)")
    limits.add_argument("--max-batch-size", type=int, default=32,
                        help="--scheduler batch: requests running at once (decoding or prefilling)")
    limits.add_argument("--max-batched-tokens", type=int, default=160,
                        help="--scheduler batch: tokens forwarded per step, one per decoding request and the rest "
                             "prompt chunks; bounds how long a long prompt delays running streams")
    limits.add_argument("--workers", type=int, default=None,
                        help="--scheduler workers: requests generated at once, one model.generate each "
                             "(default: the CPU cores // torch threads per worker)")
    limits.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads per forward, process wide (default: $OMP_NUM_THREADS when set; "
                             "else on CPU every core with --scheduler batch, cores // --workers with --scheduler "
                             "workers)")
    awq = parser.add_argument_group("AWQ layer streaming (--model must be an AutoAWQ GEMM checkpoint)")
    awq.add_argument("--awq-streaming", default=None,
                     choices=["full_resident", "partial_resident", "ffn_only_stream", "full_stream"],
                     help="load --model with StreamingAWQConfig in this residency mode (default: plain float load)")
    awq.add_argument("--keep-first-k", type=int, default=2, help="resident first decoder layers")
    awq.add_argument("--keep-last-k", type=int, default=2, help="resident last decoder layers")
    awq.add_argument("--staging-slots", type=int, default=2, help="streamed layers materialised at once")
    awq.add_argument("--awq-host", choices=["ram", "mmap"], default="ram",
                     help="where streamed weights live: host RAM, or a converted file mapped from disk")
    awq.add_argument("--awq-kernel", choices=["auto", "kvboost", "torch"], default="auto",
                     help="int4 GEMM: this package's CPU kernels (docs/kernels.md), torch's int4 op, or auto "
                          "(kvboost on CPU when its kernels are built)")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--draft", default=None, metavar="int4|int8|head|prompt-lookup|store|PATH",
                      help="draft for every request (greedy and sampling): a self-draft of the model (int4 / int8), "
                           "a head draft (the model's own layers with an int8 head; verification runs only the "
                           "model's head), prompt lookup, store-wide n-gram drafts, or an assistant model sharing "
                           "the tokenizer")
    spec.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                      help="self-draft / head-draft LM head restricted to the N most frequent tokens (FR-Spec); "
                           "--draft head defaults to 16384 where the vocabulary is larger")
    spec.add_argument("--draft-layers", type=int, default=None, metavar="N",
                      help="self-draft keeps the first N decoder layers")
    ray = parser.add_argument_group("Ray Serve (pip install 'kvboost_hf[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve as a Ray Serve application of --replicas model replicas "
                          "(local Ray unless --ray-address)")
    ray.add_argument("--replicas", type=int, default=None, help="--ray: model replicas (default 1)")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="--ray: join this Ray cluster (e.g. auto, ray://head:10001) instead of starting one")
    ray.add_argument("--cpus-per-replica", type=float, default=None,
                     help="--ray: CPUs Ray reserves per replica, also its torch threads (default 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="--ray: autoscale down to this many replicas")
    ray.add_argument("--max-replicas", type=int, default=None, help="--ray: autoscale up to this many replicas")
    ray.add_argument("--router", choices=["prefix", "pow2"], default=None,
                     help="--ray: prefix (default): to the replica whose store holds the longest prefix of the "
                          "prompt's chunks; pow2: Ray Serve's power of two choices")
    ray.add_argument("--router-imbalance", type=int, default=None, metavar="N",
                     help="--ray --router prefix: a holder more than N requests busier than the least busy "
                          "replica loses its turn (default 4)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log level of kvboost_hf and uvicorn")


def serve_sizes(args: argparse.Namespace) -> dict[str, int | None]:
    """Bytes of every size flag by attribute name (None when unset). Raises ServeError naming the flag."""
    try:
        return {name: None if getattr(args, name, None) is None else size_flag(flag, getattr(args, name), bare)
                for flag, name, bare in SIZE_FLAGS}
    except FlagError as err:
        raise ServeError(str(err)) from None


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a thread count (its first level when nested, ``4,2``); None when unset."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ServeError(f"OMP_NUM_THREADS={raw}: not a positive whole number; set e.g. OMP_NUM_THREADS=4, "
                         "unset it, or pass --torch-threads N")
    return int(first)


def check_serve_args(args: argparse.Namespace) -> None:
    """Every check that needs no store, model or server import: sizes, paths, ranges, flags that
    contradict each other, ``OMP_NUM_THREADS``, ``--memory-limit`` against what the process holds
    now. Raises ServeError with a one-line message that says what to change."""
    sizes = serve_sizes(args)
    omp_threads()
    draft = getattr(args, "draft", None)
    try:
        model_path_flag("--model", args.model)
        for name in args.warm_file:
            readable_file_flag("--warm-file", name)
        if draft is not None:
            from kvboost_hf.server.engine.speculation import DRAFT_CHOICES

            if draft not in DRAFT_CHOICES:  # an assistant model's directory or id
                model_path_flag("--draft", draft)
        if getattr(args, "api_keys", None) is not None:
            KeyRing(args.api_keys)  # a malformed file stops the start here, before the model loads
    except (FlagError, KeyFileError) as err:
        raise ServeError(str(err)) from None
    if not 1 <= args.port <= 65535:
        raise ServeError(f"--port {args.port}: use a port from 1 to 65535")
    for flag, value in (("--torch-threads", args.torch_threads), ("--workers", args.workers)):
        if value is not None and value < 1:
            raise ServeError(f"{flag} {value}: must be 1 or more")
    if getattr(args, "awq_streaming", None) is not None and args.model is None:
        raise ServeError("--awq-streaming needs --model PATH of an AutoAWQ GEMM checkpoint (see kvboost-hf awq-pack)")
    if args.no_reuse and (args.warm or args.warm_file):
        raise ServeError("--warm / --warm-file need reuse; drop --no-reuse")
    if args.no_reuse and draft:
        raise ServeError("--draft needs reuse (the draft's prefill is reused too); drop --no-reuse")
    if draft and args.scheduler == "batch":
        raise ServeError("--draft runs with --scheduler workers (speculation inside a batched step is not built); "
                         "drop --scheduler batch")
    if args.draft_vocab is not None and draft not in ("int4", "int8", "head"):
        raise ServeError("--draft-vocab shapes a draft's head: add --draft int4, int8 or head")
    if args.draft_layers is not None and draft not in ("int4", "int8"):
        raise ServeError("--draft-layers shapes a self-draft: add --draft int4 or --draft int8")
    if args.no_memory_planning:
        unused = [flag for flag, on in (("--memory-limit", args.memory_limit is not None),
                                        ("--auto-truncate", args.auto_truncate),
                                        ("--kv-bits-fallback", bool(args.kv_bits_fallback))) if on]
        if unused:
            raise ServeError(f"{' / '.join(unused)}: only the memory planner uses them; drop --no-memory-planning "
                             "or drop them")
    check_ray_flags(args)
    if getattr(args, "awq_streaming", None) is None:  # a plain load stays on the CPU: RSS is what the limit bounds
        check_memory_limit(sizes["memory_limit"], "before loading the model")


RAY_DEFAULTS = {"replicas": 1, "cpus_per_replica": 1.0, "router": "prefix", "router_imbalance": 4}
_RAY_ONLY = {"ray_address": "--ray-address", "min_replicas": "--min-replicas", "max_replicas": "--max-replicas",
             **{name: "--" + name.replace("_", "-") for name in RAY_DEFAULTS}}


def check_ray_flags(args: argparse.Namespace) -> None:
    """The ``--ray`` flags: refused without ``--ray``; with it, defaults filled in and ranges checked."""
    if not getattr(args, "ray", False):
        used = [flag for name, flag in _RAY_ONLY.items() if getattr(args, name, None) is not None]
        if used:
            raise ServeError(f"{' / '.join(used)} only apply with --ray: add --ray or drop them")
        return
    for name, default in RAY_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.replicas < 1:
        raise ServeError(f"--replicas {args.replicas}: must be 1 or more")
    if args.cpus_per_replica <= 0:
        raise ServeError(f"--cpus-per-replica {args.cpus_per_replica}: must be more than 0")
    low, high = args.min_replicas, args.max_replicas
    if (low is not None and low < 0) or (high is not None and high < 1):
        raise ServeError("--min-replicas must be 0 or more and --max-replicas 1 or more")
    if low is not None and high is not None and low > high:
        raise ServeError(f"--min-replicas {low} is more than --max-replicas {high}")
    if args.router_imbalance < 0:
        raise ServeError(f"--router-imbalance {args.router_imbalance}: must be 0 or more")


def check_memory_limit(limit: int | None, when: str) -> None:
    """ServeError when ``limit`` bytes are not more than this process's resident memory now: the planner
    would have nothing to plan into (it used to fall back to 256 MiB silently)."""
    held = process_rss_bytes()
    if limit is None or not held or limit > held:
        return
    raise ServeError(f"--memory-limit {format_size(limit)} is not more than the {format_size(held)} this process "
                     f"holds {when}; requests are planned into what is left above it: pass more, e.g. "
                     f"--memory-limit {math.ceil(held / 2**30) + 1}GiB")


def build_store(args: argparse.Namespace):
    """The ChunkStore the flags describe; only flags the user set are passed. Raises ServeError."""
    from kvboost_hf.store import ChunkStore
    from kvboost_hf.store.remote_guard import redact

    try:
        max_bytes = size_flag("--max-cache-bytes", args.max_cache_bytes, bare_unit="B")
    except FlagError as err:
        raise ServeError(str(err)) from None
    kwargs: dict = {"max_bytes": max_bytes, "chunk_size": args.chunk_size}
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


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def scheduler_of(args: argparse.Namespace) -> str:
    """``--scheduler``, or its default: ``batch``, except with ``--draft`` (speculation runs per request)."""
    return getattr(args, "scheduler", None) or ("workers" if getattr(args, "draft", None) else "batch")


def worker_settings(args: argparse.Namespace, device: str) -> dict:
    """``workers`` and ``torch_threads``. Threads per forward: ``--torch-threads``, else ``OMP_NUM_THREADS``,
    else on CPU every core for the batch scheduler (one thread runs the batch) or ``cores // workers``
    (one worker per core, one thread each: measured best). Workers default to ``cores // threads``."""
    cores = available_cores()
    threads = args.torch_threads if args.torch_threads is not None else omp_threads()
    if scheduler_of(args) == "batch":
        return {"workers": 1, "torch_threads": threads or (cores if device == "cpu" else None)}
    if device != "cpu":
        return {"workers": args.workers or 1, "torch_threads": threads}
    workers = args.workers or max(1, cores // (threads or 1))
    return {"workers": workers, "torch_threads": threads or max(1, cores // workers)}


