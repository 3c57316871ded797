"""kvboost_hf's CPU GEMM kernels against torch's int4 kernel and dense bf16/fp32 matmuls, per ISA path.

Each path runs in its own process with ``ATEN_CPU_CAPABILITY`` set to match (so torch's kernels take
the same ISA) and ``KVBOOST_HF_KERNEL_ISA`` for ours. oneDNN, which runs torch's bf16 matmuls, reads
``ONEDNN_MAX_CPU_ISA`` instead: the avx512 and avx2 processes set it (``AVX512_CORE``, ``AVX2``) so
the float baselines run as on a host of that class (torch then takes oneDNN's AVX-512 bf16 emulation,
or on AVX2 its own bf16 GEMM, as it does on such hosts); ``--native-onednn`` leaves oneDNN at this
host's best (the avx512_bf16 process always does). Per process, interleaved, medians of ``--reps``:

- a bandwidth probe (sum over a 512 MB tensor) on 4 KiB pages and on huge pages, the latter giving the floor for
  each weight read (every model's weights and the head below are on huge pages, as our loaders place them);
- Gemma-3-270M's layer shapes at M = 1, 4, 9, 16, 64, 256 rows: kvboost int4 (group 128), torch int4,
  torch dense bf16 and fp32; the 262k x 640 LM head: kvboost bf16 (blocked layout, nn.Linear's own [N, K]
  layout that an int4 model's tied head runs on, and on amx_bf16 its tile copy, which the loader keeps there)
  against torch bf16/fp32;
- the whole model packed by ``awq-pack`` (round-to-nearest, group 128, resident): decode step after a
  200-token prompt and 3 steps (as decoding runs: past the refill of the prefill's exact cache buffers; session
  16's and earlier figures timed the first step, a refill), a 9-row forward there (verification), a 256-token
  prefill, for kernel="kvboost"
  (also "decoder unfused": transformers' decoder forward around the fused layers instead of the fused
  decoder's loop; "layers unfused": the decoder layers' own forward instead of the fused layer ops; "GEMMs only":
  that and its projections unfused, HF's RMSNorm modules and bf16 attention; the same model object
  switched per sample) and kernel="torch", against the bf16 float model; and a token of the int4
  FR-Spec self-draft (``make_draft(bits=4, vocab=32768)``) of the kvboost model after the same
  prompt, on a cache that appends in place (``BufferedCache``, as a draft's ``ChunkReuseCache`` in
  speculation): one token alone ("step"), and a token of an 8-token round as speculation drafts it
  ("round8_token": the decoder's layers checked once a round, ``plan_held``); and a token of an 8-token round of the
  head draft (``make_head_draft(model, 16384)``: the target's own decoder, an int8 head of 16,384 tokens) as one
  ``draft_round`` op call, as speculation runs it. Greedy continuations are compared.
  After one untimed rep, each rep of the whole model also reads the bandwidth probe again (huge pages), and the targets' ratios are taken
  per rep, then their median and range: the step's share of its floor (the bytes a step reads, the decoder's layers
  and the head, at that rep's probe), the 9-row exact forward, the draft token and the prefill against the step or the
  float model of the same rep (memory speed moves within a run: ratios of medians taken minutes apart mislead); and
  each rep one more step with the probe read right before and right after it, its share of the floor at their mean.

    python benchmarks/kernels.py [--reps 7] [--paths avx512_bf16,avx512,avx2] [--name kernels]

``--paths avx512_bf16_novbmi`` runs the avx512_bf16 path with int4 decoded as on a CPU with AVX-512 BF16
but no VBMI (Cooper Lake; ``KVBOOST_HF_KERNEL_VBMI=0``): the same bits, that host's decoding.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (  # noqa: E402
    DOCS_BENCH, BandwidthProbe, ForwardTimes, environment, median, memory_bandwidth_gbs, packed_gemma, write_json)

ROWS = (1, 4, 9, 16, 64, 256)
SHAPES = {"q_proj 1024x640": (1024, 640), "gate/up 2048x640": (2048, 640), "down 640x2048": (640, 2048)}
TORCH_CAPABILITY = {"amx_bf16": "avx512", "avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2", "scalar": "default"}
# Pseudo-paths: a path with one of its host features turned off (as on a CPU without it).
VARIANTS = {"avx512_bf16_novbmi": ("avx512_bf16", {"KVBOOST_HF_KERNEL_VBMI": "0"})}
ONEDNN_ISA = {"avx512": "AVX512_CORE", "avx2": "AVX2", "scalar": "SSE41"}  # a host of the path's class


def layer_rows(reps: int) -> dict:
    from kvboost_hf import kernels
    from kvboost_hf.models.huge_pages import back_with_huge_pages
    from kvboost_hf.streaming.awq_format import scales_and_zeros, to_int4pack

    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), generator=gen)
        zeros = torch.randint(0, 16, (k // 128, n), generator=gen).float()
        scales = torch.rand(k // 128, n, generator=gen) * 0.01
        ours = kernels.pack_int4(codes, zeros, scales, 128)
        packed, sz = to_int4pack(codes, torch.device("cpu")), scales_and_zeros(scales, zeros)
        dense = torch.randn(n, k, generator=gen)
        dense16 = dense.to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            x32 = x.float()
            fns = {"kvboost int4": lambda: kernels.int4_linear(x, ours),
                   "torch int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 128, sz),
                   "torch bf16": lambda: x @ dense16.T, "torch fp32": lambda: x32 @ dense.T}
            out[f"{name} M={m}"] = interleave(fns, reps) | {"int4_bytes": n * k // 2}
    n, k = 262144, 640
    head = torch.randn(n, k, generator=gen)
    head16 = head.to(torch.bfloat16)
    ours16 = kernels.pack_dense(head16)
    tiles = kernels.tile_layout(head16) if kernels.current_isa() == "amx_bf16" else None  # as the loader keeps
    back_with_huge_pages([head, head16, ours16.weight] + ([tiles] if tiles is not None else []))  # as loaded
    for m in (1, 4, 9):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        x32 = x.float()
        fns = {"kvboost bf16 blocked": lambda: kernels.dense_linear(x, ours16),
               "kvboost bf16 [N,K]": lambda: kernels.linear(x, head16), "torch bf16": lambda: x @ head16.T,
               "torch fp32": lambda: x32 @ head.T}
        if tiles is not None:
            fns["kvboost bf16 tiles"] = lambda: kernels.linear(x, head16, tiles=tiles)
        out[f"lm_head 262144x640 M={m}"] = interleave(fns, reps) | {"bf16_bytes": n * k * 2}
    return out


def interleave(fns: dict, reps: int) -> dict:
    """Median ms of each of ``fns``, run in turn ``reps`` times in a shuffled order (seeded, another every rep): what
    runs just before a call matters. In a fixed order (or a rotated one, which keeps each call's predecessor) the
    first variant always ran right after MKL's fp32 GEMM, whose pause put libgomp's threads to sleep: a one-row
    int4 GEMM then took ~0.085 ms against 0.03 back to back (session 21)."""
    samples = {name: [] for name in fns}
    names = list(fns)
    order = random.Random(0)
    for fn in fns.values():
        fn()
    for _ in range(reps):
        order.shuffle(names)
        for name in names:
            start = time.perf_counter()
            fns[name]()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: median(s) for name, s in samples.items()}


@torch.no_grad()
def whole_model(reps: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvboost_hf import make_draft, make_head_draft
    from kvboost_hf.cache import BufferedCache
    from kvboost_hf.models import load_default_model
    from kvboost_hf.models.attention import FLOAT32_SDPA
    from kvboost_hf.models.huge_pages import back_with_huge_pages
    from kvboost_hf.streaming import StreamingAWQConfig

    model, tokenizer = load_default_model()
    path = packed_gemma(model, tokenizer)
    models = {kernel: AutoModelForCausalLM.from_pretrained(
        path, quantization_config=StreamingAWQConfig(residency_mode="full_resident", kernel=kernel),
        dtype=torch.bfloat16).eval() for kernel in ("kvboost", "torch")}
    models["bf16 float"] = model.to(torch.bfloat16)
    back_with_huge_pages(models["bf16 float"])  # as the int4 models' loader does, and `kvboost-hf serve`
    draft = make_draft(models["kvboost"], bits=4, vocab=32768, tokenizer=tokenizer)
    head_draft = make_head_draft(models["kvboost"], 16384, tokenizer=tokenizer)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 20000, (1, 200), generator=gen)
    long = torch.randint(10, 20000, (1, 256), generator=gen)

    def prefilled(m, in_place: bool = False):
        # A draft's cache appends in place, as a ChunkReuseCache (what speculation gives a draft) does.
        cache = BufferedCache(config=m.config) if m is draft or in_place else DynamicCache(config=m.config)
        m(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(3):  # a step as decoding runs it: the refill after the prefill's exact buffers done
            m(prompt[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    times = ForwardTimes(prompt, long, prefilled)
    probe, bandwidth, bracketed = BandwidthProbe(huge_pages=True, reps=3), [], []

    # HF's RMSNorm modules of the float model (bf16(w), where the packed checkpoint holds bf16(fp16(w)):
    # the same ops and shapes, for timing only; "GEMMs only" logits are not compared).
    hf_norms = dict(models["bf16 float"].named_modules())
    switch = functools.partial(switch_extras, norms=hf_norms)
    settings = {"kvboost": (models["kvboost"], True), "kvboost decoder unfused": (models["kvboost"], "decoder"),
                "kvboost layers unfused": (models["kvboost"], "unfused"),
                "kvboost float32 SDPA": (models["kvboost"], FLOAT32_SDPA),
                "kvboost GEMMs only": (models["kvboost"], False),
                "torch": (models["torch"], True), "bf16 float": (models["bf16 float"], True)}
    samples = {name: {"step": [], "verify9": [], "verify9_exact": [], "prefill256": []} for name in settings}
    samples["int4 self-draft"] = {"step": [], "round8_token": []}
    samples["head draft (16k)"] = {"round8_token": []}
    for name, (m, mode) in settings.items():  # untimed: a process's first forwards of a model run slow
        switch(m, mode)
        times.step(m), times.verify(m, exact=True), times.prefill(m)
    switch(models["kvboost"], True)
    draft_round(draft, times), head_round(models["kvboost"], head_draft, times)
    for _ in range(reps):
        bandwidth.append(probe())
        for name, (m, mode) in settings.items():
            switch(m, mode)
            samples[name]["step"].append(times.step(m) * 1e3)
            samples[name]["verify9"].append(times.verify(m) * 1e3)
            samples[name]["verify9_exact"].append(times.verify(m, exact=True) * 1e3)
            samples[name]["prefill256"].append(times.prefill(m) * 1e3)
        switch(models["kvboost"], True)
        samples["int4 self-draft"]["step"].append(times.step(draft) * 1e3)
        samples["int4 self-draft"]["round8_token"].append(draft_round(draft, times) * 1e3)
        samples["head draft (16k)"]["round8_token"].append(head_round(models["kvboost"], head_draft, times) * 1e3)
        bracketed.append(bracketed_step(models["kvboost"], times, probe))
    text = {name: m.generate(prompt[:, :64], max_new_tokens=24, do_sample=False)[0, 64:].tolist()
            for name, m in models.items()}
    del probe
    return {"ms": {name: {k: median(v) for k, v in s.items()} for name, s in samples.items()},
            "bandwidth_huge_gbs_per_rep": bandwidth, "step_bytes": step_bytes(models["kvboost"]),
            "targets": target_ratios(samples, bandwidth, step_bytes(models["kvboost"]), bracketed),
            "bracketed_steps": [{"ms": ms, "probe_before_gbs": a, "probe_after_gbs": b} for ms, a, b in bracketed],
            "greedy_same_as_torch_int4": {name: t == text["torch"] for name, t in text.items()}}


def step_bytes(model) -> int:
    """Bytes a decode step reads at least: every tensor of the decoder's layers (each storage once) and the head."""
    seen, total = set(), 0
    tensors = [*model.get_decoder().layers.parameters(), *model.get_decoder().layers.buffers(),
               model.get_output_embeddings().weight]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def bracketed_step(model, times, probe) -> tuple[float, float, float]:
    """(ms, GB/s before, GB/s after): a decode step (after ``times.prefilled``) with the bandwidth probe read right
    before and right after it. The rep's one probe is read before all its forwards, and memory speed moves within a
    rep: on a Zen 4 (session 29) the probe read 33-58 GB/s rep to rep while the step read the head at ~30, and a C read
    loop beside it topped at 30-33; a floor read beside the step itself is the fairer one for its share."""
    cache = times.prefilled(model)
    before = probe()
    start = time.perf_counter()
    model(times.prompt[:, -1:], past_key_values=cache, use_cache=True)
    ms = (time.perf_counter() - start) * 1e3
    return ms, before, probe()


def target_ratios(samples: dict, bandwidth: list[float], nbytes: int, bracketed: list[tuple]) -> dict:
    """Issue 26's ratios, each taken within one rep and then summarized (median, min, max over the reps). The step's
    share of its floor twice: at the rep's probe ("step_floor_share"), and for the bracketed step at the mean of the
    probes read right before and after it ("step_floor_share_bracketed")."""
    ours, draft, fp = samples["kvboost"], samples["int4 self-draft"], samples["bf16 float"]
    per_rep = {
        "step_floor_share": [nbytes / (gbs * 1e9) * 1e3 / ms for gbs, ms in zip(bandwidth, ours["step"])],
        "step_floor_share_bracketed": [nbytes / ((a + b) / 2 * 1e9) * 1e3 / ms for ms, a, b in bracketed],
        "verify9_exact_over_step": [v / s for v, s in zip(ours["verify9_exact"], ours["step"])],
        "draft_round8_token_over_step": [d / s for d, s in zip(draft["round8_token"], ours["step"])],
        "head_draft_round8_token_over_step": [d / s for d, s in zip(samples["head draft (16k)"]["round8_token"],
                                                                      ours["step"])],
        "prefill256_over_float": [p / f for p, f in zip(ours["prefill256"], fp["prefill256"])],
    }
    return {name: {"median": median(v), "min": min(v), "max": max(v)} for name, v in per_rep.items()}


def draft_round(draft, times, tokens: int = 8) -> float:
    """Seconds a token of a ``tokens``-token draft round costs as speculation drafts it: the decoder's layers
    checked once a round (``plan_held``, as the draft adapters do), the cache a row longer each token."""
    from kvboost_hf.kernels.plan import plan_held

    cache = times.prefilled(draft)
    start = time.perf_counter()
    with plan_held(draft.get_decoder()):
        for _ in range(tokens):
            draft(times.prompt[:, -1:], past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) / tokens


def head_round(model, head_draft, times, tokens: int = 8) -> float:
    """Seconds a token of a ``tokens``-token head-draft round costs (the target's own decoder and a 16k int8 head) as
    speculation drafts it: one ``draft_round`` op call (kernels.draft_round), the cache reserved and committed once."""
    from kvboost_hf.kernels.draft_round import draft_round as fused_round
    from kvboost_hf.kernels.plan import plan_held

    cache = times.prefilled(model, in_place=True)  # the target's cache in speculation appends in place too
    past = cache.get_seq_length()
    inputs = {"input_ids": times.prompt[:, -1:], "past_key_values": cache, "use_cache": True,
              "attention_mask": torch.ones(1, past + 1, dtype=torch.long), "cache_position": torch.tensor([past])}
    head = head_draft.head
    start = time.perf_counter()
    with plan_held(model.get_decoder()):
        done = fused_round(model.get_decoder(), inputs, tokens, head.linear.blocks, head.tokens.long(), set())
    seconds = time.perf_counter() - start
    if done is None:
        raise RuntimeError("the head draft's round did not run as one op call (kernels.draft_round)")
    return seconds / len(done.tokens)


def switch_extras(model, on, norms: dict) -> None:
    """A kvboost-kernel model's fused decoder, fused layers, fused projections, fused RMSNorms and attention kernel
    on (``on`` True; ``"decoder"``: all but the fused decoder; ``"unfused"``: all but the fused decoder and layers;
    or an ``OwnedAttention`` to compute attention with instead of the kernel), or off (its GEMMs only: separate
    projection calls, HF's RMSNorm modules from ``norms``, bf16 SDPA), in place."""
    from kvboost_hf.kernels.decoder import fuse_decoder, unfuse_decoder
    from kvboost_hf.kernels.layer import fuse_layers, unfuse_layers
    from kvboost_hf.models.attention import OWNED_ATTR
    from kvboost_hf.models.fused_norm import FusedRMSNorm
    from kvboost_hf.streaming.linear import AWQInt4Linear

    saved = model.__dict__.setdefault("_bench_saved", {"groups": {}, "norms": {}, "attention": {}})
    if not saved["norms"]:
        saved["norms"] = {name: (m, norms[name]) for name, m in model.named_modules() if isinstance(m, FusedRMSNorm)}
    for name, (fused, original) in saved["norms"].items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, fused if on else original)
    for module in model.modules():
        if isinstance(module, AWQInt4Linear):
            saved["groups"].setdefault(module, module.group)
            module.group = saved["groups"][module] if on else None
        if module is not model and (module in saved["attention"] or getattr(module, OWNED_ATTR, None) is not None):
            loaded_with = saved["attention"].setdefault(module, getattr(module, OWNED_ATTR))
            setattr(module, OWNED_ATTR, loaded_with if on in (True, "unfused", "decoder") else (on or None))
    if "fused_layers" not in saved:  # only a model loaded with fused layers switches them
        saved["fused_layers"] = unfuse_layers(model) > 0
    if saved["fused_layers"]:
        if on is False or on == "unfused":
            unfuse_layers(model)
        else:
            fuse_layers(model)
    if "fused_decoder" not in saved:
        saved["fused_decoder"] = unfuse_decoder(model) > 0
    if saved["fused_decoder"]:
        if on is True or not isinstance(on, (bool, str)):  # all on, or another attention (its fast loop falls back)
            fuse_decoder(model)
        else:
            unfuse_decoder(model)


def worker(reps: int) -> dict:
    from kvboost_hf import kernels

    status = kernels.available()
    if not status.built:
        raise SystemExit(f"kernels not built: {status.reason}")
    return {"isa": status.isa + ("" if os.environ.get("KVBOOST_HF_KERNEL_VBMI") != "0" else " (no VBMI)"),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "host"),
            "torch_bf16_on_onednn": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "bandwidth_gbs": memory_bandwidth_gbs(reps), "bandwidth_huge_gbs": memory_bandwidth_gbs(reps, huge_pages=True),
            "layers": layer_rows(reps), "model": whole_model(reps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--paths", default="avx512_bf16,avx512,avx2", help="amx_bf16 too on a CPU with AMX")
    parser.add_argument("--name", default="kernels",
                        help="file stem of the results under docs/benchmarks/ (another host class's run beside the "
                             "main one, e.g. kernels-avx2-zen3)")
    parser.add_argument("--native-onednn", action="store_true",
                        help="float baselines on this host's best oneDNN ISA on every path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.reps)))
        return
    results = {}
    for path in args.paths.split(","):
        isa, extra = VARIANTS.get(path, (path, {}))
        env = {**os.environ, "ATEN_CPU_CAPABILITY": TORCH_CAPABILITY[isa], "KVBOOST_HF_KERNEL_ISA": isa, **extra}
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if isa in ONEDNN_ISA and not args.native_onednn:
            env["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA[isa]
        done = subprocess.run([sys.executable, __file__, "--worker", "--reps", str(args.reps)], env=env, check=True,
                              capture_output=True, text=True)
        results[path] = json.loads(done.stdout.strip().splitlines()[-1])
        report(path, results[path])
    write_json(f"{args.name}.json", {"environment": environment(), "options": vars(args), "paths": results})
    plot(results, DOCS_BENCH / f"{args.name}.png")


def report(path: str, r: dict) -> None:
    print(f"== path {r['isa']} (torch {r['torch_capability']}, oneDNN {r['onednn_max_isa']}, torch bf16 on oneDNN: "
          f"{r['torch_bf16_on_onednn']}), bandwidth {r['bandwidth_gbs']:.1f} GB/s on 4 KiB pages, "
          f"{r['bandwidth_huge_gbs']:.1f} GB/s on huge pages")
    for name, row in r["layers"].items():
        print(f"{name:32s} " + "  ".join(f"{k} {v:8.3f}" for k, v in row.items() if not k.endswith("bytes")))
    for name, row in r["model"]["ms"].items():
        print(f"{name:34s} " + "  ".join(f"{k} {v:7.1f} ms" for k, v in row.items()))
    probes = r["model"]["bandwidth_huge_gbs_per_rep"]
    print(f"probe beside the reps {min(probes):.1f}-{max(probes):.1f} GB/s; a step reads "
          f"{r['model']['step_bytes'] / 1e6:.0f} MB; per-rep ratios (median, range):")
    for name, v in r["model"]["targets"].items():
        print(f"  {name:30s} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})")
    print("greedy as torch int4:", r["model"]["greedy_same_as_torch_int4"])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (isa, r) in zip(axes[0], results.items()):
        for kernel in ("kvboost int4", "torch int4", "torch bf16"):
            ms = [r["layers"][f"gate/up 2048x640 M={m}"][kernel] for m in ROWS]
            ax.plot(ROWS, ms, marker="o", label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows (M)")
        ax.set_ylabel("ms, 2048x640 projection")
        ax.set_title(f"{isa} path")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
