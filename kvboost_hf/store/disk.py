"""Persistent tier of the ChunkStore: one safetensors file per chunk, checksummed, atomically written.

Every file is self-describing: its metadata holds the chunk key, its parent, the namespace, its
token ids and a checksum over tensors and metadata. A file is only ever used after the checksum
matches *and* its key equals ``chunk_key(parent, token_ids)``; anything else is deleted and
counted as ``corrupt_dropped``. Writes go to a temporary file renamed into place, and a file lock
serialises writers and deletions across processes sharing the directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .keys import Key, chunk_key

logger = logging.getLogger(__name__)

FORMAT = "kvboost-chunk-1"
SUFFIX = ".safetensors"


class CorruptEntry(Exception):
    """A disk entry failed verification."""


@dataclass
class DiskRecord:
    """What the store needs to know about a chunk on disk without loading its tensors."""

    key: Key
    parent: Key
    namespace: Key
    token_ids: tuple[int, ...]
    nbytes: int


def _checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
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


def _read_header(data: bytes) -> dict:
    if len(data) < 8:
        raise CorruptEntry("file shorter than its header")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise CorruptEntry("header length out of range")
    try:
        return json.loads(data[8 : 8 + n])
    except ValueError as err:
        raise CorruptEntry(f"unreadable header: {err}") from err


class DiskTier:
    """Chunk files under ``path``, at most ``max_bytes`` in total (least recently used go first)."""

    def __init__(self, path: str | os.PathLike, max_bytes: int) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            raise ValueError(f"disk_path {str(path)!r} is not a writable directory: {err}") from err
        self.max_bytes = max_bytes
        self.lock = FileLock(str(self.path / ".lock"))
        self.reads = self.writes = self.corrupt_dropped = 0

    def file_for(self, key: Key) -> Path:
        return self.path / f"{key.hex()}{SUFFIX}"

    def has(self, key: Key) -> bool:
        return self.file_for(key).exists()

    # ------------------------------------------------------------------ write
    def write(self, key: Key, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
        """Write one entry atomically; returns its size in bytes (0 when it does not fit)."""
        metadata = dict(metadata, format=FORMAT, key=key.hex())
        metadata["checksum"] = _checksum(tensors, metadata)
        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
        if len(data) > self.max_bytes:
            return 0
        target = self.file_for(key)
        with self.lock:
            self._make_room(len(data))
            tmp = self.path / f".tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        self.writes += 1
        return len(data)

    def _make_room(self, nbytes: int) -> None:
        files = [(p.stat(), p) for p in self.path.glob(f"*{SUFFIX}")]
        total = sum(st.st_size for st, _ in files)
        for st, p in sorted(files, key=lambda item: item[0].st_mtime):
            if total + nbytes <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= st.st_size
            logger.debug("disk tier evicted %s", p.name)

    # ------------------------------------------------------------------ read
    def read(self, key: Key, namespace: Key) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """Verified tensors and metadata of ``key``, or None (missing, corrupt or another namespace)."""
        target = self.file_for(key)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            return None
        try:
            metadata = _read_header(data).get("__metadata__") or {}
            if metadata.get("format") != FORMAT or metadata.get("key") != key.hex():
                raise CorruptEntry("wrong format or key")
            try:
                tensors = load_safetensors(data)
            except Exception as err:  # safetensors raises its own error types on bad payloads
                raise CorruptEntry(f"unreadable tensors: {err}") from err
            if _checksum(tensors, metadata) != metadata.get("checksum"):
                raise CorruptEntry("checksum mismatch")
            parent = bytes.fromhex(metadata["parent"])
            if chunk_key(parent, json.loads(metadata["tokens"])) != key:
                raise CorruptEntry("key does not match its parent and tokens")
        except (CorruptEntry, KeyError, ValueError) as err:
            self.drop_corrupt(target, str(err))
            return None
        if metadata["namespace"] != namespace.hex():
            return None
        self.reads += 1
        try:
            os.utime(target)  # recency for the disk tier's LRU
        except OSError:
            pass
        return tensors, metadata

    def drop_corrupt(self, target: Path, why: str) -> None:
        logger.warning("dropping corrupt disk entry %s: %s", target.name, why)
        with self.lock:
            target.unlink(missing_ok=True)
        self.corrupt_dropped += 1

    def keys(self) -> set[Key]:
        """Keys of every entry file present now."""
        out = set()
        for p in self.path.glob(f"*{SUFFIX}"):
            try:
                out.add(bytes.fromhex(p.name[: -len(SUFFIX)]))
            except ValueError:
                continue
        return out

    def records(self, keys: set[Key]) -> list[DiskRecord]:
        """Headers of the entries ``keys`` (missing ones are skipped, corrupt ones dropped)."""
        out = []
        for p in (self.file_for(k) for k in keys):
            try:
                with open(p, "rb") as f:
                    head = f.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else -1
                    if n <= 0 or n > 100_000_000:
                        raise CorruptEntry("bad header length")
                    header = _read_header(head + f.read(n))
                meta = header.get("__metadata__") or {}
                out.append(
                    DiskRecord(
                        key=bytes.fromhex(meta["key"]),
                        parent=bytes.fromhex(meta["parent"]),
                        namespace=bytes.fromhex(meta["namespace"]),
                        token_ids=tuple(json.loads(meta["tokens"])),
                        nbytes=p.stat().st_size,
                    )
                )
            except FileNotFoundError:
                continue
            except (CorruptEntry, KeyError, ValueError, OSError) as err:
                self.drop_corrupt(p, str(err))
        return out

    def remove(self, key: Key) -> None:
        with self.lock:
            self.file_for(key).unlink(missing_ok=True)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.glob(f"*{SUFFIX}") if p.exists())

    def stamp(self) -> float:
        """Changes whenever files are added or removed (directory mtime)."""
        try:
            return self.path.stat().st_mtime
        except OSError:
            return time.time()
