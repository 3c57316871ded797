"""logit_bias and OpenAI's presence/frequency penalties as LogitsProcessors, against a hand computation."""

from __future__ import annotations

import torch

from kvboost_hf.server.decoding.processors import LogitBias, OpenAIPenalties, sampling_processors


def test_penalties_follow_openais_formula_by_hand():
    # prompt [7, 7, 3] is not counted; completion [5, 5, 5, 2]: counts c[5] = 3, c[2] = 1.
    input_ids = torch.tensor([[7, 7, 3, 5, 5, 5, 2]])
    scores = torch.arange(10, dtype=torch.float32)[None].clone()
    out = OpenAIPenalties(presence=0.5, frequency=0.25, prompt_len=3)(input_ids, scores)
    expected = scores.clone()
    expected[0, 5] = 5 - 3 * 0.25 - 0.5  # mu - c * alpha_frequency - (c > 0) * alpha_presence
    expected[0, 2] = 2 - 1 * 0.25 - 0.5
    assert torch.equal(out, expected)  # tokens 7 and 3 (prompt only) untouched


def test_negative_penalties_reward_repetition_and_rows_are_separate():
    input_ids = torch.tensor([[1, 4, 4], [1, 6, 9]])
    scores = torch.zeros(2, 10)
    out = OpenAIPenalties(presence=-1.0, frequency=-0.5, prompt_len=1)(input_ids, scores)
    assert out[0, 4] == 2.0 and out[0, 6] == 0.0
    assert out[1, 6] == 1.5 and out[1, 9] == 1.5 and out[1, 4] == 0.0


def test_no_completion_tokens_means_no_penalty():
    scores = torch.randn(1, 10)
    assert torch.equal(OpenAIPenalties(2.0, 2.0, prompt_len=3)(torch.tensor([[1, 2, 3]]), scores), scores)


def test_logit_bias_adds_to_token_ids_only():
    scores = torch.zeros(2, 8)
    out = LogitBias({3: 100.0, 5: -100.0})(torch.zeros(2, 1, dtype=torch.long), scores)
    assert out[:, 3].tolist() == [100.0, 100.0] and out[:, 5].tolist() == [-100.0, -100.0]
    assert out[:, [0, 1, 2, 4, 6, 7]].abs().sum() == 0
    assert scores.abs().sum() == 0  # the input is not modified in place


def test_sampling_processors_only_when_they_change_something():
    assert sampling_processors(1.0, 1.0) == []
    assert sampling_processors(0.0, 0.5) == []
    assert len(sampling_processors(0.7, 0.9)) == 2
