"""Per-row sampling: the row's own generator and warpers."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf.batching import RowSampling, next_token
from tests.conftest import random_ids


def test_seeded_rows_draw_the_same_tokens_whatever_else_is_drawn():
    logits = torch.randn(50, 96, generator=torch.Generator().manual_seed(0))
    alone = RowSampling(temperature=0.9, top_p=0.8, seed=7)
    together, other = RowSampling(temperature=0.9, top_p=0.8, seed=7), RowSampling(temperature=1.3, seed=None)
    a = [next_token(row, alone) for row in logits]
    b = []
    for row in logits:
        next_token(row * 2, other)  # a companion row draws in between
        torch.rand(3)  # and so does the global RNG
        b.append(next_token(row, together))
    assert a == b
    assert len(set(a)) > 5  # it really sampled
    assert a != [next_token(row, RowSampling(temperature=0.9, top_p=0.8, seed=8)) for row in logits]


def test_seeded_sampling_draws_what_generate_draws_with_that_seed(tiny_models):
    model = tiny_models["llama"]
    prompt = random_ids(12, seed=3)
    torch.manual_seed(11)
    out = model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.9, top_k=0,
                         pad_token_id=0, eos_token_id=None)
    expected = out[0, 12:].tolist()
    sampling, ids = RowSampling(temperature=0.7, top_p=0.9, seed=11), prompt[0].tolist()
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(next_token(logits, sampling, torch.tensor(ids)))
    assert ids[12:] == expected


def test_greedy_is_the_argmax_and_never_draws():
    sampling = RowSampling(temperature=0, seed=1)
    state = sampling.generator.get_state()
    logits = torch.tensor([0.1, 3.0, -2.0, 2.9])
    assert next_token(logits, sampling) == 1
    assert torch.equal(sampling.generator.get_state(), state)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    sampling = RowSampling(temperature=1.0, top_p=0.5, seed=0)
    assert {next_token(logits, sampling) for _ in range(50)} == {0}


@pytest.mark.parametrize("kwargs, name", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                          (dict(top_p=1.5), "top_p")])
def test_bad_sampling_settings_name_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RowSampling(**kwargs)
