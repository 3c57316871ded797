"""Cross-request K/V storage (no model code)."""

from kvboost_hf.store.keys import chunk_key
from kvboost_hf.store.store import ChunkHit, ChunkStore, StoredChunk

__all__ = ["ChunkHit", "ChunkStore", "StoredChunk", "chunk_key"]
