"""Cross-request K/V storage (no model code)."""

from .keys import chunk_key, model_namespace
from .store import ChunkHit, ChunkStore, StoredChunk

__all__ = ["ChunkHit", "ChunkStore", "StoredChunk", "chunk_key", "model_namespace"]
