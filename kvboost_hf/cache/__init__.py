"""Per-request K/V caches (transformers ``Cache`` subclasses) and per-request reuse statistics.

:class:`ChunkReuseCache` holds a request's K/V and feeds the shared :class:`~kvboost_hf.store.ChunkStore`;
:class:`KIVICache` is a quantized live cache; :class:`BufferedCache` a ``DynamicCache`` that appends in place
(the same K/V, no copy of the history per step). Sits on :mod:`kvboost_hf.store` only.
"""

from kvboost_hf.cache.buffer import BufferedCache
from kvboost_hf.cache.chunk_reuse import ChunkReuseCache
from kvboost_hf.cache.kivi import KIVICache
from kvboost_hf.cache.stats import ReuseStats

__all__ = ["BufferedCache", "ChunkReuseCache", "KIVICache", "ReuseStats"]
