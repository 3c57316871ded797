"""API keys and the tenants they belong to (``kvboost-hf serve --api-keys FILE``).

FILE is JSON: ``{"<key>": {"tenant": "<name>", "store_bytes": <int, optional>, "admin": <bool, optional>}}``.
A tenant's entries in the store are its own (its name is the owner of its chains), capped at
``store_bytes`` in RAM and on disk. Keys are never logged, counted or echoed: a malformed file is
described by entry number, and only SHA-256 digests of keys are kept, compared in constant time
against every entry. The file is re-read by :meth:`KeyRing.reload` (``SIGHUP``); a file that does not
parse then keeps the keys in force.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a metrics label and a store owner
_FIELDS = {"tenant", "store_bytes", "admin"}


class KeyFileError(ValueError):
    """The API key file cannot be used (missing, not JSON, or an entry that breaks the format)."""


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name and the bytes its own store entries may hold (None: no quota)."""

    name: str
    store_bytes: int | None = None


@dataclass(frozen=True)
class Grant:
    """What a presented key is allowed: its tenant, and whether it is an admin key."""

    tenant: Tenant
    admin: bool
    digest: bytes  # the key's SHA-256: never the key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_key_file(text: str, source: str = "the API key file") -> list[Grant]:
    """The grants of a key file's JSON text; :class:`KeyFileError` naming what to change (never a key)."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise KeyFileError(f"{source} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or not data:
        raise KeyFileError(f'{source} must be a JSON object of at least one key: {{"<key>": {{"tenant": "<name>"}}}}')
    grants, quotas = [], {}
    for number, (key, spec) in enumerate(data.items(), start=1):
        where = f"{source}, entry {number}"
        if not key.strip() or key != key.strip():
            raise KeyFileError(f"{where}: a key must be non-empty, without leading or trailing spaces")
        if not isinstance(spec, dict):
            raise KeyFileError(f'{where}: the value must be an object such as {{"tenant": "<name>"}}')
        unknown = set(spec) - _FIELDS
        if unknown:
            raise KeyFileError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}")
        name = spec.get("tenant")
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
            raise KeyFileError(f"{where}: 'tenant' must be 1-64 characters of letters, digits, '.', '_' or '-', "
                               f"starting with a letter or digit, got {name!r}")
        quota = spec.get("store_bytes")
        if quota is not None and (type(quota) is not int or quota < 1):
            raise KeyFileError(f"{where}: 'store_bytes' must be a positive integer (bytes), got {quota!r}")
        admin = spec.get("admin", False)
        if type(admin) is not bool:
            raise KeyFileError(f"{where}: 'admin' must be true or false, got {admin!r}")
        if quotas.setdefault(name, quota) != quota:
            raise KeyFileError(f"{where}: tenant {name!r} has another 'store_bytes' in an earlier entry; "
                               "give every key of a tenant the same quota")
        grants.append(Grant(Tenant(name, quota), admin, _digest(key)))
    return grants


def bearer_token(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header value (None for another scheme or none)."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class KeyRing:
    """The keys in force, read from ``path`` (at start, and again on :meth:`reload`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._grants = self._read()

    def _read(self) -> list[Grant]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise KeyFileError(f"cannot read the API key file {str(self.path)!r}: {type(err).__name__}") from None
        return parse_key_file(text, f"API key file {str(self.path)!r}")

    def reload(self) -> bool:
        """Read the file again; on any problem keep the keys in force, log why, and return False."""
        try:
            grants = self._read()
        except KeyFileError as err:
            logger.error("API keys not reloaded, the previous ones stay in force: %s", err)
            return False
        with self._lock:
            self._grants = grants
        logger.info("API keys reloaded: %d keys, %d tenants", len(grants), len(self.tenants()))
        return True

    def grant_for(self, key: str) -> Grant | None:
        """The grant of ``key``, or None; the time taken does not depend on which key matched or how much of it."""
        digest = _digest(key)
        with self._lock:
            grants = self._grants
        found = None
        for grant in grants:  # every entry is compared, whatever matched
            if hmac.compare_digest(grant.digest, digest):
                found = grant
        return found

    def is_current(self, grant: Grant) -> bool:
        """Whether ``grant``'s key is still in force with the same tenant and role (not removed by a reload)."""
        with self._lock:
            return grant in self._grants

    def tenants(self) -> dict[str, Tenant]:
        """Every tenant some key in force belongs to, by name."""
        with self._lock:
            return {g.tenant.name: g.tenant for g in self._grants}
