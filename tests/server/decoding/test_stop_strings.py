"""Stop strings: the matcher agrees with ``str.find`` and with the old hold-back rule, costs the new
characters only (not the stop strings' length), the stop criterion answers ``would_stop`` without
changing state, and the request bounds the stop strings' total length."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvboost_hf.server.api.requests import MAX_STOP_CHARS, CompletionRequest
from kvboost_hf.server.decoding.stop_strings import StopStrings, common_prefix_length
from kvboost_hf.server.engine.generation import ReplyText, SamplingParams, generate_reply
from tests.server.conftest import tiny_tokenizer


def naive_first(text: str, stops: list[str]) -> int | None:
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(cuts) if cuts else None


def naive_hold(text: str, stops: list[str]) -> int:
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


@pytest.mark.parametrize("seed", range(6))
def test_matcher_agrees_with_find_and_the_old_hold_back_rule(seed):
    rng = random.Random(seed)
    alphabet = "abc"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    matcher = StopStrings(stops)
    text = ""
    for _ in range(60):
        if text and rng.random() < 0.2:  # a decode that rewrote the last characters
            text = text[: rng.randint(0, len(text))]
        text += "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        assert matcher.find(text) == naive_first(text, stops)  # pure, before moving
        assert matcher.scan(text) == naive_first(text, stops), (stops, text)
        if naive_first(text, stops) is None:
            assert matcher.held_back == naive_hold(text, stops), (stops, text)


def test_find_is_pure_and_answers_for_other_texts():
    matcher = StopStrings(["END", "ab"])
    assert matcher.scan("xxEN") is None and matcher.held_back == 2
    assert matcher.find("xxEND") == 2 and matcher.find("xxaab") == 3 and matcher.find("xxE") is None
    assert matcher.text == "xxEN" and matcher.held_back == 2  # nothing moved
    assert matcher.scan("xxENDab") == 2


def test_common_prefix_length():
    assert common_prefix_length("abc", "abcd") == 3
    assert common_prefix_length("abcx", "abcy") == 3
    assert common_prefix_length("", "a") == 0 and common_prefix_length("ab", "") == 0
    assert common_prefix_length("zab", "ab") == 0


def test_each_token_costs_its_new_characters_not_the_stop_length():
    """16 long stop strings: the automaton's work per token is the token's characters (its trie is built
    once); the old rule did up to len(stop) endswith calls on every stop per token."""
    tokenizer = tiny_tokenizer()
    stops = [f"w{n} " * 2000 + "w3" for n in range(5, 21)]  # 16 stops of ~8,000 characters
    reply = ReplyText(tokenizer, stops)
    steps = []
    original = StopStrings._step

    def counting(self, state, ch):
        steps.append(ch)
        return original(self, state, ch)

    StopStrings._step = counting
    try:
        ids: list[int] = []
        for i in range(200):
            ids.append(5 + i % 3)
            before = len(reply.text)
            steps.clear()
            reply.update(ids)
            reply.delta()
            assert len(steps) == len(reply.text) - before  # one automaton step per new character
    finally:
        StopStrings._step = original
    assert not reply.stopped


def test_hold_back_streams_text_that_cannot_become_a_stop():
    tokenizer = tiny_tokenizer()
    reply = ReplyText(tokenizer, ["w7 w8 w9"])
    reply.update([5, 6, 7])  # "w5 w6 w7": "w7" may begin the stop
    assert reply.delta() == "w5 w6 "
    reply.update([5, 6, 7, 8])
    assert reply.delta() == ""
    reply.update([5, 6, 7, 8, 10])  # "... w7 w8 w10": no longer a stop prefix
    assert reply.delta() == "w7 w8 w10" and not reply.stopped
    reply.update([5, 6, 7, 8, 10, 7, 8, 9])
    assert reply.stopped and reply.text == "w5 w6 w7 w8 w10 "


class CapturingModel:
    """Stands in for a model: ``generate`` keeps the stopping criteria it is given and returns the prompt."""

    device = torch.device("cpu")
    generation_config = SimpleNamespace(pad_token_id=None)

    def __init__(self) -> None:
        self.criteria = None

    def generate(self, input_ids, **kwargs):
        self.criteria = kwargs["stopping_criteria"]
        return input_ids


def test_would_stop_is_pure_and_completing_length_finds_the_stop_token():
    tokenizer = tiny_tokenizer()
    model = CapturingModel()
    prompt = [1, 4]
    generate_reply(model, tokenizer, prompt, SamplingParams(max_tokens=4, temperature=0, stop=["w9"]), [2])
    (criterion,) = [c for c in model.criteria if hasattr(c, "would_stop")]  # what generate (and drafts) see
    reply = criterion.reply
    ids = torch.tensor([prompt + [5, 6]])
    assert not criterion(ids, None).any()
    state = (reply.text, reply.num_tokens, reply.stopped, reply.matcher.text, reply.matcher.held_back)
    assert criterion.would_stop(torch.tensor([prompt + [5, 6, 9]]))
    assert criterion.would_stop(torch.tensor([prompt + [5, 6, 7, 9, 8]]))
    assert not criterion.would_stop(torch.tensor([prompt + [5, 6, 7, 8]]))
    assert state == (reply.text, reply.num_tokens, reply.stopped, reply.matcher.text, reply.matcher.held_back)
    assert reply.delta() == "w5 w6"  # nothing was handed out or held back differently
    # A round of assisted decoding appended tokens past the one completing the stop: keep up to it.
    generated = [5, 6, 9, 7, 8]
    assert criterion(torch.tensor([prompt + generated]), None).all()
    assert reply.completing_length(generated) == 3 and reply.text == "w5 w6 "
    assert ReplyText(tokenizer, ["w9"]).completing_length(generated) == 5  # not stopped: all of them


def test_stop_strings_total_length_is_bounded():
    base = dict(model="m", prompt="x")
    assert CompletionRequest(**base, stop=["a" * (MAX_STOP_CHARS // 2)] * 2).stop
    with pytest.raises(ValueError, match="stop strings"):
        CompletionRequest(**base, stop=["a" * (MAX_STOP_CHARS // 2), "b" * (MAX_STOP_CHARS // 2 + 1)])
