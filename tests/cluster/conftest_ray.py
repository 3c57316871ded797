"""A running ``kvboost-hf serve --ray`` application for tests: Ray started by this process (the driver),
so tests can find and kill replica processes."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from kvboost_hf.cli import build_parser


# Ray Serve gives its HTTP proxy 5 s to report ready, three times, then kills it, and serve.run raises
# ActorDiedError: a 2-core host with the other test worker busy missed that (seen with two busy loops beside
# the suite). Serve's controller reads these limits from the environment the driver's ray.init passes down.
STARVED_HOST_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayServer:
    url: str
    stop: threading.Event
    thread: threading.Thread

    def post(self, path: str, body: dict, key: str | None = None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, **kw)


def replicas() -> dict[str, str]:
    """Live model replicas: Serve's replica id -> the actor's name (in namespace ``serve``)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    return {name.rsplit("#", 1)[-1]: name for name in names if "kvboost-replica" in name}


def kill_replica(replica: str) -> None:
    """Kill a replica's process as a crash would (Serve's controller starts another)."""
    import ray

    ray.kill(ray.get_actor(replicas()[replica], namespace="serve"), no_restart=True)


@contextlib.contextmanager
def ray_server(*flags: str, startup_s: float = 300.0) -> Iterator[RayServer]:
    """``kvboost-hf serve --ray FLAGS`` on a free port in a thread of this process; stopped after."""
    from kvboost_hf.cluster.app import serve_on_ray

    port = free_port()
    args = build_parser().parse_args(["serve", "--ray", "--port", str(port), *flags])
    ready, stop = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            serve_on_ray(args, ready, stop)
        except BaseException as err:  # noqa: BLE001 - reported to the test below
            failed.append(err)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    for name, value in STARVED_HOST_ENV.items():  # read when ray.init starts Ray's processes; left set (restoring
        os.environ.setdefault(name, value)        # os.environ clears it a moment, under Ray's running threads)
    thread.start()
    assert ready.wait(startup_s), "the Ray application did not start"
    assert not failed, failed
    server = RayServer(f"http://127.0.0.1:{port}", stop, thread)
    try:
        deadline = time.monotonic() + 60
        while len(replicas()) < (args.replicas or 1) and time.monotonic() < deadline:
            time.sleep(0.5)
        yield server
    finally:
        stop.set()
        thread.join(120)
        assert not thread.is_alive(), "serve_on_ray did not stop"
        assert not failed, failed  # it failed while serving or stopping
