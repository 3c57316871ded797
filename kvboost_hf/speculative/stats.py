"""Per-request speculation statistics: rounds, drafted and accepted tokens, costs, controller choices."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpeculationStats:
    """What speculative decoding did in one generate call.

    A round is one target forward: it verifies ``drafted`` candidate tokens (0 in a plain round)
    and yields ``accepted + 1`` tokens. ``accepted_histogram[a]`` counts speculative rounds that
    accepted ``a`` tokens. ``draft_ms`` is time spent proposing, ``verify_ms`` time in target
    forwards of speculative rounds, ``plain_ms`` in plain rounds; the first round (the prompt
    prefill) is counted apart in ``prefill_ms``. ``choices`` is the controller's draft length per
    round (run-length encoded as ``[length, rounds]`` pairs); ``off_reason`` says why it switched
    speculation off, if it did.
    """

    draft: str = ""
    rounds: int = 0
    speculative_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    plain_ms: float = 0.0
    prefill_ms: float = 0.0
    choices: list[list[int]] = field(default_factory=list)
    off_reason: str = ""
    draft_reused_tokens: int = 0
    draft_prompt_tokens: int = 0
    draft_given_tokens: int = 0  # prompt tokens whose K/V a self-draft took from the target's cache

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens generated per target forward after the prefill (1.0 for plain decoding)."""
        later = self.rounds - 1
        return (later + self.accepted_tokens) / later if later > 0 else 0.0

    def record_round(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float, first: bool) -> None:
        self.rounds += 1
        self.draft_ms += draft_ms
        if first:
            self.prefill_ms += verify_ms
        elif drafted:
            self.verify_ms += verify_ms
        else:
            self.plain_ms += verify_ms
        if drafted:
            self.speculative_rounds += 1
            self.drafted_tokens += drafted
            self.accepted_tokens += accepted
            if len(self.accepted_histogram) <= accepted:
                self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
            self.accepted_histogram[accepted] += 1

    def record_choice(self, length: int) -> None:
        if self.choices and self.choices[-1][0] == length:
            self.choices[-1][1] += 1
        else:
            self.choices.append([length, 1])

    def to_dict(self) -> dict:
        out = asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["tokens_per_round"] = self.tokens_per_round
        return out
