"""Stop strings over a growing reply text, in time independent of the stop strings' length.

:class:`StopStrings` is an Aho-Corasick automaton over a request's stop strings. Its state after
reading a text is the longest suffix of the text that is a prefix of some stop string, which is
both what a streaming reply must hold back (it may still become a stop string) and, when that
suffix is a whole stop string, a match. The state after every character of the text read so far
is kept, so a text that grew by a token costs only its new characters (a decode that rewrote the
last characters, e.g. a completed multi-byte character, resumes from where the texts agree),
and :meth:`StopStrings.find` can answer for a hypothetical text without changing anything.
"""

from __future__ import annotations

import logging
from collections import deque

logger = logging.getLogger(__name__)

_NO_MATCH = -1


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (C-speed comparisons, O(n log n) worst case)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the answer is below hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class StopStrings:
    """Finds the first stop string in a text read incrementally, and how much of its end may begin one.

    ``scan(text)`` moves to ``text`` (the whole text so far) and returns where the earliest stop
    string in it starts (None when there is none), as ``min(text.find(s) for s in stops)`` would;
    ``held_back`` is then the length of the longest suffix of ``text`` that is a prefix of a stop
    string. ``find(text)`` answers like ``scan`` without moving. Empty stop strings are ignored.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._depth: list[int] = [0]
        self._out: list[int] = [0]  # length of the longest stop string ending at this node (0: none)
        for stop in self.stops:
            self._insert(stop)
        self._link()
        self.text = ""
        self._states: list[int] = [0]  # state after text[:i]
        self._first: list[int] = [_NO_MATCH]  # earliest start of a stop string ending within text[:i]

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[node][ch] = nxt
                self._goto.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._out.append(0)
            node = nxt
        self._out[node] = len(stop)

    def _link(self) -> None:
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            if not self._out[node]:
                self._out[node] = self._out[self._fail[node]]
            for ch, child in self._goto[node].items():
                fallback = self._fail[node]
                while fallback and ch not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                target = self._goto[fallback].get(ch, 0)
                self._fail[child] = target if target != child else 0
                queue.append(child)

    def _step(self, state: int, ch: str) -> int:
        goto, fail = self._goto, self._fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)

    def _run(self, text: str, start: int, state: int, first: int, record: bool) -> int:
        """Read ``text[start:]`` from ``state``; returns the earliest match start (``first`` carried in)."""
        for i in range(start, len(text)):
            state = self._step(state, text[i])
            length = self._out[state]
            if length and (first == _NO_MATCH or i + 1 - length < first):
                first = i + 1 - length
            if record:
                self._states.append(state)
                self._first.append(first)
        return first

    def scan(self, text: str) -> int | None:
        """Move to ``text`` and return the start of its earliest stop string (None: none)."""
        if not self.stops:
            self.text = text
            return None
        keep = common_prefix_length(self.text, text)
        del self._states[keep + 1 :]
        del self._first[keep + 1 :]
        first = self._run(text, keep, self._states[keep], self._first[keep], record=True)
        self.text = text
        return None if first == _NO_MATCH else first

    def find(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` starts (None: none), without moving (pure)."""
        if not self.stops:
            return None
        keep = common_prefix_length(self.text, text)
        first = self._run(text, keep, self._states[keep], self._first[keep], record=False)
        return None if first == _NO_MATCH else first

    @property
    def held_back(self) -> int:
        """Length of the longest suffix of the scanned text that is a prefix of a stop string (a proper
        prefix unless the text holds a stop string, and then the reply has stopped)."""
        return self._depth[self._states[len(self.text)]] if self.stops else 0
