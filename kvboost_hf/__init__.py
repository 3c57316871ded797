"""kvboost_hf: cross-request KV-cache reuse for Hugging Face transformers.

Importing the package loads torch, transformers' modeling code (the attention registration below
needs it) and the reuse core; speculative decoding (and the AWQ streaming it builds on), the server
and its dependencies (FastAPI, xgrammar), Redis and matplotlib load when first used.
"""

import importlib
from typing import Any

from kvboost_hf import attention
from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.quantized_cache import KIVICache
from kvboost_hf.reuse import disable_chunk_reuse, enable_chunk_reuse, is_chunk_reuse_enabled, last_request_stats
from kvboost_hf.state import refresh_namespace
from kvboost_hf.store import ChunkStore
from kvboost_hf.telemetry import ReuseStats
from kvboost_hf.warm import warm

__version__ = "0.1.0"

# `kvboost_sdpa` (used by recompute_strategy="cacheblend") is known as soon as kvboost_hf is
# imported, so a pickled cacheblend-enabled model loads in any process that imports kvboost_hf.
attention.register()

# Public names imported on first use: {name: module}.
_LAZY = {"ControllerSettings": ".speculative", "SpeculationStats": ".speculative", "make_draft": ".speculative"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ChunkReuseCache",
    "ChunkStore",
    "KIVICache",
    "ReuseStats",
    "disable_chunk_reuse",
    "enable_chunk_reuse",
    "is_chunk_reuse_enabled",
    "last_request_stats",
    "make_draft",
    "ControllerSettings",
    "SpeculationStats",
    "refresh_namespace",
    "warm",
]
