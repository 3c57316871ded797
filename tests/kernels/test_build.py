"""Building, ISA choice and the no-compiler fallback, each in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvboost_hf import kernels

PROBE = (
    "import json, logging, io\n"
    "log = io.StringIO(); logging.basicConfig(stream=log, level=logging.WARNING)\n"
    "from kvboost_hf import kernels\n"
    "s = kernels.available(); kernels.available()\n"
    "print(json.dumps({'built': s.built, 'isa': s.isa, 'reason': s.reason, 'log': log.getvalue()}))\n"
)


def probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_a_compiler_it_says_why_once_and_torch_kernels_remain(tmp_path: Path):
    got = probe(CXX=str(tmp_path / "no-such-g++"), KVBOOST_HF_CACHE=str(tmp_path))
    assert got["built"] is False and "no C++ compiler" in got["reason"]
    assert got["log"].count("kernels unavailable") == 1


def test_disabled_by_the_environment(tmp_path: Path):
    got = probe(KVBOOST_HF_KERNELS="0", KVBOOST_HF_CACHE=str(tmp_path))
    assert got["built"] is False and "KVBOOST_HF_KERNELS=0" in got["reason"]


def test_the_path_follows_aten_cpu_capability(built):
    levels = kernels.ISA_LEVELS
    best = levels.index(built.host_isa)
    assert probe(ATEN_CPU_CAPABILITY="avx2")["isa"] == levels[min(best, 1)]
    assert probe(ATEN_CPU_CAPABILITY="default")["isa"] == "scalar"
    assert probe(KVBOOST_HF_KERNEL_ISA="scalar")["isa"] == "scalar"
    assert built.isa == levels[min(best, levels.index(kernels.ops.default_isa()))]
