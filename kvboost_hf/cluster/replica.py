"""One Ray Serve replica: the app ``kvboost-hf serve`` builds from the same flags, run in-process.

Ray Serve makes it a deployment (:mod:`.app`); it serves :class:`~.forwarding.ForwardedRequest` from
the ingress, and reports what its store holds to the prefix router (``record_routing_stats``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvboost_hf.cluster.forwarding import ForwardedRequest, ResponseHead, run_asgi
from kvboost_hf.cluster.metrics import PUSH_TIMEOUT_S, push_metrics
from kvboost_hf.cluster.routing import KEY_PREFIX_BYTES, Keying
from kvboost_hf.cluster.watch import FileWatch
from kvboost_hf.models.namespace import namespace
from kvboost_hf.reuse.state import reuse_state

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)


def replica_name() -> str:
    """This replica's Ray Serve id ('local' outside a replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a replica (tests drive the class directly)
        return f"local-{os.getpid()}"


class ModelReplica:
    """Loads the model and builds the app from ``args`` (``kvboost-hf serve`` flags), with
    ``torch_threads`` threads (its share of the node's CPUs), and runs it: its lifespan starts with
    the first request and ends when Serve stops the replica, after Serve drained its requests. With a
    ``metrics_board`` (a handle of the :class:`~.metrics.MetricsBoard` deployment) it pushes its
    ``/metrics`` there from its event loop."""

    def __init__(self, args: argparse.Namespace, torch_threads: int | None = None,
                 metrics_board: DeploymentHandle | None = None) -> None:
        from kvboost_hf.server.launch import build_app

        logging.getLogger("kvboost_hf").setLevel(args.log_level.upper())
        self.app = build_app(args, torch_threads=torch_threads)
        self.name = replica_name()
        self._key_file = FileWatch(args.api_keys) if getattr(args, "api_keys", None) else None
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._started: asyncio.Task | None = None
        model = self.app.state.service.model
        state = reuse_state(model)
        self.keying = None if state is None else Keying(
            namespace(model), self.app.state.store.chunk_size, tuple(state.turn_tokens), tuple(state.separator),
            tuple(state.leading_special))
        shared = self.app.state.tenancy.startup_scope()  # the shared entries' scope (with tenants only)
        self._shared_root = None if self.keying is None or shared is None else shared.root(self.keying.namespace)
        self._board, self._pushing = metrics_board, None
        if metrics_board is not None:  # Serve runs __init__ on the replica's event loop
            self._pushing = asyncio.get_running_loop().create_task(
                push_metrics(metrics_board, self.name, self.app.state.metrics.render))
        logger.info("replica %s ready", self.name)

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._lifespan.__aenter__())
        await asyncio.shield(self._started)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's response to ``request``: its head (and first bytes), then the rest of the body."""
        await self._start()
        if self._key_file is not None and self._key_file.changed():
            self.app.state.tenancy.reload()  # SIGHUP reaches the `kvboost-hf serve --ray` process only
        async for part in run_asgi(self.app, request, self.name):
            yield part

    def record_routing_stats(self) -> dict:
        """What the router ranks this replica by: the chunk keys its store holds (cut to 8 bytes, one
        bytes string), where its shared texts end, its queue, and how it keys prompts."""
        store = self.app.state.store
        held = store.held_keys(KEY_PREFIX_BYTES)
        return {"held": b"".join(sorted(held)), "queue": self.app.state.queue.depth,
                "shared_ends": sorted(store.chain_ends(self._shared_root)) if self._shared_root else [],
                "keying": None if self.keying is None else self.keying.as_dict()}

    async def __del__(self) -> None:
        if self._pushing is not None:
            self._pushing.cancel()
        if self._started is not None and self._started.done():
            await self._lifespan.__aexit__(None, None, None)
        if self._board is not None:  # out of the merged /metrics now, not when it goes stale
            try:
                await asyncio.wait_for(self._board.forget.remote(self.name), PUSH_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - the board may be stopping too
                logger.info("replica %s could not leave the metrics board: %s", self.name, err)

