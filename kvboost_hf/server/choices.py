"""Several generations for one request: ``n``, ``best_of`` and list prompts on ``/v1/completions``.

Each generation is one ``generate_reply`` call through the ordinary path (reuse included: the
choices of one prompt share its prefix, so after the first the prompt comes from the store).
They run one after another on the request's worker today; with the batching scheduler they
become rows of the batch. ``best_of`` keeps the ``n`` candidates with the highest cumulative
logprob (OpenAI's rule); choice ``index`` is ``prompt_index * n + rank``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .admission import Admitted
from .generation import Reply, SamplingParams
from .logprobs import TokenLogprob
from .scheduler import Job


@dataclass
class PromptPlan:
    """One prompt of a request: its (admitted) tokens, how many candidates to generate and to keep."""

    admitted: Admitted
    candidates: int = 1
    keep: int = 1

    @property
    def prompt_ids(self) -> list[int]:
        return self.admitted.prompt_ids


@dataclass
class Choice:
    """A kept generation: its response ``index``, the reply and (with echo + logprobs) the prompt's logprobs."""

    index: int
    plan: PromptPlan
    reply: Reply
    prompt_logprobs: list[TokenLogprob] | None = None


# generate(plan, choice index, candidate number) -> Reply
GenerateOne = Callable[[PromptPlan, int, int], Reply]


def run_choices(plans: list[PromptPlan], generate: GenerateOne, cancelled: Callable[[], bool],
                prompt_logprobs: Callable[[list[int]], list[TokenLogprob]] | None = None) -> list[Choice]:
    """Generate every candidate of every plan in order and keep the best ``keep`` of each plan."""
    choices: list[Choice] = []
    for number, plan in enumerate(plans):
        replies: list[Reply] = []
        for candidate in range(plan.candidates):
            if cancelled():
                break
            replies.append(generate(plan, number * plan.keep + candidate, candidate))
        if plan.candidates > plan.keep:
            replies = sorted(replies, key=lambda r: r.cumulative_logprob, reverse=True)[: plan.keep]
        echoed = prompt_logprobs(plan.prompt_ids) if prompt_logprobs is not None and not cancelled() else None
        choices.extend(Choice(number * plan.keep + rank, plan, reply, echoed) for rank, reply in enumerate(replies))
    return choices


def empty_reply(prompt_tokens: int) -> Reply:
    """What ``max_tokens`` 0 (echo only) answers: no generated token, finish reason ``length``."""
    return Reply(text="", prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=0, finish_reason="length",
                 token_ids=[], logprobs=[])


def row_compatible(plan: PromptPlan, params: SamplingParams, tools: list[dict] | None, echo_logprobs: bool) -> bool:
    """Whether the batch scheduler can run this prompt as one row: one candidate, no logits processors
    (grammar, penalties, logit_bias), no logprobs or echo, no tools, no quantized-K/V plan.

    Anything else runs whole through ``generate_reply`` on the scheduler's thread, between steps.
    """
    plan_kv_bits = plan.admitted.plan.kv_bits if plan.admitted.plan is not None else None
    return (plan.candidates == 1 and params.processors is None and params.logprobs is None and not tools
            and not echo_logprobs and params.max_tokens > 0 and plan_kv_bits is None)


class RowJob(Job):
    """A one-choice job run as a batch row: its row events take the shape the routes expect of choices
    (``delta`` as ``(0, piece)``, ``done`` as ``[Choice]``)."""

    def __init__(self, work: Callable[[Job], Any], plan: PromptPlan) -> None:
        super().__init__(work)
        self.plan = plan

    def emit(self, kind: str, value: Any = None) -> None:
        if kind == "delta" and isinstance(value, str):
            value = (0, value)
        elif kind == "done" and isinstance(value, Reply):
            value = [Choice(0, self.plan, value)]
        super().emit(kind, value)
