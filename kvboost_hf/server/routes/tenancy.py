"""Tenants on the server: who a request's entries belong to, what a caller may see and purge.

With ``--api-keys`` every key belongs to a tenant (:mod:`kvboost_hf.server.api.keys`). A request's
chains are rooted at its tenant (the store owner) and its ``cache_salt``, so no tenant reaches
another's entries in any tier; entries an admin warmed with ``"shared": true`` are the one
exception, read by every tenant as a leading prefix (what follows stays the tenant's own). Without
``--api-keys`` (no key, or one ``--api-key``) there is one tenant: requests are scoped by
``cache_salt`` alone, as before.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from fastapi import Request
from prometheus_client import CollectorRegistry

from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.api.keys import Grant, KeyRing
from kvboost_hf.server.observability.tenant_metrics import TenantMetrics
from kvboost_hf.store import ChunkStore
from kvboost_hf.store.scope import CacheScope

logger = logging.getLogger(__name__)

# The salt of entries shared on purpose. Clients cannot send it: cache_salt refuses control characters.
SHARED_SALT = "\x00kvboost-shared"
MAX_SHARED_LISTED = 256


def tenant_scope(grant: Grant | None, cache_salt: str | None, epoch: int | None = None) -> CacheScope | None:
    """The scope of a request of ``grant`` (None: no tenants) with ``cache_salt``: the tenant owns its
    entries and reads the shared ones first. ``epoch`` does not change any key (a router leaves it None)."""
    if grant is None:
        return None if cache_salt is None else CacheScope(salt=cache_salt)
    return CacheScope(salt=cache_salt, owner=grant.tenant.name, shared_salt=SHARED_SALT, epoch=epoch)


class Tenancy:
    """Scopes, quotas, shared prefixes, purges and per-tenant figures of one app (``keyring`` None: one tenant)."""

    def __init__(self, keyring: KeyRing | None, store: ChunkStore, registry: CollectorRegistry) -> None:
        self.keyring, self.store = keyring, store
        self.shared: list[dict] = []  # what admins warmed with "shared": true, newest last
        self._quota_owners: set[str] = set()
        self.metrics = None
        if keyring is not None:
            self.metrics = TenantMetrics(registry, self._tenant_bytes, store.quotas)
            self.sync_quotas()

    @property
    def enabled(self) -> bool:
        return self.keyring is not None

    # ------------------------------------------------------------------ keys
    @staticmethod
    def grant(request: Request | None) -> Grant | None:
        """The grant the auth middleware attached to ``request`` (None without ``--api-keys``)."""
        return None if request is None else getattr(request.state, "grant", None)

    def reload(self) -> bool:
        """Re-read the key file (``SIGHUP``) and apply its quotas; False (old keys kept) when it does not parse."""
        if self.keyring is None or not self.keyring.reload():
            return False
        self.sync_quotas()
        return True

    def sync_quotas(self) -> None:
        """Give the store every tenant's ``store_bytes`` (and lift quotas of tenants no longer listed)."""
        tenants = self.keyring.tenants()
        for name in self._quota_owners - {n for n, t in tenants.items() if t.store_bytes is not None}:
            self.store.set_quota(name, None)
        self._quota_owners = set()
        for name, tenant in tenants.items():
            if tenant.store_bytes is not None:
                self.store.set_quota(name, tenant.store_bytes)
                self._quota_owners.add(name)
        total = sum(t.store_bytes or 0 for t in tenants.values())
        if total > self.store.max_bytes:
            logger.warning("tenant quotas add up to %d bytes, more than the store's %d: a tenant's traffic may then "
                           "evict another's entries", total, self.store.max_bytes)

    def still_allowed(self, grant: Grant | None) -> bool:
        """Whether ``grant``'s key is still in force (always, without ``--api-keys``)."""
        return grant is None or self.keyring is None or self.keyring.is_current(grant)

    def check_still_allowed(self, grant: Grant | None) -> None:
        if not self.still_allowed(grant):
            raise APIError(401, "the API key was revoked while the request ran", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------ scopes
    def scope(self, grant: Grant | None, cache_salt: str | None) -> CacheScope | None:
        """Whose entries a request of ``grant`` with ``cache_salt`` reads and feeds."""
        # the owner's epoch now: a purge from now on also drops what this request stores
        return tenant_scope(grant, cache_salt, None if grant is None else self.store.epoch(grant.tenant.name))

    def shared_scope(self, grant: Grant | None) -> CacheScope:
        """The scope of a ``"shared": true`` warm: 400 without tenants, 403 for a non-admin key."""
        if grant is None:
            raise APIError(400, "'shared' needs tenants (--api-keys): without them every entry is shared already",
                           param="shared", code="invalid_value")
        if not grant.admin:
            raise APIError(403, "only an admin key may warm shared entries", param="shared", code="forbidden")
        return CacheScope(salt=SHARED_SALT)

    def startup_scope(self) -> CacheScope | None:
        """Where ``--warm`` texts go: shared by every tenant with ``--api-keys`` (else the one tenant's)."""
        return CacheScope(salt=SHARED_SALT) if self.enabled else None

    def note_shared(self, grant: Grant, prompt_tokens: int, reusable: int, preview: str) -> None:
        self.shared.append({"prompt_tokens": prompt_tokens, "reusable_tokens": reusable, "warmed_by": grant.tenant.name,
                            "warmed_at": int(time.time()), "preview": preview[:120]})
        del self.shared[:-MAX_SHARED_LISTED]

    # ------------------------------------------------------------------ figures
    def record(self, scope: CacheScope | None, prompt: int, cached: int, completion: int) -> None:
        if self.metrics is not None and scope is not None and scope.owner is not None:
            self.metrics.observe(scope.owner, prompt, cached, completion)

    def stats(self, grant: Grant | None, full: Callable[[], dict]) -> dict:
        """``/v1/stats`` as ``grant`` may see it: everything for one tenant or an admin; a non-admin tenant
        gets its own figures only (the store's totals would show other tenants' traffic)."""
        if grant is None:
            return full()
        if grant.admin:
            tenants = sorted(self.keyring.tenants())
            return {**full(), "tenants": {name: self.metrics.snapshot(name) for name in tenants},
                    "shared_prefixes": list(self.shared)}
        name = grant.tenant.name
        return {"tenant": {"name": name, **self.metrics.snapshot(name)}}

    def _tenant_bytes(self) -> dict[str, int]:
        return {owner: n for owner, n in self.store.owner_bytes().items() if isinstance(owner, str)}

    # ------------------------------------------------------------------ purge
    def purge(self, grant: Grant | None, tenant: str | None, shared: bool = False) -> dict:
        """Forget the caller's tenant's entries (an admin: ``tenant``'s, or with ``shared`` the shared ones)
        in every tier; 503 when Redis did not answer (the local tiers are purged: retry)."""
        if shared:
            if grant is None or not grant.admin or tenant is not None:
                raise APIError(403 if grant is not None else 400, "only an admin key (--api-keys) may purge the "
                               "shared entries, and without 'tenant'", param="shared", code="forbidden")
            owner = None  # shared entries are charged to nobody
            self.shared.clear()
        elif grant is None:
            if tenant is not None:
                raise APIError(400, "'tenant' needs tenants (--api-keys)", param="tenant", code="invalid_value")
            owner = None  # one tenant: everything this server charged to nobody
        elif tenant is not None and tenant != grant.tenant.name:
            if not grant.admin:
                raise APIError(403, "only an admin key may purge another tenant", param="tenant", code="forbidden")
            owner = tenant
        else:
            owner = grant.tenant.name
        purged = self.store.purge(owner)
        if purged["remote"] is None:
            raise APIError(503, "the RAM and disk tiers are purged, but the shared Redis tier did not answer: retry",
                           code="remote_unavailable", headers={"Retry-After": "5"})
        who = "the shared entries" if shared else "the server's one tenant" if owner is None else f"tenant {owner!r}"
        logger.info("purged %s: %s", who, purged)
        return {"tenant": owner, "shared": shared, "purged": purged}


def reload_on_sighup(tenancy: Tenancy) -> None:
    """Re-read the API key file whenever the process gets ``SIGHUP`` (uvicorn leaves that signal alone)."""
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda signum, frame: tenancy.reload())
