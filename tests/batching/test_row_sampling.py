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


class _Recorder:
    """A logits processor that records what it is given and then adds ``bias`` to token ``token``."""

    def __init__(self, token: int = 0, bias: float = 0.0) -> None:
        self.token, self.bias = token, bias
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids, scores):
        self.seen.append((input_ids.clone(), scores.clone()))
        scores = scores.clone()
        scores[:, self.token] += self.bias
        return scores


def test_processors_see_the_raw_logits_before_temperature_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    first, second = _Recorder(token=3, bias=10.0), _Recorder()
    sampling = RowSampling(temperature=0.25, top_p=0.5, seed=0, processors=[first, second])
    ids = torch.tensor([5, 6, 7])
    token = next_token(logits, sampling, ids)
    assert torch.equal(first.seen[0][1], logits.reshape(1, -1))  # raw: not divided by the temperature
    assert torch.equal(first.seen[0][0], ids.reshape(1, -1))  # the row's ids, [1, L]
    assert torch.equal(second.seen[0][1][0, :3], logits[:3]) and second.seen[0][1][0, 3] == 9.0  # in list order
    # The bias made token 3 the nucleus on its own: top-p ran after the processors.
    assert token == 3 and {next_token(logits, sampling, ids) for _ in range(20)} == {3}


def test_greedy_rows_take_the_argmax_after_their_processors():
    logits = torch.tensor([3.0, 1.0, 0.0])
    assert next_token(logits, RowSampling(temperature=0, processors=[_Recorder(token=2, bias=5.0)]),
                      torch.tensor([1])) == 2
    with pytest.raises(ValueError, match="input_ids"):
        next_token(logits, RowSampling(temperature=0, processors=[_Recorder()]))


def test_a_sequence_feeds_its_processors_its_tokens_and_records_raw_logprobs():
    from kvboost_hf.batching import Sequence

    recorder = _Recorder(token=4, bias=50.0)
    seq = Sequence([1, 2, 3], max_tokens=3, sampling=RowSampling(temperature=0, processors=[recorder]),
                   eos_ids=[], logprobs=2)
    logits = torch.tensor([0.0, 2.0, 1.0, 0.5, -1.0, 0.25])
    for _ in range(2):
        seq.sample(logits)
    assert seq.generated == [4, 4]  # the processor's choice...
    assert [row[0].tolist() for row, _ in recorder.seen] == [[1, 2, 3], [1, 2, 3, 4]]
    raw = torch.log_softmax(logits, dim=-1)
    entry = seq.logprobs[0]  # ... but the model's own logprob, before the processor
    assert entry.token_id == 4 and abs(entry.logprob - raw[4].item()) < 1e-6
    assert [i for i, _ in entry.top] == [1, 2] and abs(entry.top[0][1] - raw[1].item()) < 1e-6
    assert len(seq.logprobs) == len(seq.generated)
