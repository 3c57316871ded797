"""kvboost_hf: cross-request KV-cache reuse for Hugging Face transformers."""

from . import attention
from .cache import ChunkReuseCache
from .quantized_cache import KIVICache
from .reuse import disable_chunk_reuse, enable_chunk_reuse, is_chunk_reuse_enabled, last_request_stats
from .speculative import ControllerSettings, SpeculationStats, make_draft
from .state import refresh_namespace
from .store import ChunkStore
from .telemetry import ReuseStats
from .warm import warm

__version__ = "0.1.0"

# `kvboost_sdpa` (used by recompute_strategy="cacheblend") is known as soon as kvboost_hf is
# imported, so a pickled cacheblend-enabled model loads in any process that imports kvboost_hf.
attention.register()

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
