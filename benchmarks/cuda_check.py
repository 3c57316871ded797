"""The DEVICE paths, checked on a DEVICE machine: exact reuse, AWQ streaming and self-drafts on the GPU.

CI has no GPU, so these paths are untested there; this script is the device check (run it where
``torch.cuda.is_available()``). Each check compares against plain ``generate`` / the fully resident
model on the same GPU and records the result; timings (TTFT cold against warm reuse, decode of a
streamed model against a resident one) are medians of interleaved runs on one larger random model.

    python benchmarks/cuda_check.py --out cuda_check.json

Exit status 1 if any check fails (every check still runs).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, make_draft  # noqa: E402
from kvboost_hf.streaming import StreamingAWQConfig, streaming_stats  # noqa: E402
from kvboost_hf.streaming.pack import pack_model  # noqa: E402
from tests.conftest import FAMILIES, make_tiny, random_ids  # noqa: E402

DEVICE = torch.device("cuda:0")  # --device cpu: a dry run of the script itself (small sizes)
SMALL = False
RESULTS: dict[str, dict] = {}
CHECKS: list = []


def check(name: str):
    """Register the decorated check; :func:`run` records ``passed`` and its details (or the exception)."""
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn
    return wrap


def run(name: str, fn) -> None:
    """Run one check, recording it in RESULTS and printing one line."""
    start = time.perf_counter()
    try:
        details = fn() or {}
        RESULTS[name] = {"passed": True, **details}
    except Exception as exc:  # noqa: BLE001 - a failed check is recorded and the others still run
        frames = "".join(traceback.format_tb(exc.__traceback__))
        RESULTS[name] = {"passed": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}", "traceback": frames[-4000:]}
    RESULTS[name]["seconds"] = round(time.perf_counter() - start, 2)
    print(f"{'PASS' if RESULTS[name]['passed'] else 'FAIL'} {name} "
          f"{ {k: v for k, v in RESULTS[name].items() if k != 'traceback'} }", flush=True)


def greedy(model, ids: torch.Tensor, n: int = 12, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, **kw)


def reuse_exact(dtype: torch.dtype) -> dict:
    """Every tiny family on the GPU: cold, warm (a shared 64-token prefix) and seeded sampling equal plain."""
    out = {}
    for family in FAMILIES:
        model = make_tiny(family, seed=11, num_layers=3).to(DEVICE, dtype)
        first, second = random_ids(80, 1).to(DEVICE), random_ids(80, 1).to(DEVICE)
        second[:, 64:] = random_ids(16, 2).to(DEVICE)
        plain = [greedy(model, ids) for ids in (first, second)]
        torch.manual_seed(5)
        with torch.no_grad():
            sampled = model.generate(second, max_new_tokens=12, do_sample=True, top_k=20)
        enable_chunk_reuse(model, ChunkStore(max_bytes=100_000_000, chunk_size=16))
        try:
            cold = greedy(model, first)
            warm = greedy(model, second)
            reused = last_request_stats(model).reused_tokens
            torch.manual_seed(5)
            with torch.no_grad():
                sampled_warm = model.generate(second, max_new_tokens=12, do_sample=True, top_k=20)
        finally:
            disable_chunk_reuse(model)
        assert torch.equal(cold, plain[0]), (family, "cold")
        assert torch.equal(warm, plain[1]), (family, "warm")
        assert torch.equal(sampled_warm, sampled), (family, "sampled")
        assert reused >= 64, (family, reused)
        out[family] = {"reused_tokens": reused}
    return out


@check("reuse_exact_fp32")
def _reuse_fp32():
    return reuse_exact(torch.float32)


@check("reuse_exact_bf16")
def _reuse_bf16():
    return reuse_exact(torch.bfloat16)


WORK = Path(tempfile.mkdtemp(prefix="cuda-check-"))
TINY = make_tiny("llama", seed=3, num_layers=6)


def load(path: Path, **settings):
    settings.setdefault("device_map", str(DEVICE))
    kwargs = {k: settings.pop(k) for k in ("device_map", "dtype") if k in settings}
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=StreamingAWQConfig(**settings),
                                                **kwargs).eval()


@check("streaming_modes_equal_resident")
def _streaming():
    prompt = random_ids(24, 7).to(DEVICE)
    out = {}
    for dtype in (None, torch.bfloat16):
        extra = {} if dtype is None else {"dtype": dtype}
        reference = load(WORK / "tiny", residency_mode="full_resident", **extra)
        assert next(reference.parameters()).device.type == DEVICE.type
        with torch.no_grad():
            ref_logits = reference(prompt).logits
        ref_tokens = greedy(reference, prompt, 6)
        cpu = load(WORK / "tiny", residency_mode="full_resident", device_map="cpu", kernel="torch")
        with torch.no_grad():
            cpu_logits = cpu(prompt.cpu()).logits.float()
        float_logits = TINY(prompt.cpu()).logits.float()
        out[str(dtype)] = {"dtype": str(ref_logits.dtype),
                           "cuda_vs_cpu_int4_max_abs": float((ref_logits.float().cpu() - cpu_logits).abs().max()),
                           "cuda_int4_vs_float_max_abs": float((ref_logits.float().cpu() - float_logits).abs().max()),
                           "cpu_int4_vs_float_max_abs": float((cpu_logits - float_logits).abs().max())}
        for mode in ("partial_resident", "ffn_only_stream", "full_stream"):
            for slots, host in ((1, "ram"), (2, "mmap"), (2, "ram")):
                settings = dict(residency_mode=mode, keep_first_k=1, keep_last_k=1, n_staging_slots=slots, host=host,
                                mmap_dir=str(WORK / "mmap"), **extra)
                model = load(WORK / "tiny", **settings)
                with torch.no_grad():
                    logits = model(prompt).logits
                tokens = greedy(model, prompt, 6)
                assert torch.equal(logits, ref_logits), settings
                assert torch.equal(tokens, ref_tokens), settings
                stats = streaming_stats(model)
                assert stats.acquisitions > 0, (settings, stats)
                del model
        try:
            if DEVICE.type == "cpu":
                raise ValueError("CPU only: nothing to check on the CPU")
            load(WORK / "tiny", residency_mode="full_resident", kernel="kvboost", **extra)
            raise AssertionError("kernel='kvboost' loaded on DEVICE")
        except ValueError as exc:
            assert "CPU only" in str(exc), exc
    return out


@check("streaming_with_reuse_exact")
def _streaming_reuse():
    model = load(WORK / "tiny", residency_mode="full_stream", n_staging_slots=2)
    first = random_ids(80, 4).to(DEVICE)
    second = first.clone()
    second[:, 64:] = random_ids(16, 5).to(DEVICE)
    plain = greedy(model, second)
    enable_chunk_reuse(model, ChunkStore(max_bytes=100_000_000, chunk_size=16))
    greedy(model, first)
    warm = greedy(model, second)
    reused = last_request_stats(model).reused_tokens
    disable_chunk_reuse(model)
    assert torch.equal(warm, plain) and reused >= 64, reused
    return {"reused_tokens": reused}


@check("self_draft_exact")
def _drafts():
    """Greedy with int4/int8 self-drafts, prompt lookup and store drafts equals plain greedy: asserted on an fp32
    target and on the streamed AWQ (bf16) target, whose verification is row-exact; recorded, not asserted, on a
    bf16 float target (docs/speculative.md: batched verification of a float model is not bit-exact)."""
    out = {}
    ids = random_ids(40, 9).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        model = make_tiny("llama", seed=12, num_layers=4).to(DEVICE, dtype)
        plain = greedy(model, ids, 24)
        enable_chunk_reuse(model, ChunkStore(max_bytes=100_000_000, chunk_size=16))
        try:
            for draft in ("int4", "int8", "prompt-lookup", "store"):
                kind = make_draft(model, bits=int(draft[3])) if draft.startswith("int") else draft
                got = greedy(model, ids, 24, draft=kind)
                same = bool(torch.equal(got, plain))
                assert same or dtype != torch.float32, (dtype, draft)
                out[f"{str(dtype)[6:]}-{draft}"] = {"identical": same,
                                                    "speculation": str(last_request_stats(model).speculation)[:200]}
        finally:
            disable_chunk_reuse(model)
    streamed = load(WORK / "tiny", residency_mode="full_stream", n_staging_slots=2)
    plain = greedy(streamed, ids, 16)
    enable_chunk_reuse(streamed, ChunkStore(max_bytes=100_000_000, chunk_size=16))
    got = greedy(streamed, ids, 16, draft=make_draft(streamed, bits=4))
    disable_chunk_reuse(streamed)
    assert torch.equal(got, plain), "streamed target, int4 self-draft"
    out["streamed-int4"] = {"identical": True}
    return out


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def cuda_ms(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return times


def big_model() -> LlamaForCausalLM:
    """A ~1.1B-parameter Llama of random weights (TinyLlama's shape), bf16."""
    torch.manual_seed(0)
    if SMALL:
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192)
    else:
        config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    return model.eval()


@check("ttft_reuse_timing")
def _ttft(reps: int = 7):
    model = big_model()
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(3, 32000, (1, 4000), generator=g)
    questions = [torch.randint(3, 32000, (1, 40), generator=g) for _ in range(2 * reps + 2)]
    prompts = [torch.cat([doc, q], dim=1).to(DEVICE) for q in questions]
    store = ChunkStore(max_bytes=8_000_000_000, chunk_size=128)
    one = dict(max_new_tokens=1, do_sample=False)
    with torch.no_grad():
        model.generate(prompts[0], **one)  # warm-up kernels
        plain_ms, warm_ms, reused, lookup_ms = [], [], [], []
        enable_chunk_reuse(model, store)
        model.generate(prompts[1], **one)  # stores the document
        for i in range(reps):
            disable_chunk_reuse(model)
            plain_ms += cuda_ms(lambda: model.generate(prompts[2 + 2 * i], **one), 1)
            enable_chunk_reuse(model, store)
            warm_ms += cuda_ms(lambda: model.generate(prompts[3 + 2 * i], **one), 1)
            reused.append(last_request_stats(model).reused_tokens)
            lookup_ms.append(round(last_request_stats(model).lookup_ms, 2))
        profile = cProfile.Profile()
        profile.enable()
        cuda_ms(lambda: model.generate(prompts[-1], **one), 1)
        profile.disable()
        disable_chunk_reuse(model)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
        print(text.getvalue()[-6000:], flush=True)
        # HF's prompt-cache pattern: a pre-built DynamicCache of exactly the document, only the question forwarded
        prefix = DynamicCache()
        model(prompts[-1][:, :4000], past_key_values=prefix, use_cache=True)
        ideal_ms = []
        for _ in range(reps):
            cache = copy.deepcopy(prefix)
            ideal_ms += cuda_ms(lambda: model.generate(prompts[-1], past_key_values=cache, **one), 1)
    plain, warm, ideal = (statistics.median(v) for v in (plain_ms, warm_ms, ideal_ms))
    return {"prompt_tokens": 4040, "plain_ttft_ms": round(plain, 2), "warm_ttft_ms": round(warm, 2),
            "ideal_ttft_ms": round(ideal, 2), "warm_over_ideal": round(warm / ideal, 2),
            "plain_over_warm": round(plain / warm, 2), "reused_tokens": reused, "lookup_ms": lookup_ms,
            "plain_all": plain_ms,
            "warm_all": warm_ms}


def decode_ms(model, ids: torch.Tensor, reps: int) -> dict:
    """Median ms per token of a 33-token greedy generate after ``ids`` (prefill included), after a warm-up."""
    greedy(model, ids, 4)
    times = cuda_ms(lambda: greedy(model, ids, 33, min_new_tokens=33), reps)
    return {"ms_per_token_incl_prefill": round(statistics.median(times) / 33, 3), "all_ms": [round(t, 1) for t in times]}


@check("streaming_decode_timing")
def _stream_timing(reps: int = 3):
    """Decode of the ~1.1B model: bf16 float, then its int4 AWQ pack resident and streamed from pinned RAM."""
    ids = torch.randint(3, 32000, (1, 256), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    model = big_model()
    out = {"bf16-float": decode_ms(model, ids, reps)}
    pack_model(model.float().cpu(), WORK / "big", group_size=128)
    del model
    torch.cuda.empty_cache()
    for mode, slots in (("full_resident", 1), ("partial_resident", 2), ("full_stream", 2), ("full_stream", 3)):
        model = load(WORK / "big", residency_mode=mode, n_staging_slots=slots, host="ram", dtype=torch.bfloat16)
        out[f"{mode}-{slots}"] = {**decode_ms(model, ids, reps), "stats": str(streaming_stats(model))[:300]}
        del model
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cuda_check.json")
    parser.add_argument("--device", default="cuda:0", help="cuda:0; cpu runs the script itself, small")
    parser.add_argument("--only", nargs="*", help="names of the checks to run (default: all)")
    args = parser.parse_args()
    global DEVICE, SMALL
    DEVICE, SMALL = torch.device(args.device), args.device == "cpu"
    pack_model(TINY, WORK / "tiny", group_size=32,
               calibration_ids=torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(1)))
    for name, fn in CHECKS:
        if not args.only or name in args.only:
            run(name, fn)
    info = {"torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "cpu (dry run)"}
    import transformers
    info["transformers"] = transformers.__version__
    Path(args.out).write_text(json.dumps({"environment": info, "checks": RESULTS}, indent=1, default=str))
    return 0 if all(r["passed"] for r in RESULTS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
