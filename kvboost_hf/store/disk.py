"""Persistent tier of the ChunkStore: one safetensors file per chunk, checksummed, atomically written.

Every file is self-describing: its metadata holds the chunk key, its parent, the namespace, its
token ids, its storage precision and a checksum over tensors and metadata. A file is only ever
used after the checksum matches *and* its key equals ``chunk_key(parent, token_ids)`` *and* the
file's name is that key; anything else is deleted (in a read-only tier: ignored) and counted as
``corrupt_dropped``. Writes go to a temporary file renamed into place, and a file lock serialises
writers and deletions across processes sharing the directory; temporary files left by a writer
that died are reclaimed under that lock. The byte budget is kept with the same chain-aware
policy as RAM (:mod:`.eviction`), decided from the files themselves, so every process sharing
the directory applies it alike.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import torch
from filelock import FileLock

from kvboost_hf.store.codec import StoredChunk, chunk_from_blob, to_tensors
from kvboost_hf.store.entry_bytes import CorruptEntry, DiskRecord, decode_entry, encode_entry, read_header, record_of
from kvboost_hf.store.eviction import DISK_HALF_LIFE_S, Candidate, choose_victims, recompute_cost
from kvboost_hf.store.keys import Key

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"


class DiskTier:
    """Chunk files under ``path``, at most ``max_bytes`` in total (temporary files included).

    ``read_only=True`` never writes, creates, touches or deletes anything, so a directory on
    read-only media can be served: corrupt files are skipped (and counted), not deleted.
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike, max_bytes: int, read_only: bool = False) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.read_only = read_only
        self.reads = self.writes = self.corrupt_dropped = self.temp_reclaimed = 0
        self._headers: dict[Key, tuple[tuple[int, int], DiskRecord]] = {}  # key -> ((inode, size), record)
        self._bad: dict[Key, tuple[int, int]] = {}  # corrupt files a read-only tier keeps skipping
        self.quotas: dict[str, int] = {}  # owner -> bytes of its files (the store sets it, as for RAM)
        self.lock = FileLock(str(self.path / ".lock"))
        if read_only:
            if not self.path.is_dir():
                raise ValueError(f"disk_path {str(path)!r} is not a directory (a read-only store does not create one)")
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            raise ValueError(
                f"disk_path {str(path)!r} is not a writable directory: {err} (read_only=True serves it without writing)"
            ) from err
        with self.lock:
            self._reclaim_temp_files()

    def file_for(self, key: Key) -> Path:
        return self.path / f"{key.hex()}{SUFFIX}"

    def has(self, key: Key) -> bool:
        return key not in self._bad and self.file_for(key).exists()

    # ------------------------------------------------------------------ write
    def write(self, entry: StoredChunk) -> bool:
        """Write ``entry``'s file (see :meth:`write_blob`); False when it is not written."""
        return bool(self.write_blob(entry.key, *to_tensors(entry)))

    def write_blob(self, key: Key, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
        """Write one entry atomically; returns its size in bytes, or 0 when it is not written: the
        tier is read-only, its parent chunk has no file (it would be unreachable), or no room can
        be made without evicting its own chain (the chain-aware policy never does that).
        """
        parent = bytes.fromhex(metadata["parent"])
        if self.read_only or (metadata["parent"] != metadata["namespace"] and not self.has(parent)):
            return 0
        data = encode_entry(key, tensors, metadata)
        if len(data) > self.max_bytes:
            return 0
        target = self.file_for(key)
        try:
            with self.lock:
                old = target.stat().st_size if target.exists() else 0
                if not self._make_room(len(data) - old, keep={key, parent}, owner=metadata.get("owner")):
                    return 0
                tmp = self.path / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
        except OSError as err:
            logger.warning("disk tier write failed (%s); the chunk stays in RAM only", err)
            return 0
        self.writes += 1
        return len(data)

    def _reclaim_temp_files(self) -> int:
        """Delete temporary files (call with the lock held: then no writer is alive mid-write)."""
        freed = 0
        for tmp in self.path.glob(f"{TMP_PREFIX}*"):
            try:
                size = tmp.stat().st_size
                tmp.unlink()
            except OSError:
                continue
            freed += size
            self.temp_reclaimed += 1
            logger.info("reclaimed %s (%d bytes) left by a writer that died mid-write", tmp.name, size)
        return freed

    def _make_room(self, nbytes: int, keep: set[Key], owner: str | None = None) -> bool:
        """Delete files until ``nbytes`` more of ``owner``'s fit: within the owner's own files first when
        it has a quota, then (over ``max_bytes``) files of owners without a quota; another quota'd owner's
        only for an owner with a quota (quotas that add up to more than the budget)."""
        self._reclaim_temp_files()
        records = self.records(self.keys())
        quota = self.quotas.get(owner) if owner is not None else None
        if quota is not None:
            own = [r for r in records if r.owner == owner]
            need = sum(r.nbytes for r in own) + nbytes - quota
            if need > 0 and not self._evict(own, need, keep):
                return False
            records = self.records(self.keys())
        need = sum(r.nbytes for r in records) + nbytes - self.max_bytes
        if need <= 0:
            return True
        unquotad = [r for r in records if r.owner not in self.quotas]
        return self._evict(unquotad, need, keep) or (quota is not None and self._evict(records, need, keep))

    def _evict(self, records: list[DiskRecord], need: int, keep: set[Key]) -> bool:
        """Delete files among ``records`` freeing ``need`` bytes (chain-aware, :mod:`.eviction`); False,
        deleting nothing, when that is impossible without touching ``keep``."""
        now = time.time()
        candidates = []
        for r in records:
            try:
                age = max(0.0, now - self.file_for(r.key).stat().st_mtime)
            except OSError:
                age = 0.0
            value = recompute_cost(r.start, len(r.token_ids)) / r.nbytes * 0.5 ** (age / DISK_HALF_LIFE_S)
            candidates.append(Candidate(r.key, r.parent, r.namespace, r.nbytes, value, r.pinned))
        victims = choose_victims(candidates, need, keep)
        if victims is None:
            return False
        for key in victims:
            self.file_for(key).unlink(missing_ok=True)
            self._headers.pop(key, None)
            logger.debug("disk tier evicted %s", key.hex())
        return True

    def touch(self, keys: list[Key]) -> None:
        """Mark entries as just used (their mtime is the disk tier's recency, shared across processes)."""
        if self.read_only:
            return
        for key in keys:
            try:
                os.utime(self.file_for(key))
            except OSError:
                pass

    # ------------------------------------------------------------------ read
    def read(self, key: Key, namespace: Key) -> StoredChunk | None:
        """The verified entry ``key``, or None (missing, corrupt, another namespace, or not decodable)."""
        return chunk_from_blob(key, self.read_blob(key, namespace))

    def read_blob(self, key: Key, namespace: Key) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """Verified tensors and metadata of ``key``, or None (missing, corrupt or another namespace)."""
        if key in self._bad:
            return None
        target = self.file_for(key)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            return None
        try:
            tensors, metadata = decode_entry(key, data)
        except CorruptEntry as err:
            self.drop_corrupt(target, key, str(err))
            return None
        if metadata["namespace"] != namespace.hex():
            return None
        self.reads += 1
        self.touch([key])
        return tensors, metadata

    def drop_corrupt(self, target: Path, key: Key, why: str) -> None:
        self.corrupt_dropped += 1
        self._headers.pop(key, None)
        if self.read_only:
            logger.warning("skipping corrupt disk entry %s (read-only store, not deleted): %s", target.name, why)
            try:
                st = target.stat()
                self._bad[key] = (st.st_ino, st.st_size)
            except OSError:
                pass
            return
        logger.warning("dropping corrupt disk entry %s: %s", target.name, why)
        with self.lock:
            target.unlink(missing_ok=True)

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
        """Verified headers of the entries ``keys`` (missing ones skipped, corrupt ones dropped).

        Headers are cached per file (inode and size): a file is only parsed again once replaced.
        """
        out = []
        for key in keys:
            p = self.file_for(key)
            try:
                st = p.stat()
                ident = (st.st_ino, st.st_size)
                if self._bad.get(key) == ident:
                    continue
                cached = self._headers.get(key)
                if cached is not None and cached[0] == ident:
                    out.append(cached[1])
                    continue
                with open(p, "rb") as f:
                    head = f.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else -1
                    if n <= 0 or n > 100_000_000:
                        raise CorruptEntry("bad header length")
                    header = read_header(head + f.read(n))
                record = record_of(key, header.get("__metadata__") or {}, st.st_size)
                self._headers[key] = (ident, record)
                out.append(record)
            except FileNotFoundError:
                continue
            except (CorruptEntry, KeyError, ValueError, OSError) as err:
                self.drop_corrupt(p, key, str(err))
        return out

    def owned(self, owner: str | None) -> list[Key]:
        """Keys of the files charged to ``owner``."""
        return [r.key for r in self.records(self.keys()) if r.owner == owner]

    def remove(self, key: Key) -> None:
        if self.read_only:
            return
        self._headers.pop(key, None)
        with self.lock:
            self.file_for(key).unlink(missing_ok=True)

    def nbytes(self) -> int:
        """Bytes of every entry and temporary file in the directory."""
        total = 0
        for pattern in (f"*{SUFFIX}", f"{TMP_PREFIX}*"):
            for p in self.path.glob(pattern):
                try:
                    total += p.stat().st_size
                except OSError:
                    continue
        return total

    def stamp(self) -> float:
        """Changes whenever files are added or removed (directory mtime)."""
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return time.time()

    def close(self) -> None:
        pass  # every write is finished (and atomic) when write() returns

    def stats(self) -> dict:
        return {"entries": len(self.keys()), "bytes": self.nbytes(), "reads": self.reads, "writes": self.writes,
                "corrupt_dropped": self.corrupt_dropped, "temp_files_reclaimed": self.temp_reclaimed}
