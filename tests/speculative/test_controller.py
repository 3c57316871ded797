"""The adaptive draft length, driven by synthetic costs and acceptances (no timing involved)."""

from __future__ import annotations

import pytest

from kvboost_hf.speculative.controller import ControllerSettings, DraftController, expected_tokens


def _run(controller: DraftController, rounds: int, accept, plain_ms=100.0, slope_ms=10.0, draft_ms=2.0):
    """Feed ``rounds`` rounds; ``accept(k)`` says how many of k drafted tokens the target keeps."""
    choices = []
    for _ in range(rounds):
        k = controller.choose()
        choices.append(k)
        a = accept(k) if k else 0
        controller.observe(k, a, draft_ms * k, plain_ms + slope_ms * k)
    return choices


def test_first_two_rounds_are_plain_then_it_speculates():
    choices = _run(DraftController(), 6, accept=lambda k: k)
    assert choices[:2] == [0, 0]  # prefill round (TTFT unchanged) and a plain-step measurement
    assert choices[2] == ControllerSettings().start_tokens
    assert all(k > 0 for k in choices[3:])


def test_perfect_cheap_drafts_grow_to_the_maximum():
    controller = DraftController(ControllerSettings(max_tokens=8))
    choices = _run(controller, 30, accept=lambda k: k, slope_ms=2.0, draft_ms=0.0)
    assert choices[-1] == 8 and controller.alpha > 0.9 and controller.off_reason == ""


def test_useless_drafts_switch_off_and_back_off_doubles():
    settings = ControllerSettings(backoff_rounds=8)
    controller = DraftController(settings)
    choices = _run(controller, 200, accept=lambda k: 0)
    speculative = [i for i, k in enumerate(choices) if k]
    # a start round and a few rounds while the prior fades, then probes after 8, 16, 32, 64... plain rounds
    # (the first probe's count is verified twice before it is believed: one round may pay a one-off cost)
    assert len(speculative) <= 9, speculative
    probes = [i for i in speculative if i > 10]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(gaps) >= 2 and all(b >= 2 * a - 1 for a, b in zip(gaps, gaps[1:])), probes
    assert "predicted" in controller.off_reason


def test_expensive_verification_keeps_it_off_even_with_fair_acceptance():
    # 60% acceptance, but each verified token costs as much as a plain step: never pays
    controller = DraftController()
    choices = _run(controller, 60, accept=lambda k: int(0.6 * k), slope_ms=100.0, draft_ms=5.0)
    assert sum(1 for k in choices if k) <= 5  # a count is verified twice before it is believed


def test_it_comes_back_when_drafts_start_paying():
    controller = DraftController(ControllerSettings(backoff_rounds=4))
    quality = {"good": False}
    accept = lambda k: k if quality["good"] else 0  # noqa: E731
    _run(controller, 20, accept)
    assert controller.choose() == 0 or controller.off_until >= 0
    quality["good"] = True
    choices = _run(controller, 40, accept, slope_ms=5.0)
    assert choices[-1] > 1


def test_fixed_mode_always_drafts_the_maximum():
    controller = DraftController(ControllerSettings(adaptive=False, max_tokens=5))
    assert _run(controller, 5, accept=lambda k: 0) == [5] * 5


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(start_tokens=9), dict(probe_tokens=0), dict(min_gain=0),
                                 dict(decay=0), dict(backoff_rounds=0)])
def test_bad_settings_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ControllerSettings(**bad)


def test_costs_carry_over_to_the_next_request():
    first = DraftController()
    _run(first, 20, accept=lambda k: k, slope_ms=2.0, draft_ms=0.5)
    memory = first.memory()
    assert memory.plain_ms == pytest.approx(100.0) and memory.verify_slope_ms == pytest.approx(2.0)
    second = DraftController(memory=memory)
    assert second.accepted + second.rejected == pytest.approx(2.0)  # carried-over acceptance: a weak prior
    assert second.alpha > 0.9
    choices = _run(second, 3, accept=lambda k: k, slope_ms=2.0, draft_ms=0.5)
    assert choices[0] == 0 and choices[1] > 1  # still no draft at the prefill, but no plain measuring round
    poor = DraftController()
    _run(poor, 60, accept=lambda k: 0)
    assert _run(DraftController(memory=poor.memory()), 4, accept=lambda k: 0)[1] == 0  # stays off from round 1


def test_a_catch_up_that_costs_more_than_speculation_saves_is_skipped():
    """A model draft that must first forward a long prompt: measured once, then only paid where it pays."""
    first = DraftController()
    for unseen, k in ((0, 0), (0, 0)):  # prefill round, plain measurement
        assert first.choose(unseen, 100) == k
        first.observe(0, 0, 0.0, 100.0)
    assert first.choose(600, 100) == ControllerSettings().start_tokens  # catch-up cost unknown: learn it
    first.observe(4, 4, 600 * 2.0 + 4 * 5.0, 140.0, unseen=600)  # 2 ms per caught-up token
    assert first.catch_up_ms_per_token.value == pytest.approx(2.0, rel=0.05)  # per-token cost not known yet: included
    assert first.draft_ms_per_token.value is None  # a catch-up round is no sample of the per-token cost
    memory = first.memory()
    # Next request: 600 unseen prompt tokens (~1.2 s) but 10 tokens left (1 s of plain decoding): speculation
    # could save at most 1 s x (1 - 1/gain), less than the catch-up.
    short = DraftController(memory=memory)
    short.observe(0, 0, 0.0, 100.0)  # prefill round
    assert short.choose(600, 10) == 0 and "catch-up" in short.off_reason
    assert all(short.choose(600, 10) == 0 for _ in range(5))
    # With 1,000 tokens left the same catch-up is worth it.
    long = DraftController(memory=memory)
    long.observe(0, 0, 0.0, 100.0)
    assert long.choose(600, 1000) > 0
    # Ordinary rounds (at most two unseen tokens) are never charged a catch-up.
    assert long.choose(2, 1) > 0



def test_a_min_gain_at_or_below_one_allows_any_catch_up():
    """min_gain <= 1 means speculate even at a loss: a catch-up is then never a reason not to."""
    first = DraftController()
    for _ in range(2):
        first.choose(0, 100)
        first.observe(0, 0, 0.0, 100.0)
    first.choose(600, 100)
    first.observe(4, 4, 600 * 2.0 + 4 * 5.0, 140.0, unseen=600)
    keen = DraftController(ControllerSettings(min_gain=1e-6), memory=first.memory())
    keen.observe(0, 0, 0.0, 100.0)  # prefill round
    assert keen.choose(600, 10) > 0
    default = DraftController(memory=first.memory())
    default.observe(0, 0, 0.0, 100.0)
    assert default.choose(600, 10) == 0  # the same catch-up under the default min_gain


def test_short_proposals_do_not_make_long_drafts_look_expensive():
    """Measured on CPU: a forward of k + 1 rows costs far less than k + 1 steps, less per row as k grows.
    A lookup often proposes fewer tokens than asked (the match ends): rounds of 2 tokens then priced
    every long draft at their per-token slope. Costs kept per drafted count do not mix them up."""
    costs = {0: 100.0, 1: 150.0, 2: 180.0, 4: 220.0, 8: 270.0, 16: 330.0}  # a concave cost curve

    def verify(k):  # piecewise linear through the points above
        ks = sorted(costs)
        for k0, k1 in zip(ks, ks[1:]):
            if k <= k1:
                return costs[k0] + (costs[k1] - costs[k0]) * (k - k0) / (k1 - k0)
        return costs[16]

    c = DraftController(ControllerSettings(max_tokens=16))
    chosen = []
    for i in range(60):
        k = c.choose()
        drafted = min(k, 2) if i % 2 else k  # every other proposal is cut short
        c.observe(drafted, drafted if i % 7 else max(0, drafted - 2), 0.1 * drafted, verify(drafted))
        chosen.append(k)
    assert min(chosen[-20:]) >= 15, chosen  # a single slope: 11..16
    assert abs(c.verify_ms(16) - 330.0) < 1.0 and abs(c.verify_ms(6) - 245.0) < 1.0
    linear = DraftController(ControllerSettings(max_tokens=16))
    linear.plain_ms.value, linear.verify_slope_ms.value = 100.0, 30.0  # only a slope known: linear pricing
    assert linear.verify_ms(16) == 100.0 + 30.0 * 16


def test_a_round_slowed_once_does_not_price_its_count_or_longer_drafts_out():
    """The first forward at a new row count pays one-off costs (measured on CPU: 3-7x a later one), and
    another process can slow any round. Copying-like acceptance must still reach long drafts, and one
    slow round must not switch speculation off for a back-off."""
    controller = DraftController(ControllerSettings(max_tokens=16))
    seen, chosen = set(), []
    for i in range(60):
        k = controller.choose()
        cost = 100.0 + 5.0 * k
        if k and k not in seen:
            cost *= 4.0  # first call at this shape
        if i % 9 == 4:
            cost *= 3.0  # another process ran
        seen.add(k)
        controller.observe(k, k if i % 10 else max(0, k - 1), 0.0, cost)
        chosen.append(k)
    assert min(chosen[-20:]) >= 12, chosen
    assert 0 not in chosen[3:], chosen  # never switched off
    assert controller.verify_ms(16) == pytest.approx(180.0)
