"""Several generations for one request: ``n``, ``best_of`` and list prompts on ``/v1/completions``.

With the batch scheduler every generation is a row of the batch (:func:`rows_request`): the
rows of one request run side by side with everyone else's, each with its own seed, logits
processors and logprobs, and stream as ``(index, piece)``. What rows cannot do (prompt scoring
for ``echo`` with logprobs, ``max_tokens`` 0, a quantized-K/V plan; see :func:`runs_as_rows`)
and the worker scheduler use :func:`run_choices`: one ``generate_reply`` call per generation,
one after another (reuse included: after the first, a prompt's choices find it in the store).
Either way ``best_of`` keeps the ``n`` candidates with the highest cumulative logprob (OpenAI's
rule) and choice ``index`` is ``prompt_index * n + rank``; candidate ``c`` of a seeded request
uses ``seed + c``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvboost_hf.server.decoding.logprobs import TokenLogprob
from kvboost_hf.server.engine.generation import Reply, SamplingParams
from kvboost_hf.server.scheduling.admission import Admitted
from kvboost_hf.server.scheduling.rows import RowRequest, RowsRequest


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


def candidate_params(params: SamplingParams, candidate: int) -> SamplingParams:
    """The settings of candidate ``candidate``: ``seed + candidate`` when seeded (candidate 0: the ``n = 1`` reply)."""
    if candidate == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + candidate)


def kept_choices(number: int, plan: PromptPlan, replies: list[Reply],
                 prompt_logprobs: list[TokenLogprob] | None = None) -> list[Choice]:
    """The choices prompt ``number`` keeps of its candidates' ``replies`` (in candidate order): all of
    them, or with ``best_of`` the ``plan.keep`` with the highest cumulative logprob (ties: candidate order)."""
    if plan.candidates > plan.keep:
        replies = sorted(replies, key=lambda r: r.cumulative_logprob, reverse=True)[: plan.keep]
    return [Choice(number * plan.keep + rank, plan, reply, prompt_logprobs) for rank, reply in enumerate(replies)]


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
        echoed = prompt_logprobs(plan.prompt_ids) if prompt_logprobs is not None and not cancelled() else None
        choices.extend(kept_choices(number, plan, replies, echoed))
    return choices


def empty_reply(prompt_tokens: int) -> Reply:
    """What ``max_tokens`` 0 (echo only) answers: no generated token, finish reason ``length``."""
    return Reply(text="", prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=0, finish_reason="length",
                 token_ids=[], logprobs=[])


def runs_as_rows(plans: list[PromptPlan], params: SamplingParams, echo_logprobs: bool) -> bool:
    """Whether the batch scheduler runs this request's generations as rows of the batch: anything but
    prompt scoring (``echo`` with logprobs), ``max_tokens`` 0, or a prompt planned on quantized K/V.

    Those run whole through :func:`run_choices` on the scheduler's thread, between steps: prompt
    scoring and a quantized cache are ``generate_reply`` / ``prompt_logprobs`` paths the batched
    forward does not have, and ``max_tokens`` 0 generates nothing.
    """
    quantized = any(p.admitted.plan is not None and p.admitted.plan.kv_bits is not None for p in plans)
    return not echo_logprobs and params.max_tokens > 0 and not quantized


def rows_request(plans: list[PromptPlan], params: SamplingParams, stream: bool) -> RowsRequest:
    """One row per candidate of every plan (streaming its deltas with ``index`` ``number * keep + candidate``,
    as :func:`run_choices` does); the job's result is the kept choices, ordered as :func:`run_choices` orders them."""
    rows, owners = [], []
    for number, plan in enumerate(plans):
        for candidate in range(plan.candidates):
            rows.append(RowRequest(plan.prompt_ids, candidate_params(params, candidate), stream, plan.admitted,
                                   index=number * plan.keep + candidate))
            owners.append(number)

    def result(replies: list[Reply | None]) -> list[Choice]:
        choices: list[Choice] = []
        for number, plan in enumerate(plans):
            mine = [r for r, owner in zip(replies, owners) if owner == number and r is not None]
            choices.extend(kept_choices(number, plan, mine))
        return choices

    return RowsRequest(rows, result)
