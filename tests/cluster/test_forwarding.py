"""run_asgi without Ray: a forwarded request through an ASGI app gives its head with the first body
bytes and the replica header, streams the rest, tells the app when the client goes away, and fails
the call (so the ingress may retry) only when the app never answered."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvboost_hf.cluster.forwarding import REPLICA_HEADER, ForwardedRequest, ResponseHead, run_asgi


def make_app(events: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "query": request.url.query, "auth": request.headers.get("authorization")},
                            status_code=201, headers={REPLICA_HEADER: "forged"})

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def parts():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("generator closed")
        return StreamingResponse(parts(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("no answer")

    return app


async def collect(app, request: ForwardedRequest, limit: int | None = None) -> list:
    parts = []
    stream = run_asgi(app, request, "replica-7")
    async for part in stream:
        parts.append(part)
        if limit is not None and len(parts) >= limit:
            break
    await stream.aclose()
    return parts


def test_a_request_comes_back_whole_with_its_head_and_the_replica_header():
    request = ForwardedRequest("POST", "/echo", b"a=1", ((b"content-type", b"application/json"),
                                                       (b"authorization", b"Bearer k")), b'{"x": [1, 2]}')
    (head,) = asyncio.run(collect(make_app([]), request))
    assert isinstance(head, ResponseHead) and head.status == 201 and not head.streaming
    assert head.body == b'{"got":{"x":[1,2]},"query":"a=1","auth":"Bearer k"}'
    assert [v for k, v in head.headers if k == REPLICA_HEADER.encode()] == [b"replica-7"]  # the app cannot forge it


def test_a_stream_streams_and_a_client_that_leaves_stops_the_app():
    events: list[str] = []
    parts = asyncio.run(collect(make_app(events), ForwardedRequest("GET", "/stream"), limit=3))
    head, rest = parts[0], parts[1:]
    assert head.streaming and head.body == b"data: 0\n\n" and rest == [b"data: 1\n\n", b"data: 2\n\n"]
    assert events == ["generator closed"]  # the app saw the disconnect: nothing runs on for nobody


def test_an_app_that_never_answers_fails_the_call_and_one_that_fails_answers_500():
    async def silent(scope, receive, send):
        raise RuntimeError("died before answering")

    with pytest.raises(RuntimeError, match="died before answering"):
        asyncio.run(collect(silent, ForwardedRequest("GET", "/")))
    (head,) = asyncio.run(collect(make_app([]), ForwardedRequest("GET", "/boom")))  # as uvicorn: a 500
    assert head.status == 500


def test_bodies_that_are_not_json_objects_are_none():
    assert ForwardedRequest("POST", "/v1/completions", body=b"[1]").json_body() is None
    assert ForwardedRequest("POST", "/v1/completions", body=b"\xff").json_body() is None
    assert ForwardedRequest("POST", "/v1/completions", body=b'{"a": 1}').json_body() == {"a": 1}
