"""How many draft tokens to verify per round, decided from acceptance and costs measured at run time.

The rule (documented in docs/speculative.md):

- Round 0 (the prompt prefill) verifies no draft: the first token arrives exactly when it would
  without speculation. Round 1 measures the cost of a plain decode step, unless an earlier
  request with the same draft already did: costs (and, weakly, acceptance) carry over between
  requests through :class:`CostMemory`.
- Acceptance follows the usual geometric model: each draft token is accepted with probability
  ``alpha`` given the previous one was. ``alpha`` is estimated from recent rounds (accepted
  tokens over accepted tokens plus rejections, decayed per round, starting from a weak prior).
- Costs are measured wall time: a round verifying ``k`` tokens costs ``verify(k)`` in the target
  plus ``draft_per_token * k`` in the draft. ``verify(k)`` is kept per drafted count (the lowest of
  the last four rounds that verified that many, as is ``plain``: noise and first-call costs only
  add time, and an average would keep a count priced out after one slow round) and interpolated between counts, from ``verify(0) = plain``;
  past the largest count measured it is extended with the last segment's slope. A forward over
  ``k + 1`` rows costs far less than ``k + 1`` steps and its cost per row falls as ``k`` grows (the
  weights are read once), so one slope fitted at small ``k`` would overprice long drafts: where
  nearly every draft token is accepted (copying), the draft length grows until the measured costs
  stop paying for it.
- The draft length is the ``k`` in ``1..max_tokens`` that maximises expected tokens per second,
  ``(1 - alpha^(k+1)) / (1 - alpha) / cost(k)``. If that rate is under ``min_gain`` times the
  plain rate ``1 / plain``, speculation is switched off for ``backoff_rounds`` rounds, then one
  probe round re-measures; every failed probe doubles the back-off, so a draft that never pays
  costs a bounded share of rounds.
- A model draft must first forward every token it has not seen (the prompt, on its first round;
  the tokens decoded while speculation was off, after a back-off). That catch-up is measured per
  token and charged to the round that needs it: a round is drafted only if its catch-up costs
  less than what speculation can save over the rest of the request (``remaining x plain x
  (1 - 1/gain)``; for a probe or the first round of a request, whose gain is unknown,
  ``min_gain - 1`` of the remaining plain decode time). Otherwise the round is plain and the
  question comes back after a back-off. The catch-up cost carries over to the next request with
  the same draft like the other costs, so a request whose prompt the draft cannot afford to
  prefill never starts drafting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

PRIOR_WEIGHT = 2.0  # acceptance carried over from earlier requests counts as this many rounds
# A model draft has not forwarded the (up to) two tokens every round brings: the target's own and
# its last draft token. More unseen tokens than that is a catch-up.
ROUND_TOKENS = 2


@dataclass
class ControllerSettings:
    """Settings of :class:`DraftController`. ``adaptive=False`` drafts ``max_tokens`` in every round, the
    first included (HF's behaviour with a fixed ``num_assistant_tokens``)."""

    max_tokens: int = 8
    start_tokens: int = 4
    probe_tokens: int = 2
    min_gain: float = 1.05
    backoff_rounds: int = 16
    decay: float = 0.85
    prior_accepted: float = 1.0
    prior_rejected: float = 1.0
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= self.start_tokens <= self.max_tokens:
            raise ValueError(f"start_tokens must be in 1..max_tokens ({self.max_tokens}), got {self.start_tokens}")
        if not 1 <= self.probe_tokens <= self.max_tokens:
            raise ValueError(f"probe_tokens must be in 1..max_tokens ({self.max_tokens}), got {self.probe_tokens}")
        if self.min_gain <= 0 or self.backoff_rounds < 1 or not 0 < self.decay <= 1:
            raise ValueError("min_gain must be > 0, backoff_rounds >= 1 and decay in (0, 1]")


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens from a round verifying ``k`` draft tokens (accepted ones plus the target's own)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class CostMemory:
    """What one request learnt about a draft, for the next request with the same draft."""

    plain_ms: float | None = None
    verify_slope_ms: float | None = None
    draft_ms_per_token: float | None = None
    accepted: float = 0.0
    rejected: float = 0.0
    catch_up_ms_per_token: float | None = None
    verify_ms_at: dict[int, float] | None = None  # verify(k) per drafted count k


class _Ema:
    """Exponential moving average that is None until its first sample."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight, self.value = weight, None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample


class _RecentLow:
    """The lowest of the last ``window`` samples (None before the first). A wall-clock cost is the true
    cost plus noise that only ever adds time (another process, the first call at a new shape), so the
    low of a short window tracks it where an average keeps an outlier for many rounds, and a round
    length whose first measurement was inflated would otherwise never be tried again."""

    def __init__(self, window: int = 4) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    @property
    def value(self) -> float | None:
        return min(self._samples) if self._samples else None

    @value.setter
    def value(self, known: float | None) -> None:  # carried over from an earlier request
        self._samples.clear()
        if known is not None:
            self._samples.append(known)

    @property
    def count(self) -> int:
        return len(self._samples)

    def add(self, sample: float) -> None:
        self._samples.append(sample)


class DraftController:
    """Chooses each round's draft length and learns from the round's outcome."""

    def __init__(self, settings: ControllerSettings | None = None, memory: CostMemory | None = None) -> None:
        self.settings = settings or ControllerSettings()
        self.round = 0
        self.accepted = self.settings.prior_accepted
        self.rejected = self.settings.prior_rejected
        self.plain_ms = _RecentLow()
        self.verify_slope_ms = _Ema()
        self.draft_ms_per_token = _Ema()
        self.catch_up_ms_per_token = _Ema()
        self.verify_at: dict[int, _RecentLow] = {}
        self.drafted_rounds = 0
        self.off_until = -1
        self.backoff = self.settings.backoff_rounds
        self.off_reason = ""
        if memory is not None:
            self.plain_ms.value, self.verify_slope_ms.value = memory.plain_ms, memory.verify_slope_ms
            self.draft_ms_per_token.value = memory.draft_ms_per_token
            self.catch_up_ms_per_token.value = memory.catch_up_ms_per_token
            for k, value in (memory.verify_ms_at or {}).items():
                self.verify_at.setdefault(k, _RecentLow()).value = value
            total = memory.accepted + memory.rejected
            if total > 0:  # the earlier requests' acceptance, as a prior worth PRIOR_WEIGHT rounds
                self.accepted = PRIOR_WEIGHT * memory.accepted / total
                self.rejected = PRIOR_WEIGHT * memory.rejected / total

    def memory(self) -> CostMemory:
        """The current estimates, to start the next request with the same draft from."""
        return CostMemory(self.plain_ms.value, self.verify_slope_ms.value, self.draft_ms_per_token.value,
                          self.accepted, self.rejected, self.catch_up_ms_per_token.value,
                          {k: e.value for k, e in self.verify_at.items()})

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, unseen: int | Callable[[], int] = 0, remaining: int | None = None) -> int:
        """Draft tokens to propose this round (0: a plain decode step). ``unseen``: tokens the draft must
        forward before drafting (catch-up), or a function computing them, called only when needed;
        ``remaining``: tokens the request may still generate."""
        s = self.settings
        if not s.adaptive:
            return s.max_tokens
        if self.round == 0:
            return 0
        if self.plain_ms.value is None:
            return 0
        if self.verify_slope_ms.value is None:
            return self._afford(s.start_tokens, None, unseen, remaining)
        if self.round < self.off_until:
            return 0
        if self.off_until >= 0 and self.round == self.off_until:
            return self._afford(s.probe_tokens, None, unseen, remaining)  # one probe round after a back-off
        return self._decide(unseen, remaining)

    def _afford(self, k: int, gain: float | None, unseen, remaining: int | None) -> int:
        """``k``, or 0 when the draft's catch-up costs more than speculation can save in the request."""
        rate = self.catch_up_ms_per_token.value
        if k == 0 or rate is None or remaining is None or self.plain_ms.value is None:
            return k
        if self.settings.min_gain <= 1.0:  # speculating at a loss was allowed: so is any catch-up
            return k
        unseen = unseen() if callable(unseen) else unseen
        if unseen <= ROUND_TOKENS:
            return k
        share = (1.0 - 1.0 / gain) if gain is not None else (self.settings.min_gain - 1.0)
        if unseen * rate <= share * remaining * self.plain_ms.value:
            return k
        self.off_reason = (f"the draft's catch-up ({unseen} tokens, ~{unseen * rate:.0f} ms) costs more than "
                           f"speculation can save in the {remaining} tokens left")
        self.off_until = self.round + self.backoff  # ask again after a back-off (not doubled: nothing was tried)
        return 0

    def _decide(self, unseen, remaining: int | None) -> int:
        s = self.settings
        plain = self.plain_ms.value
        slope = max(0.0, self.verify_slope_ms.value)
        draft = max(0.0, self.draft_ms_per_token.value or 0.0)
        best_k, best_rate = 0, 0.0
        for k in range(1, s.max_tokens + 1):
            rate = expected_tokens(self.alpha, k) / (self.verify_ms(k) + draft * k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_rate * plain >= s.min_gain:
            if self.off_until >= 0:
                self.backoff = s.backoff_rounds
            self.off_until = -1
            return self._afford(best_k, best_rate * plain, unseen, remaining)
        again = self._remeasure()
        if again:
            return self._afford(again, None, unseen, remaining)
        self.off_reason = (f"predicted {best_rate * plain:.2f}x plain at best (alpha {self.alpha:.2f}, plain "
                           f"{plain:.1f} ms, verify +{slope:.1f} ms/token, draft {draft:.1f} ms/token)")
        if self.off_until >= 0:
            self.backoff *= 2
        self.off_until = self.round + self.backoff
        return 0

    def verify_ms(self, k: int) -> float:
        """Predicted target time of a round verifying ``k`` draft tokens (see the module doc)."""
        plain = self.plain_ms.value
        points = self._verify_points()
        if len(points) == 1:
            return plain + max(0.0, self.verify_slope_ms.value or 0.0) * k
        for (k0, v0), (k1, v1) in zip(points, points[1:]):
            if k <= k1:
                return v0 + (v1 - v0) * (k - k0) / (k1 - k0)
        (k0, v0), (k1, v1) = points[-2], points[-1]
        return v1 + max(0.0, (v1 - v0) / (k1 - k0)) * (k - k1)

    def _verify_points(self) -> list[tuple[int, float]]:
        """``(0, plain)`` and ``(n, verify(n))`` for every measured count, each capped by what the other
        counts imply: a round with more rows costs at least as much (``verify(m)``,
        ``m > n``), and a forward reads the weights once whatever its rows, so the cost per row beyond
        ``plain`` does not rise with the rows (``plain + (verify(m) - plain) n / m``, ``m < n``). One round
        slowed by something else (its first call at that shape, another process) then does not price
        that count, and every longer one, out."""
        plain = self.plain_ms.value
        measured = {n: e.value for n, e in self.verify_at.items() if e.value is not None and n > 0}
        points = [(0, plain)]
        for n in sorted(measured):
            points.append((n, min([measured[n], *(v for m, v in measured.items() if m > n),
                                    *(plain + max(0.0, v - plain) * n / m for m, v in measured.items() if m < n)])))
        return points

    def _remeasure(self) -> int:
        """A drafted count measured only once, to verify again before switching speculation off on the
        strength of one round that may have paid a one-off cost (0: none, or none could pay even if its
        verification cost nothing)."""
        plain, draft = self.plain_ms.value, max(0.0, self.draft_ms_per_token.value or 0.0)
        once = [k for k, e in self.verify_at.items() if e.count == 1 and 0 < k <= self.settings.max_tokens
                and expected_tokens(self.alpha, k) * plain / (plain + draft * k) >= self.settings.min_gain]
        return min(once) if once else 0

    def observe(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float, unseen: int = 0) -> None:
        """Learn from the round just verified: ``drafted`` candidates, ``accepted`` of them kept; the
        draft first forwarded ``unseen`` tokens it had not seen."""
        first = self.round == 0
        self.round += 1
        if first:
            return
        if drafted == 0:
            self.plain_ms.add(verify_ms)
            return
        decay = self.settings.decay
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < drafted else 0.0)
        if self.plain_ms.value is not None:
            self.verify_slope_ms.add((verify_ms - self.plain_ms.value) / drafted)
        self.verify_at.setdefault(drafted, _RecentLow()).add(verify_ms)
        self.drafted_rounds += 1
        per_token = self.draft_ms_per_token.value
        if unseen > ROUND_TOKENS:  # a round that caught the draft up: its time is mostly that forward
            self.catch_up_ms_per_token.add(max(0.0, draft_ms - drafted * (per_token or 0.0)) / unseen)
        elif self.drafted_rounds > 1:
            self.draft_ms_per_token.add(draft_ms / drafted)
