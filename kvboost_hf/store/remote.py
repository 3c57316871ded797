"""Remote tier of the ChunkStore on Redis (or Valkey): replicas reuse each other's K/V.

Layout under ``prefix`` (all with a TTL; Redis' own eviction, e.g. ``maxmemory-policy
allkeys-lru``, bounds the memory, and the client never assumes a key is still there):

- ``{prefix}:kv:{bits}:{key}``: the chunk's verified blob (:mod:`.entry_bytes`), one key per
  storage precision (``none``, ``8``, ``4``), so a lossless store never even reads a lossy entry;
- ``{prefix}:next:{parent}:{anchor}``: a hash from each known successor's key to its token ids,
  where ``anchor`` hashes the successor's first ``ANCHOR_TOKENS`` tokens: how a lookup walks a
  chain it has never seen locally, reading only the successors that can match (conversations
  after one shared system prompt do not pile up in one hash). Its token ids are a hint only:
  the matched length always comes from the verified blob;
- ``{prefix}:owned:{owner hash}``: a sorted set naming every live blob and successor entry written
  for an owner, scored by when it expires (what a purge deletes), and ``{prefix}:purges:{owner hash}``:
  how many times the owner was purged. A write is skipped when its entry predates the latest purge
  (a Lua script checks and writes at once); replicas read the count and forget older entries.

Reads are synchronous with short timeouts (they are on the request's path, and cheaper than
recomputing); writes go through a bounded queue to one background thread, never on the
request's path. Any Redis error (down, slow, full, auth) opens a circuit breaker: the tier is
skipped, with a warning and a counter, and retried after a back-off. ``stats()["available"]``
is the outcome of the latest contact, kept current while no request touches the tier by a PING
from the writer thread every ``health_interval_s`` (and at start): a Redis that goes down while
the server is idle reads as unavailable within that interval. A corrupt or foreign blob is
deleted and counted, never loaded. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash

from kvboost_hf.store.codec import StoredChunk, chunk_from_blob, to_tensors
from kvboost_hf.store.entry_bytes import CorruptEntry, decode_entry, encode_entry, precision_of
from kvboost_hf.store.index import common_prefix_length
from kvboost_hf.store.keys import Key
from kvboost_hf.store.remote_guard import CircuitBreaker, redact

logger = logging.getLogger(__name__)

PRECISIONS = (None, 8, 4)  # most precise first
ANCHOR_TOKENS = 8  # successors are filed by their first tokens (at most the chunk size); shorter ones apart
MAX_SUCCESSORS = 64  # successors read per step at most (HSCAN), whatever a hash holds
HEALTH_INTERVAL_S = 2.0  # an idle tier is pinged this often (one PING per replica: negligible load)


def _bits_name(bits: int | None) -> str:
    return "none" if bits is None else str(bits)


# One chunk's write, atomic, unless its owner was purged after the entry's generation (another
# replica's purge overtook a queued write). KEYS: purges, blob, successors, owned (a sorted set of
# what was written for the owner, scored by expiry: members past it are pruned on every write).
# ARGV: generation, blob, key hex, token ids, ttl, the two members.
_WRITE = """
if tonumber(redis.call('GET', KEYS[1]) or '0') > tonumber(ARGV[1]) then return 0 end
local now = tonumber(redis.call('TIME')[1])
local ttl = tonumber(ARGV[5])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ttl)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
redis.call('ZADD', KEYS[4], now + ttl, ARGV[6], now + ttl, ARGV[7])
redis.call('EXPIRE', KEYS[4], ttl)
return 1
"""

# A purge: delete every blob and successor entry named in KEYS[1], then count the purge (KEYS[2]).
_PURGE = """
local removed = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local name = cjson.decode(member)
  if name[1] == 'kv' then
    removed = removed + redis.call('DEL', name[2])
  else
    redis.call('HDEL', name[2], name[3])
  end
end
redis.call('DEL', KEYS[1])
return {removed, redis.call('INCR', KEYS[2])}
"""


def _owner_tag(owner: str | None) -> str:
    return hashlib.blake2b(json.dumps(owner).encode(), digest_size=16).hexdigest()


@dataclass
class _Purge:
    """A purge queued behind the writes before it (the writer thread runs it)."""

    owner: str | None
    done: threading.Event = field(default_factory=threading.Event)
    removed: tuple[int, int] | None = None


class RemoteTier:
    """Chunk blobs in Redis under ``prefix``; every call is bounded and never raises for Redis trouble."""

    name = "remote"

    def __init__(self, url: str, prefix: str = "kvboost", *, ttl_s: int = 7 * 24 * 3600, timeout_s: float = 0.25,
                 max_pending_bytes: int = 64 << 20, anchor_tokens: int = ANCHOR_TOKENS, client=None,
                 health_interval_s: float = HEALTH_INTERVAL_S,
                 accepts: Callable[[int | None], bool] = lambda bits: True) -> None:
        import redis  # noqa: PLC0415 - optional dependency: pip install 'kvboost_hf[redis]'

        self.url = redact(url)
        self.prefix = prefix
        self.accepts = accepts  # which precisions the store may serve: reads take the most precise of them
        self.ttl_s = int(ttl_s)
        self._errors = (redis.RedisError, OSError)
        self._client = client or redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
        )
        self.timeout_s = timeout_s
        self.anchor_tokens = anchor_tokens
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self.breaker = CircuitBreaker()
        self.health_interval_s = health_interval_s
        self._up: bool | None = None  # outcome of the latest contact; None before the first
        self._last_contact = time.monotonic()
        self._last_error: str | None = None
        self.counts = dict.fromkeys(
            ("reads", "hits", "writes", "write_errors", "writes_dropped", "corrupt_dropped", "errors", "skipped"), 0
        )
        self._pending: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvboost-remote-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ keys
    def _kv(self, key: Key, bits: int | None) -> str:
        return f"{self.prefix}:kv:{_bits_name(bits)}:{key.hex()}"

    def _next(self, parent: Key, tokens) -> str:
        """The successor index ``tokens`` (a successor's, or the prompt's from there on) are filed in."""
        if len(tokens) < self.anchor_tokens:
            return self._short(parent)
        anchor = xxhash.xxh3_64_hexdigest(json.dumps(list(tokens[: self.anchor_tokens])).encode())
        return f"{self.prefix}:next:{parent.hex()}:{anchor}"

    def _owned(self, owner: str | None) -> str:
        """The set naming every blob and successor entry written for ``owner`` (what a purge deletes)."""
        return f"{self.prefix}:owned:{_owner_tag(owner)}"

    def _purges(self, owner: str | None) -> str:
        """How many times ``owner`` was purged, by any replica (each replica's RAM follows it)."""
        return f"{self.prefix}:purges:{_owner_tag(owner)}"

    def _short(self, parent: Key) -> str:
        """Successors shorter than the anchor (a lone BOS chunk, a short final chunk)."""
        return f"{self.prefix}:next:{parent.hex()}:short"

    # ------------------------------------------------------------------ guarded calls
    def _call(self, what: str, fn):
        """Run ``fn()`` unless the breaker is open; Redis errors open it and return None."""
        if not self.breaker.allow():
            self.counts["skipped"] += 1
            return None
        try:
            result = fn()
        except self._errors as err:
            was_down = self._up is False
            self._up, self._last_contact = False, time.monotonic()
            self._last_error = f"{type(err).__name__}: {redact(str(err))}"
            wait = self.breaker.failure()
            if wait is None:  # failed alongside the call that opened the breaker
                self.counts["skipped"] += 1
                return None
            self.counts["errors"] += 1
            # A warning when it goes down; while it stays down (retries back off) only debug lines.
            (logger.debug if was_down else logger.warning)(
                "remote store %s unavailable during %s (%s: %s); skipping it for %.0f s",
                self.url, what, type(err).__name__, redact(str(err)), wait)
            return None
        self.breaker.success()
        if self._up is False:
            logger.info("remote store %s is reachable again", self.url)
        self._up, self._last_contact, self._last_error = True, time.monotonic(), None
        return result

    def check(self) -> bool | None:
        """PING Redis now unless the breaker holds the tier off; the tier's availability after it
        (None before any contact)."""
        if self.breaker.allow():
            self._call("health check", self._client.ping)
        return self._up

    # ------------------------------------------------------------------ read
    def successors(self, parent: Key, ids: tuple[int, ...]) -> dict[Key, tuple[int, ...]]:
        """Successors of ``parent`` whose first tokens are those of ``ids`` (at most ``MAX_SUCCESSORS``),
        with the token ids their index entry claims (a hint: never trusted for the match)."""
        names = list(dict.fromkeys([self._next(parent, ids), self._short(parent)]))

        def scan():
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.hscan(name, 0, count=MAX_SUCCESSORS)
            return pipe.execute()

        out = {}
        for name, result in zip(names, self._call("lookup", scan) or []):
            for k, v in list(result[1].items())[:MAX_SUCCESSORS]:
                try:
                    tokens = json.loads(v)
                    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
                        raise ValueError("not a list of token ids")
                    out[bytes.fromhex(k.decode())] = tuple(tokens)
                except (ValueError, TypeError, UnicodeDecodeError):
                    self._call("cleanup", lambda n=name, f=k: self._client.hdel(n, f))  # malformed: drop it
        return out

    def best_successor(self, parent: Key, ids: tuple[int, ...]) -> tuple[Key, int] | None:
        """The successor of ``parent`` whose claimed tokens match the most of ``ids`` (complete chunks win
        ties), and how many tokens its index entry claims to match; None when none matches any."""
        best, best_n = None, 0
        for key, tokens in self.successors(parent, ids).items():
            n = common_prefix_length(tokens, ids)
            if n > best_n or (n == best_n and best is not None and len(tokens) == n):
                best, best_n = key, n
        return None if best is None else (best, best_n)

    def read(self, key: Key, namespace: Key, *, via: tuple[Key, tuple[int, ...]] | None = None) -> StoredChunk | None:
        """The verified entry ``key`` at the most precise precision the store accepts, or None.

        A hit refreshes the TTL of the blob and, given ``via=(parent, token ids)``, of the successor
        index it was found through."""
        return chunk_from_blob(key, self.read_blob(key, namespace, via=via))

    def read_blob(self, key: Key, namespace: Key, *, via: tuple[Key, tuple[int, ...]] | None = None):
        """Verified tensors and metadata of ``key`` (see :meth:`read`), or None: missing, corrupt, or only at
        precisions the store does not accept (then its successor index stays: other stores may use it)."""
        parent, ids = via if via is not None else (None, ())
        wanted = [bits for bits in PRECISIONS if self.accepts(bits)]
        names = [self._kv(key, bits) for bits in wanted]
        blobs = self._call("read", lambda: self._client.mget(names))
        if not blobs:
            return None
        self.counts["reads"] += 1
        for name, bits, blob in zip(names, wanted, blobs):
            if blob is None:
                continue
            try:
                tensors, metadata = decode_entry(key, blob)
                if precision_of(metadata) != bits:
                    raise CorruptEntry("stored under another precision than it holds")
            except CorruptEntry as err:
                self.counts["corrupt_dropped"] += 1
                logger.warning("dropping corrupt remote entry %s: %s", name, err)
                self._call("delete", lambda n=name: self._client.delete(n))
                continue
            if metadata["namespace"] != namespace.hex():  # keys chain from the namespace: only a forged blob
                self.counts["corrupt_dropped"] += 1
                logger.warning("dropping remote entry %s: it belongs to another namespace", name)
                self._call("delete", lambda n=name: self._client.delete(n))
                continue
            self.counts["hits"] += 1
            names = [name] + ([self._next(parent, ids), self._short(parent)] if parent is not None else [])
            owned = self._owned(metadata.get("owner"))
            filed = self._next(bytes.fromhex(metadata["parent"]), tuple(json.loads(metadata["tokens"])))
            members = [json.dumps(["kv", name]), json.dumps(["next", filed, key.hex()])]

            def touch():
                pipe = self._client.pipeline(transaction=False)
                for n in names:
                    pipe.expire(n, self.ttl_s)
                # what a purge must find lives as long as what it names
                pipe.zadd(owned, dict.fromkeys(members, time.time() + self.ttl_s))
                pipe.expire(owned, self.ttl_s)
                return pipe.execute()

            self._call("touch", touch)
            return tensors, metadata
        return None

    def has(self, key: Key) -> bool:
        """Whether a blob of ``key`` exists at a precision the store accepts (False while Redis is down)."""
        names = [self._kv(key, bits) for bits in PRECISIONS if self.accepts(bits)]
        return bool(self._call("has", lambda: self._client.exists(*names)))

    def remove(self, key: Key) -> None:
        """Delete every precision's blob of ``key`` (successor indexes pointing to it are cleaned on use)."""
        names = [self._kv(key, bits) for bits in PRECISIONS]
        self._call("remove", lambda: self._client.delete(*names))

    # ------------------------------------------------------------------ write
    def write(self, entry: StoredChunk) -> bool:
        """Queue ``entry`` for writing (see :meth:`write_async`); False when it is dropped."""
        tensors, metadata = to_tensors(entry)
        return self.write_async(entry.key, entry.parent, entry.token_ids, entry.bits, tensors, metadata)

    def write_async(self, key: Key, parent: Key, token_ids: tuple[int, ...], bits: int | None,
                    tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
        """Queue one chunk for writing; dropped (and counted, False) when the queue is full or the tier is down."""
        if not self.breaker.allow():
            self.counts["skipped"] += 1
            return False
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._pending_lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.counts["writes_dropped"] += 1
                return False
            self._pending_bytes += nbytes
        self._pending.put_nowait((nbytes, (key, parent, token_ids, bits, tensors, metadata)))
        return True

    def _write_loop(self) -> None:
        self.check()
        while True:
            try:
                item = self._pending.get(timeout=self.health_interval_s)
            except queue.Empty:  # idle: keep "available" true to what Redis does now
                if time.monotonic() - self._last_contact >= self.health_interval_s:
                    self.check()
                continue
            try:
                if item is None:
                    return
                nbytes, args = item
                if isinstance(args, _Purge):
                    args.removed = self._purge(args.owner)
                    args.done.set()
                    continue
                self._write(*args)
                with self._pending_lock:
                    self._pending_bytes -= nbytes
            finally:
                self._pending.task_done()

    def _write(self, key, parent, token_ids, bits, tensors, metadata) -> None:
        blob = encode_entry(key, tensors, metadata)
        owner = metadata.get("owner")
        kv, successors = self._kv(key, bits), self._next(parent, token_ids)
        names = [self._purges(owner), kv, successors, self._owned(owner)]
        args = [metadata.get("generation", "0"), blob, key.hex(), json.dumps(list(token_ids)), self.ttl_s,
                json.dumps(["kv", kv]), json.dumps(["next", successors, key.hex()])]
        written = self._call("write", lambda: self._client.eval(_WRITE, len(names), *names, *args))
        if written is None:
            self.counts["write_errors"] += 1
        elif int(written) == 0:
            self.counts["writes_dropped"] += 1  # its owner was purged after it was stored: not written
        else:
            self.counts["writes"] += 1

    def purge(self, owner: str | None, timeout_s: float = 5.0) -> tuple[int, int] | None:
        """Delete every blob and successor entry written for ``owner``, after the writes queued before this
        call (queued in this process: they run first, then go), and count the purge for every replica
        (:meth:`purges`); ``(blobs deleted, purges so far)``, or None when Redis could not be purged
        (down, or no answer within ``timeout_s``)."""
        job = _Purge(owner)
        self._pending.put_nowait((0, job))
        if not job.done.wait(timeout_s):
            return None
        return job.removed

    def purges(self, owner: str | None) -> int | None:
        """How many times ``owner`` was purged in this Redis (None while it does not answer)."""
        value = self._call("purge count", lambda: self._client.get(self._purges(owner)))
        if value is None and self._up is False:
            return None
        try:
            return int(value or 0)
        except ValueError:
            return 0

    def _purge(self, owner: str | None) -> tuple[int, int] | None:
        names = [self._owned(owner), self._purges(owner)]
        done = self._call("purge", lambda: self._client.eval(_PURGE, len(names), *names))
        return None if done is None else (int(done[0]), int(done[1]))

    def forget_successor(self, parent: Key, ids: tuple[int, ...], key: Key) -> None:
        """Drop a successor entry that points nowhere useful (its blob is gone, or it lied about its tokens)."""
        self._call("cleanup", lambda: self._client.hdel(self._next(parent, ids), key.hex()))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued writes are done (tests, benchmarks, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        self.flush(timeout_s=2.0)
        self._pending.put_nowait(None)

    def stats(self) -> dict:
        """Counters, queued writes, and ``available``: whether the latest contact succeeded (None before
        the first; false while the breaker holds the tier off), with ``last_error`` while it is down."""
        available = None if self._up is None else self._up and not self.breaker.is_open
        return {**self.counts, "pending_writes": self._pending.unfinished_tasks, "pending_bytes": self._pending_bytes,
                "available": available, "last_error": None if available else self._last_error}
