"""Content keys for stored K/V: token chunking and chained prefix hashes.

A chunk key is ``H(parent_key, token_ids)``; the root of every chain is a namespace key built
from a description of whatever produced the K/V (for a transformers model:
:func:`kvboost_hf.models.fingerprint.model_namespace`). Same tokens under another namespace never
collide. Nothing here knows about models.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

Key = bytes

_DIGEST_SIZE = 16


def _digest(*parts: bytes) -> Key:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Canonical byte form of a token id sequence (int64, little endian)."""
    return array("q", token_ids).tobytes()


def chunk_key(parent: Key, token_ids: Sequence[int]) -> Key:
    """Key of a chunk given the key of the chunk before it (or the namespace key)."""
    return _digest(b"chunk", parent, token_bytes(token_ids))


def chunk_spans(num_tokens: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each chunk of a sequence; the last one may be shorter."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    for start in range(0, num_tokens, chunk_size):
        yield start, min(start + chunk_size, num_tokens)


def namespace_key(parts: dict[str, Any]) -> Key:
    """Root key of a prefix chain from a JSON-serialisable description of the K/V producer."""
    return _digest(b"namespace", json.dumps(parts, sort_keys=True, default=str).encode())


def salted(namespace: Key, salt: str | None) -> Key:
    """The root of the chains of requests that carry ``salt`` (``namespace`` itself without one): entries
    under one salt are unreachable under another, or under none, in every tier."""
    if salt is None:
        return namespace
    return _digest(b"salt", namespace, salt.encode())


def owned(root: Key, owner: str | None) -> Key:
    """The root of ``owner``'s chains under ``root`` (``root`` itself without one): two owners never share
    an entry, so one's eviction or purge never strands the other's successors."""
    if owner is None:
        return root
    return _digest(b"owner", root, owner.encode())


def switch_root(shared_key: Key, root: Key) -> Key:
    """The root a chain of ``root`` continues from after the shared chunk ``shared_key``: what follows a
    shared prefix stays in ``root``'s scope (another root never reaches it through the shared chunk)."""
    return _digest(b"switch", shared_key, root)


def segment_spans(num_tokens: int, chunk_size: int, boundaries: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Chunk spans that start a new chunk at every boundary (segment start) and every ``chunk_size`` tokens inside a segment."""
    starts = sorted({b for b in boundaries if 0 < b < num_tokens} | {0}) if num_tokens else []
    spans: list[tuple[int, int]] = []
    for seg_start, seg_end in zip(starts, [*starts[1:], num_tokens]):
        spans.extend((seg_start + s, seg_start + e) for s, e in chunk_spans(seg_end - seg_start, chunk_size))
    return spans


def prefix_keys(root: Key, token_ids: Sequence[int], chunk_size: int, boundaries: Sequence[int] = ()) -> list[Key]:
    """The chained keys a store gives the chunks of ``token_ids`` under ``root`` (chunks start at
    ``boundaries`` and every ``chunk_size`` tokens inside a segment, as ``ChunkStore.insert`` cuts
    them): a replica holding the first ``n`` of them holds that prompt's first ``n`` chunks exactly."""
    keys, parent = [], root
    for start, end in segment_spans(len(token_ids), chunk_size, boundaries):
        parent = chunk_key(parent, token_ids[start:end])
        keys.append(parent)
    return keys

