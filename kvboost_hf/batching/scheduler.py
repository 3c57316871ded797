"""What one step does: which waiting requests join, which prompts get a prefill chunk, which rows
decode. Decides only (pure functions over counts); :mod:`.runner` executes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BatchLimits:
    """``max_batch_size`` requests run at once (decoding or prefilling); a step forwards at most
    ``max_batched_tokens`` tokens: one per decoding row, the rest to prompt chunks."""

    max_batch_size: int = 32
    max_batched_tokens: int = 160

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_batched_tokens <= self.max_batch_size:
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must exceed max_batch_size ({self.max_batch_size}): "
                "a full batch of decoding rows would leave no tokens for prefilling new prompts"
            )


@dataclass
class StepPlan:
    """Admit the first ``admit`` waiting requests, then forward ``chunks[i]`` prompt tokens of the
    i-th prefilling row (in admission order; 0: not this step), and decode every decoding row."""

    admit: int = 0
    chunks: list[int] = field(default_factory=list)


def admissions(running: int, waiting: int, limits: BatchLimits) -> int:
    """How many waiting requests join a batch of ``running`` requests now."""
    return max(0, min(waiting, limits.max_batch_size - running))


def prefill_chunks(decoding: int, remaining: list[int], limits: BatchLimits) -> list[int]:
    """Prompt tokens to forward this step for each prefilling row (``remaining`` tokens each, oldest
    first): the step's token budget left after one token per decoding row, first come first served."""
    budget = limits.max_batched_tokens - decoding
    chunks = []
    for left in remaining:
        n = max(0, min(left, budget))
        chunks.append(n)
        budget -= n
    return chunks


def plan_step(running: int, waiting: int, decoding: int, remaining: list[int], limits: BatchLimits) -> StepPlan:
    """The admissions and prefill chunks of one step (``remaining`` covers rows already admitted)."""
    return StepPlan(admit=admissions(running, waiting, limits), chunks=prefill_chunks(decoding, remaining, limits))


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def waits_for_prefill(prompt_ids: list[int], in_flight: list[tuple[list[int], int]], chunk_tokens: int) -> bool:
    """Whether a new row should wait before its store lookup: some row still prefilling computes at least
    ``chunk_tokens`` of this prompt's prefix that the store does not hold yet (``in_flight``: each prefilling
    row's prompt and how many of its first tokens it loaded from the store). That row publishes its prompt
    once prefilled, and the waiting row then reuses it exactly, instead of computing it again beside it
    (what vLLM's block sharing gets by hashing blocks as they fill)."""
    for other, loaded in in_flight:
        if common_prefix(prompt_ids, other) - loaded >= chunk_tokens:
            return True
    return False


def group_chunks(chunks: list[int], max_padding: float = 0.5) -> list[list[int]]:
    """Indices of ``chunks`` (tokens per prefilling row; 0 = none this step) grouped into batched
    forwards: rows are left-padded to the longest of their group, so a group is closed when its
    padded size would exceed ``1 + max_padding`` times its real tokens."""
    order = sorted((i for i, n in enumerate(chunks) if n > 0), key=lambda i: -chunks[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            widest = chunks[group[0]]
            real = sum(chunks[k] for k in group) + chunks[i]
            if widest * (len(group) + 1) <= (1 + max_padding) * real:
                group.append(i)
                continue
        groups.append([i])
    return groups
