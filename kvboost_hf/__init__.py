"""kvboost_hf: cross-request KV-cache reuse for Hugging Face transformers.

Importing the package loads torch, transformers' modeling code (the attention registration below
needs it) and the reuse core; speculative decoding (and the AWQ streaming it builds on), the server
and its dependencies (FastAPI, xgrammar), Redis and matplotlib load when first used.
"""

import importlib
from typing import Any

from kvboost_hf.cache import ChunkReuseCache, KIVICache, ReuseStats
from kvboost_hf.generation import (
    disable_chunk_reuse,
    enable_chunk_reuse,
    is_chunk_reuse_enabled,
    last_request_stats,
    register_extension,
    warm,
)
from kvboost_hf.models import attention
from kvboost_hf.models.namespace import refresh_namespace
from kvboost_hf.store import ChunkStore

__version__ = "0.1.0"

# `kvboost_sdpa` (used by recompute_strategy="cacheblend") is known as soon as kvboost_hf is
# imported, so a pickled cacheblend-enabled model loads in any process that imports kvboost_hf.
attention.register()

# The package's entry point wires the capabilities above the generation layer into it: speculative
# decoding joins generate calls as an extension, imported on the first generate (not here).
register_extension("speculation", lambda: importlib.import_module("kvboost_hf.speculative.extension").EXTENSION)

# Public names imported on first use: {name: module}.
_LAZY = {"ControllerSettings": ".speculative", "SpeculationStats": ".speculative", "make_draft": ".speculative",
         "make_head_draft": ".speculative"}


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
    "make_head_draft",
    "ControllerSettings",
    "SpeculationStats",
    "refresh_namespace",
    "warm",
]
