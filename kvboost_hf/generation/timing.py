"""Time to first token, measured the way users see it."""

from __future__ import annotations

import time


class FirstTokenTimer:
    """A generate ``streamer`` that records when the first new token arrives.

    ``generate`` hands a streamer the prompt first, then each new token; the second ``put``
    marks the first generated token. ``ttft`` is measured from ``start()`` (call it right
    before ``generate``), so it includes lookup, loading and the prefill.
    """

    def __init__(self) -> None:
        self.started_at = 0.0
        self._puts = 0
        self.first_token_at: float | None = None

    def start(self) -> FirstTokenTimer:
        self.started_at = time.perf_counter()
        self._puts = 0
        self.first_token_at = None
        return self

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    @property
    def ttft(self) -> float:
        """Seconds from ``start()`` to the first generated token."""
        if self.first_token_at is None:
            raise RuntimeError("no token was generated yet")
        return self.first_token_at - self.started_at
