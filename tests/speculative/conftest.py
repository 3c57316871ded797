"""Helpers of the speculative tests: reuse enabled on a model for one test, then disabled again."""

from __future__ import annotations

import pytest

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse
from tests.conftest import torch_threads


@pytest.fixture
def reuse():
    """``reuse(model, chunk_size=8)`` enables chunk reuse with a fresh store; disabled after the test."""
    enabled = []

    def enable(model, chunk_size: int = 8, store: ChunkStore | None = None):
        store = store or ChunkStore(max_bytes=50_000_000, chunk_size=chunk_size)
        enable_chunk_reuse(model, store)
        enabled.append(model)
        return store

    yield enable
    for model in enabled:
        disable_chunk_reuse(model)


@pytest.fixture
def one_thread():
    """One torch thread for tests of many tiny forwards (~10x faster than two on a shared machine)."""
    with torch_threads(1):
        yield
