"""The self-verifying byte form of a stored chunk, shared by the disk tier and the remote tier.

One safetensors blob per chunk: tensors plus string metadata holding the chunk key, its parent,
the namespace, its token ids, its storage precision and a checksum over tensors and metadata.
A blob is only ever used after the checksum matches *and* its key equals
``chunk_key(parent, token_ids)`` *and* that key is the one it was stored under.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvboost_hf.store.keys import Key, chunk_key

FORMAT = "kvboost-chunk-1"
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"


class CorruptEntry(Exception):
    """A stored entry failed verification."""


@dataclass
class DiskRecord:
    """What the store needs to know about a stored chunk without loading its tensors."""

    key: Key
    parent: Key
    namespace: Key
    token_ids: tuple[int, ...]
    nbytes: int
    start: int = 0
    bits: int | None = None  # storage precision: None = the model's own dtype (lossless)
    pinned: bool = False
    owner: str | None = None
    generation: int = 0


def precision_of(metadata: dict[str, str]) -> int | None:
    """Storage bits of an entry from its metadata (None: lossless)."""
    if "kv_bits" in metadata:
        return None if metadata["kv_bits"] == "none" else int(metadata["kv_bits"])
    quantized = json.loads(metadata.get("quantized") or "{}")  # files written before kv_bits existed
    return min((spec[0] for spec in quantized.values()), default=None)


def record_of(key: Key, meta: dict[str, str], nbytes: int) -> DiskRecord:
    """The record of a blob stored under ``key``; CorruptEntry unless it is well formed and names the same key.

    Headers are untrusted input (a file or a Redis value anyone may have written): every field is
    type-checked, and any parsing failure is a CorruptEntry, never another exception.
    """
    try:
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("key") != key.hex():
            raise CorruptEntry("wrong format, or the blob holds another entry than its name says")
        parent, tokens = bytes.fromhex(meta["parent"]), json.loads(meta["tokens"])
        if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
            raise CorruptEntry("token ids are not a list of ints")
        tokens = tuple(tokens)
        if chunk_key(parent, tokens) != key:
            raise CorruptEntry("key does not match its parent and tokens")
        return DiskRecord(
            key=key, parent=parent, namespace=bytes.fromhex(meta["namespace"]), token_ids=tokens, nbytes=nbytes,
            start=int(meta.get("start", 0)), bits=precision_of(meta), pinned=meta.get("pinned") == "1",
            owner=_owner_of(meta), generation=int(meta.get("generation", 0)),
        )
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as err:
        raise CorruptEntry(f"malformed header: {type(err).__name__}: {err}") from err


def _owner_of(meta: dict) -> str | None:
    owner = meta.get("owner")
    if owner is not None and (not isinstance(owner, str) or not owner):
        raise CorruptEntry("owner is not a non-empty string")
    return owner


def checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    for name in sorted(metadata):
        if name != "checksum":
            h.update(f"{name}={metadata[name]}".encode())
    return h.hexdigest()


def read_header(data: bytes) -> dict:
    if len(data) < 8:
        raise CorruptEntry("file shorter than its header")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise CorruptEntry("header length out of range")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as err:
        raise CorruptEntry(f"unreadable header: {err}") from err
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise CorruptEntry("header is not a safetensors header")
    return header


def encode_entry(key: Key, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The blob of chunk ``key`` (metadata from :func:`~.codec.to_tensors`), with format, key and checksum."""
    metadata = dict(metadata, format=FORMAT, key=key.hex())
    metadata["checksum"] = checksum(tensors, metadata)
    return save_safetensors({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def decode_entry(key: Key, data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Verified tensors and metadata of a blob stored under ``key``; :class:`CorruptEntry` otherwise."""
    try:
        metadata = read_header(data).get("__metadata__") or {}
        record_of(key, metadata, len(data))
        try:
            tensors = load_safetensors(data)
        except Exception as err:  # safetensors raises its own error types on bad payloads
            raise CorruptEntry(f"unreadable tensors: {err}") from err
        if checksum(tensors, metadata) != metadata.get("checksum"):
            raise CorruptEntry("checksum mismatch")
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        raise CorruptEntry(f"malformed metadata: {type(err).__name__}: {err}") from err
    return tensors, metadata
