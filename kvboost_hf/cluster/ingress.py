"""The Ray Serve ingress: takes every HTTP request and forwards it whole to a replica through a
deployment handle (whose request router picks the replica), streaming the replica's response back.

A replica that dies before the first body bytes is retried on another (nothing was sent yet); one
that dies mid-stream ends an SSE stream with an error event, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvboost_hf.cluster.forwarding import ForwardedRequest, ResponseHead

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)

RETRIES = 2  # other replicas tried when one fails before answering
METRICS_TIMEOUT_S = 10.0


def replica_failure(err: BaseException) -> bool:
    """Whether ``err`` says the replica itself went away (retrying elsewhere is safe), not that the
    request failed inside a live replica."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(err, (ActorDiedError, ActorUnavailableError, RayActorError))


def failure_event(err: BaseException) -> bytes:
    """The SSE error event (then ``[DONE]``) that ends a stream whose replica failed."""
    error = {"message": f"the replica serving this request failed: {type(err).__name__}", "type": "server_error",
             "param": None, "code": "replica_failed"}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


def unavailable(err: BaseException) -> Response:
    body = {"error": {"message": f"no replica could serve the request ({type(err).__name__}); retry",
                      "type": "server_error", "param": None, "code": "replica_unavailable"}}
    return Response(json.dumps(body), status_code=503, media_type="application/json", headers={"Retry-After": "1"})


class Ingress:
    """Serve's HTTP entry: ``replicas`` is the handle of the :class:`~.replica.ModelReplica` deployment;
    with a ``metrics_board`` (a handle of :class:`~.metrics.MetricsBoard`) it answers ``GET /metrics``
    itself, for every replica at once."""

    def __init__(self, replicas, metrics_board: DeploymentHandle | None = None) -> None:
        self.replicas = replicas.options(stream=True)
        self.metrics_board = metrics_board

    async def __call__(self, request: Request) -> Response:
        if self.metrics_board is not None and request.method == "GET" and request.url.path == "/metrics":
            return await self._metrics()
        client = request.scope.get("client")
        forwarded = ForwardedRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                                     tuple((bytes(k), bytes(v)) for k, v in request.scope.get("headers", [])),
                                     await request.body(), tuple(client) if client else None)
        error: BaseException | None = None
        for attempt in range(RETRIES + 1):
            stream = self.replicas.forward.remote(forwarded)
            try:
                head = await stream.__anext__()
            except Exception as err:  # noqa: BLE001 - sorted below: only a lost replica is retried
                if not replica_failure(err):
                    raise
                error = err
                logger.warning("replica failed before answering %s %s (attempt %d): %s", request.method,
                               request.url.path, attempt + 1, type(err).__name__)
                continue
            assert isinstance(head, ResponseHead)
            response = StreamingResponse(self._rest(head, stream), status_code=head.status)
            response.raw_headers = list(head.headers)
            return response
        return unavailable(error)

    async def _metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            body, merged = await asyncio.wait_for(self.metrics_board.merged.remote(), METRICS_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - the board restarting: a retryable 503, never a hang
            logger.warning("the metrics board did not answer: %s", type(err).__name__)
            return unavailable(err)
        return Response(body, media_type=CONTENT_TYPE_LATEST, headers={"X-Kvboost-Replica": ",".join(merged)})

    async def _rest(self, head: ResponseHead, stream) -> AsyncIterator[bytes]:
        if head.body:
            yield head.body
        try:
            async for part in stream:
                yield part
        except Exception as err:  # noqa: BLE001 - the client gets a clean end, the log says why
            logger.warning("replica failed mid-response: %s", type(err).__name__)
            if head.streaming:
                yield failure_event(err)
        finally:
            stream.cancel()
