"""``longest_sequence``: the most tokens a generate call's sequence can hold, as transformers bounds it."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from kvboost_hf.generation.sequence import longest_sequence


class _Model:
    generation_config = GenerationConfig(max_length=50)


def test_max_new_tokens_counts_past_the_prompt_and_the_calls_setting_wins():
    ids = torch.ones(1, 7, dtype=torch.long)
    assert longest_sequence(_Model(), ids, {"max_new_tokens": 5}) == 12
    assert longest_sequence(_Model(), ids, {"generation_config": GenerationConfig(max_new_tokens=9)}) == 16
    assert longest_sequence(_Model(), ids, {"generation_config": GenerationConfig(max_new_tokens=9),
                                            "max_new_tokens": 3}) == 10


def test_max_length_bounds_the_call_where_no_max_new_tokens_is_set():
    ids = torch.ones(1, 7, dtype=torch.long)
    assert longest_sequence(_Model(), ids, {}) == 50
    assert longest_sequence(_Model(), ids, {"max_length": 20}) == 20
    assert longest_sequence(_Model(), ids, {"max_length": 3}) == 8  # a prompt past it is still forwarded
    assert longest_sequence(_Model(), ids, {"max_new_tokens": None, "max_length": 20}) == 20


def test_embeds_count_as_the_prompt_and_no_prompt_is_unknown():
    assert longest_sequence(_Model(), None, {"inputs_embeds": torch.zeros(1, 4, 8), "max_new_tokens": 2}) == 6
    assert longest_sequence(_Model(), None, {"max_new_tokens": 2}) is None
