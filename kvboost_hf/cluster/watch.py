"""``--api-keys`` in a Ray deployment: every process that reads the file re-reads it when it changes.

One process answers ``SIGHUP``; replicas and the router live in Ray's processes, so each checks the
file's modification time instead (at most once per ``period_s``).
"""

from __future__ import annotations

import os
import time


class FileWatch:
    """Says when the file at ``path`` changed since it last said so."""

    def __init__(self, path: str | os.PathLike, period_s: float = 1.0) -> None:
        self.path, self.period_s = path, period_s
        self._stamp = self._read()
        self._checked = time.monotonic()

    def _read(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def changed(self) -> bool:
        """True once after each change (checked at most once per ``period_s``)."""
        now = time.monotonic()
        if now - self._checked < self.period_s:
            return False
        self._checked = now
        stamp = self._read()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True
