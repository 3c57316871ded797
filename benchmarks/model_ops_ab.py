"""Two kernel sources in one model, in one process, call by call: the base tree's ops under another namespace.

``benchmarks/kernel_ab_inprocess.py`` compares two trees' GEMM loops in a C++ driver; this compares what a change
does to the whole model. The base tree (``--base``, a ``csrc/`` directory) is built with its op library renamed
``kvboost_base`` and loaded beside the package's own build; each call of the model (the packed Gemma-3-270M of
``benchmarks/_common.packed_gemma``, resident, 2 threads) then runs with ``torch.ops.kvboost`` answering either
every op from the package's build, or the ops named by ``--ops`` from the base build, alternating ABBA. Only the
named ops are swapped: two builds of identical GEMM code differ by a few percent on code placement alone (a 9-row
pass moved 0.96-1.05 between runs with every op swapped, 2026-11-29), so an A/B swaps what changed. Ops the fused
decoder calls inside ``layer_step`` (C++) are reached from Python only on the four-call loop: ``--four-calls`` takes
it at every step. Greedy continuations of both are compared first.

    git archive HEAD~1 csrc | tar -x -C /tmp/base      # the sources to compare against
    python benchmarks/model_ops_ab.py --base /tmp/base/csrc --ops attention --four-calls [--what step verify prefill]

Prints, per call kind, each way's median and the median and quartiles of the per-pair ratios base / new (above 1:
the package's build is faster).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch

from _common import per_pair

NAMESPACE = "kvboost_base"


def build_base(csrc: Path) -> None:
    """The base tree's ops, loaded under :data:`NAMESPACE`."""
    from torch.utils import cpp_extension

    from kvboost_hf.kernels.build import CFLAGS, SOURCES

    renamed = Path(tempfile.mkdtemp(prefix="kvboost_base_"))
    for path in csrc.iterdir():
        text = path.read_text()
        if path.suffix == ".cpp":
            text = re.sub(r"TORCH_LIBRARY(_IMPL|_FRAGMENT)?\(kvboost,", rf"TORCH_LIBRARY\1({NAMESPACE},", text)
        (renamed / path.name).write_text(text)
    library = cpp_extension.load(name="kvboost_base_ops", sources=[str(renamed / s) for s in SOURCES],
                                 extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                                 extra_include_paths=[str(renamed)], build_directory=str(renamed),
                                 is_python_module=False)
    torch.ops.load_library(library)


class Swapped:
    """``torch.ops.kvboost`` with the ops in ``names`` (or every op: ``None``) taken from the base build."""

    def __init__(self, new, base, names: set[str] | None) -> None:
        self.new, self.base, self.names = new, base, names

    def __getattr__(self, name: str):
        return getattr(self.base if self.names is None or name in self.names else self.new, name)


def pairs_of(call, ways: dict, pairs: int) -> str:
    times = {name: [] for name in ways}
    ratios = []
    for i in range(pairs):
        took = {}
        for name in list(ways) if i % 2 == 0 else list(ways)[::-1]:
            torch.ops.kvboost = ways[name]
            took[name] = call()
        torch.ops.kvboost = ways["new"]
        for name, seconds in took.items():
            times[name].append(seconds)
        ratios.append(took["base"] / took["new"])
    return per_pair(times, ratios, "base / new")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=Path, help="csrc directory of the sources to compare against")
    parser.add_argument("--ops", nargs="+", default=["all"], help="ops taken from the base build ('all': every op)")
    parser.add_argument("--what", nargs="+", choices=["step", "verify", "prefill"], default=["step", "verify"])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--four-calls", action="store_true", help="the fused decoder's four-call loop at every step")
    args = parser.parse_args()

    from transformers import DynamicCache

    from _common import resident_int4_gemma
    from kvboost_hf.kernels import decoder
    from kvboost_hf.kernels.ops import loaded

    if not loaded():
        raise SystemExit("kvboost_hf's kernels are not built here")
    build_base(args.base)
    new = torch.ops.kvboost
    ways = {"base": Swapped(new, getattr(torch.ops, NAMESPACE), None if "all" in args.ops else set(args.ops)),
            "new": new}
    if args.four_calls:
        decoder._updates_layers_only = lambda cache: False
    torch.set_num_threads(2)
    model, _ = resident_int4_gemma()
    prompt = torch.randint(10, 20000, (1, 1000), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        texts = {}
        for name, way in ways.items():
            torch.ops.kvboost = way
            texts[name] = model.generate(prompt[:, :64], max_new_tokens=24, do_sample=False)[0, 64:].tolist()
        torch.ops.kvboost = new
        print(f"greedy continuations identical: {texts['base'] == texts['new']}")
        cache = DynamicCache(config=model.config)
        model(prompt[:, :200], past_key_values=cache)
        model(prompt[:, 200:201], past_key_values=cache)
        position = [201]

        def step() -> float:
            start = time.perf_counter()
            model(prompt[:, position[0]:position[0] + 1], past_key_values=cache)
            position[0] += 1
            return time.perf_counter() - start

        verified = DynamicCache(config=model.config)
        model(prompt[:, :200], past_key_values=verified)

        def verify() -> float:
            start = time.perf_counter()
            model(prompt[:, 200:209], past_key_values=verified)
            took = time.perf_counter() - start
            verified.crop(-9)
            return took

        def prefill() -> float:
            start = time.perf_counter()
            model(prompt[:, :256], past_key_values=DynamicCache(config=model.config), logits_to_keep=1)
            return time.perf_counter() - start

        calls = {"step": (step, "decode step after 200 tokens"), "verify": (verify, "9-row pass after 200 tokens"),
                 "prefill": (prefill, "256-token prefill")}
        for what in args.what:
            call, label = calls[what]
            pairs = args.pairs if what != "prefill" else max(4, args.pairs // 4)
            print(f"{label}: {pairs_of(call, ways, pairs)}", flush=True)


if __name__ == "__main__":
    main()
