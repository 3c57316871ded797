"""Serve an app with uvicorn in a background thread of this process (tests, notebooks, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class BackgroundServer:
    """A running uvicorn server: ``url`` is its root (``http://host:port``)."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self, timeout: float = 60.0) -> None:
        """Ask uvicorn to exit (the app's lifespan ends) and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout=timeout)


def serve_in_background(app, host: str = "127.0.0.1", port: int | None = None,
                        startup_timeout: float = 120.0) -> BackgroundServer:
    """Start ``app`` on ``host:port`` (a free port by default) in a daemon thread; returns once it serves.

    Raises ``RuntimeError`` when it has not started within ``startup_timeout`` seconds or its thread died.
    """
    port = free_port(host) if port is None else port
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    return BackgroundServer(server, thread, f"http://{host}:{port}")
