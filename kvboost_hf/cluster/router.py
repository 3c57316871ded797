"""``--router prefix``: a Ray Serve request router that sends a request to the replica holding the
longest prefix of its prompt's chunk keys (:func:`~.routing.rank_replicas`).

It runs where the handle is (the ingress): it tokenizes the prompt once, as the server does (chat
template, tools), computes the keys under the request's scope (the tenant of its API key, its
``cache_salt``), and reads what each replica reported (``record_routing_stats``). Anything it cannot
read (another route, a body the server will refuse, an unknown key, no report yet) is routed by
power of two choices; a stale report costs a miss, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvboost_hf.cluster.forwarding import ForwardedRequest
from kvboost_hf.cluster.routing import KEY_PREFIX_BYTES, Keying, PromptKeys, ReplicaReport, rank_replicas
from kvboost_hf.cluster.watch import FileWatch
from kvboost_hf.models import load_tokenizer
from kvboost_hf.server.api.keys import Grant, KeyRing, bearer_token
from kvboost_hf.server.routes.prompts import routed_prompt
from kvboost_hf.server.routes.tenancy import tenant_scope

logger = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_REMEMBERED = 4096  # prompts kept between the retries of one routing (keyed by request id)
DEFAULT_IMBALANCE = 4


def split_held(blob: bytes) -> frozenset[bytes]:
    """A replica's reported keys (one bytes string of 8-byte keys) as a set."""
    return frozenset(blob[i:i + KEY_PREFIX_BYTES] for i in range(0, len(blob), KEY_PREFIX_BYTES))


def request_grant(request: ForwardedRequest, keyring: KeyRing | None) -> Grant | None | bool:
    """The grant of ``request``'s bearer key (None without tenants); False when the replica will refuse
    the key: route it anywhere, without tokenizing it."""
    if keyring is None:
        return None
    token = bearer_token(request.header(b"authorization"))
    grant = keyring.grant_for(token) if token is not None else None
    return False if grant is None else grant


class PrefixRouter(FIFOMixin, RequestRouter):
    """Exact prefix-aware routing over the replicas' stores (``request_router_kwargs``: ``model``, the
    replicas' ``--model``; ``api_keys_file``, their ``--api-keys``; ``imbalance``, the queue difference
    past which the longest holder loses its turn)."""

    def initialize_state(self, model: str | None = None, api_keys_file: str | None = None,
                         imbalance: int = DEFAULT_IMBALANCE, **_: Any) -> None:
        self._model, self._imbalance = model, imbalance
        self._keyring = KeyRing(api_keys_file) if api_keys_file else None
        self._key_file = FileWatch(api_keys_file) if api_keys_file else None
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()
        self._prompts: OrderedDict[str, PromptKeys | None] = OrderedDict()
        self._held: dict[str, tuple[bytes, frozenset[bytes]]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        prompt = await self._prompt_keys(pending_request, candidate_replicas)
        reports = [self._report(r) for r in candidate_replicas]
        ranks = rank_replicas(prompt if prompt is not None else [], reports, self._imbalance)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_name[name] for name in rank] for rank in ranks]

    def _report(self, replica: RunningReplica) -> ReplicaReport:
        stats = replica.routing_stats or {}
        name = replica.replica_id.unique_id
        blob = stats.get("held", b"")
        cached = self._held.get(name)
        if cached is None or cached[0] is not blob:  # parse a report once, not per request
            cached = self._held[name] = (blob, split_held(blob))
        queue = self.replica_queue_len_cache.get(replica.replica_id)
        return ReplicaReport(name, cached[1], stats.get("queue", 0) if queue is None else queue,
                             tuple(stats.get("shared_ends", ())))

    async def _prompt_keys(self, pending: PendingRequest | None, replicas: list[RunningReplica]) -> PromptKeys | None:
        if pending is None or not pending.args or not isinstance(pending.args[0], ForwardedRequest):
            return None
        request_id = pending.metadata.request_id
        if request_id in self._prompts:
            return self._prompts[request_id]
        keying = next((Keying.from_dict(r.routing_stats["keying"]) for r in replicas
                       if (r.routing_stats or {}).get("keying")), None)
        prompt = await self._compute(pending.args[0], keying) if keying is not None else None
        self._prompts[request_id] = prompt
        while len(self._prompts) > MAX_REMEMBERED:
            self._prompts.popitem(last=False)
        return prompt

    async def _compute(self, request: ForwardedRequest, keying: Keying) -> PromptKeys | None:
        if request.method != "POST" or request.path not in ROUTED_PATHS:
            return None
        body = request.json_body()
        if body is None:
            return None
        self._reload_keys()
        grant = request_grant(request, self._keyring)
        if grant is False:
            return None
        routed = await routed_prompt(await self._get_tokenizer(), request.path, body)
        if routed is None or not routed[0]:
            return None
        ids, salt = routed  # the scope as Tenancy.scope builds it (no key depends on its epoch)
        return keying.prompt_keys(ids, tenant_scope(grant, salt))

    async def _get_tokenizer(self):
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = await asyncio.to_thread(load_tokenizer, self._model)
        return self._tokenizer

    def _reload_keys(self) -> None:
        """The replicas re-read ``--api-keys`` when it changes; so does the router (meanwhile a moved key
        is routed by power of two choices: a miss at worst)."""
        if self._key_file is not None and self._key_file.changed():
            self._keyring.reload()
