"""``kvboost-hf plan``: print the capacity model of a model on this (or a described) machine."""

from __future__ import annotations

import argparse
import statistics
import time

from kvboost_hf.cli_checks import first_line
from kvboost_hf.models.shape import ModelShape
from kvboost_hf.planner.capacity import CapacityReport, capacity, checkpoint_weight_bytes
from kvboost_hf.planner.probe import memory_bandwidth_gb_s, memory_limit_bytes, parse_bytes


class PlanError(ValueError):
    """``plan`` cannot read what it was pointed at; the CLI prints the message as one line and exits 2."""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local model directory or HF id in the local cache (default: the embedded Gemma-3-270M)")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="dtype the model runs in (default: the config's)")
    parser.add_argument("--kv-bits", choices=["none", "8", "4"], default="none",
                        help="store precision to size the chunk store with (live K/V stay in --dtype)")
    parser.add_argument("--memory", default=None, metavar="SIZE",
                        help="memory for weights + K/V, with a unit: 24GiB, 24GB, 512MiB, 2.5g "
                             "(default: this machine's cgroup limit or physical memory)")
    parser.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                        help="memory bandwidth in GB/s (default: measured here in ~2 s)")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every sequence shares (a system prompt)")
    parser.add_argument("--margin", type=float, default=0.10, help="fraction of memory kept free")
    parser.add_argument("--measure", action="store_true",
                        help="also load the model and measure stored bytes per token and one decode step")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def model_shape(model: str | None, dtype: str | None) -> tuple[ModelShape, str]:
    """The shape of ``model`` (a local path, or the embedded default) and where it was read from."""
    from transformers import AutoConfig

    from kvboost_hf.models import default_model_path

    try:
        path = str(default_model_path()) if model is None else model
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, ImportError) as err:  # no config.json, an id not cached, the model extra missing
        raise PlanError(f"--model {model or '(embedded default)'}: cannot read its config ({first_line(err)})") from err
    shape = ModelShape.from_config(config, dtype)
    exact = checkpoint_weight_bytes(path, shape.dtype_bytes)
    return ModelShape.from_config(config, dtype, weight_bytes=exact), path


def measure(model_name: str | None, dtype: str | None, report: CapacityReport, steps: int = 8) -> dict:
    """Stored bytes per token (from a real ChunkStore) and decode step time, on this machine."""
    import torch

    from kvboost_hf.generation import warm
    from kvboost_hf.models import load_model
    from kvboost_hf.store import ChunkStore

    model, tokenizer = load_model(model_name)
    if dtype:
        model = model.to(getattr(torch, dtype))
    context = min(report.context, 512)
    ids = torch.randint(10, tokenizer.vocab_size - 10, (1, context))
    stored = {}
    for name, bits in (("lossless", None), ("int8", 8), ("int4", 4)):
        store = ChunkStore(max_bytes=2**34, chunk_size=128, kv_bits=bits)
        warm(model, ids[:, :129], store)
        entry = store.entries()[0]
        stored[name] = entry.nbytes / entry.num_tokens
    cache = None
    times = []
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            token = out.logits[:, -1:].argmax(-1)
    step_s = statistics.median(times)
    return {"context": context, "decode_step_ms": step_s * 1000, "decode_tok_s_one_sequence": 1 / step_s,
            "stored_bytes_per_token": stored}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def render(report: CapacityReport, source: str) -> str:
    r = report
    lines = [
        f"model: {source}",
        f"memory {_mib(r.memory_bytes)}, context {r.context:,} tokens, bandwidth {r.bandwidth_gb_s:.1f} GB/s",
        f"weights: {_mib(r.weight_bytes)} ({'from the checkpoint' if r.weights_exact else 'estimated from the config'})",
        f"K/V per token: full-attention layers {r.kv_bytes_per_token['full']:,} B, "
        f"sliding layers {r.kv_bytes_per_token['sliding']:,} B (capped at their window)",
        f"K/V per sequence at {r.context:,} tokens: {_mib(r.kv_bytes_per_sequence)}",
        f"K/V pool after weights and a {_mib(r.margin_bytes)} margin: {_mib(r.kv_pool_bytes)}",
        (f"max concurrent sequences: {r.max_sequences:,}" if r.can_serve else
         f"cannot serve: the weights ({_mib(r.weight_bytes)}) and the margin ({_mib(r.margin_bytes)}) do not fit "
         f"in {_mib(r.memory_bytes)}" if r.weight_bytes + r.margin_bytes >= r.memory_bytes else
         "cannot serve: the weights fit, but not one sequence of this context beside them"),
        f"decode (memory bound): {r.decode_tok_s_one_sequence:.1f} tok/s at batch 1; "
        f"{r.decode_tok_s_per_sequence_at_max:.1f} tok/s per sequence, "
        f"{r.decode_tok_s_aggregate_at_max:.1f} tok/s aggregate at {r.max_sequences:,} sequences",
        "chunk store bytes per token at rest: " + ", ".join(
            f"{k} {v:,.0f} B" for k, v in r.stored_bytes_per_token.items()),
    ]
    chosen = {None: "lossless", 8: "int8", 4: "int4"}[r.store_kv_bits]
    lines.append(f"a chunk store ({chosen}) the size of the K/V pool would hold "
                 f"{r.kv_pool_bytes / r.stored_bytes_per_token[chosen]:,.0f} tokens at rest")
    if r.shared_prefix:
        p = r.shared_prefix
        lines.append(f"shared prefix of {p['tokens']:,} tokens: prefilled once, {p['prefill_fraction_saved']:.0%} "
                     f"of each request's prefill saved; stored once ("
                     + ", ".join(f"{k} {_mib(v)}" for k, v in p["store_bytes_once"].items())
                     + "); each running sequence still holds its own live copy")
    if r.measured:
        m = r.measured
        lines.append(f"measured here (context {m['context']}): decode {m['decode_tok_s_one_sequence']:.1f} tok/s at "
                     f"batch 1 ({m['decode_step_ms']:.0f} ms/step) vs predicted {r.decode_tok_s_one_sequence:.1f}; "
                     "stored bytes/token " + ", ".join(
                         f"{k} {v:,.0f} (predicted {r.stored_bytes_per_token[k]:,.0f})"
                         for k, v in m["stored_bytes_per_token"].items()))
    return "\n".join(lines)


def plan_command(args: argparse.Namespace) -> str:
    """Run ``kvboost-hf plan`` with parsed ``args``; returns what to print."""
    shape, source = model_shape(args.model, args.dtype)
    memory = parse_bytes(args.memory) if args.memory else memory_limit_bytes()
    bandwidth = args.bandwidth or memory_bandwidth_gb_s()
    report = capacity(shape, memory, args.context, bandwidth, margin=args.margin, shared_prefix=args.shared_prefix)
    report.store_kv_bits = None if args.kv_bits == "none" else int(args.kv_bits)
    if args.measure:
        report.measured = measure(args.model, args.dtype, report)
    return report.to_json() if args.json else render(report, source)
