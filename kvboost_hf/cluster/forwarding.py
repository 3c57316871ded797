"""One HTTP request carried from the Ray Serve ingress to a replica, and run there through the very
ASGI app ``kvboost-hf serve`` runs in one process: every route, error shape, header and stream as is.

The replica streams back a :class:`ResponseHead` (status and headers) with the first body bytes, then
body bytes. It holds the head until the app sends the first non-empty body, so a replica that dies
before that point fails the whole call (the ingress may retry it elsewhere: no token was sent yet).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvboost-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    """What the ingress got: method, path, query string, headers (raw ASGI pairs) and the whole body."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None

    def header(self, name: bytes) -> str:
        """The value of header ``name`` (lower case), '' when absent."""
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == name), "")

    def json_body(self) -> dict[str, Any] | None:
        """The body as a JSON object (None when it is not one)."""
        try:
            value = json.loads(self.body) if self.body else None
        except (ValueError, UnicodeDecodeError):
            return None
        return value if isinstance(value, dict) else None


@dataclass
class ResponseHead:
    """Status and headers of a forwarded response, with its first body bytes."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    @property
    def streaming(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.headers)


def asgi_scope(request: ForwardedRequest) -> dict:
    """The ASGI ``http`` scope of ``request`` as a server in front of the app would build it."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
            "client": request.client, "server": None, "state": {}}


async def run_asgi(app, request: ForwardedRequest, replica: str) -> AsyncIterator[ResponseHead | bytes]:
    """Run ``request`` through ``app``; yield its :class:`ResponseHead` (with the ``X-Kvboost-Replica``
    header) and first body bytes, then the rest of the body as it comes. Closing the iterator early
    (the client went away) tells the app the client disconnected and waits for it to finish."""
    sent: asyncio.Queue[dict] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(asgi_scope(request), receive, send)
        finally:
            await sent.put({"type": "kvboost.done"})

    task = asyncio.create_task(run())
    head: ResponseHead | None = None
    started = False  # the head was yielded
    try:
        while True:
            message = await sent.get()
            kind = message["type"]
            if kind == "kvboost.done":
                break
            if kind == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REPLICA_HEADER.encode()]
                head = ResponseHead(message["status"], headers + [(REPLICA_HEADER.encode(), replica.encode())])
                continue
            if kind != "http.response.body" or head is None:
                continue
            body, more = message.get("body", b""), message.get("more_body", False)
            if not started and (body or not more):
                head.body, started = body, True
                yield head
            elif started and body:
                yield body
            if not more:
                break
        if head is None or not started:
            await task  # what the app raised before it answered fails the call
            raise RuntimeError(f"the app sent no response to {request.method} {request.path}")
    finally:
        gone.set()
        try:  # after its response an app's error is only logged, as uvicorn does
            await asyncio.wait_for(task, timeout=30.0)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            task.cancel()
        except Exception:
            if started:
                logger.exception("the app failed after answering %s %s", request.method, request.path)
