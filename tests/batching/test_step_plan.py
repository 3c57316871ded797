"""The step scheduler's decisions (pure) and its limits' validation."""

from __future__ import annotations

import pytest

from kvboost_hf.batching import BatchLimits, plan_step
from kvboost_hf.batching.scheduler import admissions, prefill_chunks


def test_admissions_fill_the_batch_and_no_more():
    limits = BatchLimits(max_batch_size=4, max_batched_tokens=64)
    assert admissions(running=0, waiting=10, limits=limits) == 4
    assert admissions(running=3, waiting=10, limits=limits) == 1
    assert admissions(running=4, waiting=10, limits=limits) == 0
    assert admissions(running=1, waiting=2, limits=limits) == 2


def test_prefill_gets_the_budget_left_by_decoding_rows_first_come_first_served():
    limits = BatchLimits(max_batch_size=8, max_batched_tokens=64)
    assert prefill_chunks(decoding=4, remaining=[2000], limits=limits) == [60]
    assert prefill_chunks(decoding=4, remaining=[10, 2000, 5], limits=limits) == [10, 50, 0]
    assert prefill_chunks(decoding=0, remaining=[64, 1], limits=limits) == [64, 0]
    assert prefill_chunks(decoding=7, remaining=[], limits=limits) == []


def test_a_long_prompt_never_takes_more_than_one_step_budget():
    limits = BatchLimits(max_batch_size=16, max_batched_tokens=256)
    for decoding in range(0, 17):
        plan = plan_step(running=decoding + 1, waiting=0, decoding=decoding, remaining=[2000], limits=limits)
        assert decoding + sum(plan.chunks) == 256
        assert plan.admit == 0 if decoding + 1 >= 16 else True


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_batched_tokens=-3), "max_batched_tokens"),
    (dict(max_batch_size=2.5), "max_batch_size"),
    (dict(max_batch_size=16, max_batched_tokens=16), "max_batched_tokens"),
])
def test_bad_limits_name_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BatchLimits(**kwargs)


def test_chunks_of_similar_length_share_a_forward_and_padding_stays_bounded():
    from kvboost_hf.batching import group_chunks

    assert group_chunks([20, 18, 0, 22, 19]) == [[3, 0, 4, 1]]
    groups = group_chunks([200, 20, 18, 3, 0])
    assert groups[0] == [0]  # the long chunk is not padded onto short ones, nor they onto it
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    for group in groups:
        lengths = [[200, 20, 18, 3, 0][i] for i in group]
        assert max(lengths) * len(lengths) <= 1.5 * sum(lengths)
    assert group_chunks([0, 0]) == []
    assert group_chunks([5]) == [[0]]
