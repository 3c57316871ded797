"""What keeps the Redis tier from failing requests: a circuit breaker, and URLs without their passwords."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit


def redact(url: str) -> str:
    """``url`` without its password (in the user info or as a ``password=`` query parameter)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}{':***' if colon else ''}@{host}"
    query = "&".join(
        f"{k}=***" if k.lower() in ("password", "pass", "pwd") else f"{k}{'=' if sep else ''}{v}"
        for k, sep, v in (item.partition("=") for item in parts.query.split("&") if item)
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


class CircuitBreaker:
    """Closed until a failure; then open for ``backoff_s`` (doubling per consecutive failure, up to ``max_backoff_s``)."""

    def __init__(self, backoff_s: float = 2.0, max_backoff_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.backoff_s, self.max_backoff_s, self.clock = backoff_s, max_backoff_s, clock
        self.failures = 0
        self.open_until = 0.0
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.clock() < self.open_until

    def allow(self) -> bool:
        return not self.is_open

    def success(self) -> None:
        self.failures = 0

    def failure(self) -> float | None:
        """Record a failure; returns how long the tier is now skipped, or None when another call
        (another thread, same outage) has opened the breaker already: that neither counts again
        nor lengthens the back-off."""
        with self._lock:
            if self.is_open:
                return None
            self.failures += 1
            wait = min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))
            self.open_until = self.clock() + wait
            return wait
