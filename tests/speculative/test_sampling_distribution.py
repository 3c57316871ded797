"""Speculative sampling preserves the target's distribution; biased samplers fail the same test.

On a tiny model with an 8-token vocabulary, the first generated token of many seeded draws is
compared with the target's softmax at the prompt's end (total variation). The draft is a
different random model, so its distribution is far from the target's. A sampled speculative
request is greedy decoding of position-seeded Gumbel-perturbed scores (kvboost_hf.speculative.seeded):
leaving the noise out, or drawing it from one seed for every request, must be caught.
"""

from __future__ import annotations

import pytest
import torch

import kvboost_hf.speculative.request as speculation_request
from kvboost_hf import ControllerSettings, last_request_stats, make_draft
from tests.conftest import make_tiny

VOCAB = 8
DRAWS = 1500
# Sampling noise of the empirical TV at 1,500 draws over 8 outcomes is about 0.02-0.03 here
# (sum over tokens of sqrt(p(1-p) / (2 pi N))); 0.06 leaves room, and the biased rule measures
# well above it (asserted below through the draft's own distance to the target).
TV_BOUND = 0.06
# The biased rules give one token every draw (the target's mode; the one seed's outcome): their empirical
# distribution is a point mass whatever the number of draws, so a few hundred show it (CI time).
BIASED_DRAWS = 200
pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny generate calls
ALWAYS = ControllerSettings(adaptive=False, max_tokens=3, start_tokens=1, probe_tokens=1)


def _models():
    target = make_tiny("llama", seed=21, vocab_size=VOCAB)
    draft = make_tiny("llama", seed=22, vocab_size=VOCAB, num_layers=1)
    with torch.no_grad():  # sharpen both so their next-token distributions differ clearly
        target.lm_head.weight.mul_(6.0)
        draft.lm_head.weight.mul_(6.0)
    return target, draft


def _first_token_histogram(model, prompt, draft, temperature=1.0, draws=DRAWS) -> torch.Tensor:
    counts = torch.zeros(VOCAB)
    for seed in range(draws):
        torch.manual_seed(seed)
        out = model.generate(prompt, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=0,
                             draft=draft, speculation=ALWAYS)
        counts[out[0, prompt.shape[1]]] += 1
    return counts / draws


def _next_token_probs(model, prompt, temperature=1.0) -> torch.Tensor:
    with torch.no_grad():
        return (model(prompt).logits[0, -1] / temperature).softmax(-1)


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


@pytest.mark.parametrize("rule", ["ours", "no-noise", "one-seed"])
def test_first_token_distribution(rule, reuse, monkeypatch):
    target, draft = _models()
    prompt = torch.tensor([[1, 5, 3, 6, 4]])
    p = _next_token_probs(target, prompt)
    q = _next_token_probs(draft, prompt)
    assert _tv(p, q) > 3 * TV_BOUND  # the test can tell the two distributions apart
    if rule == "no-noise":  # plain greedy: the target's mode every time
        monkeypatch.setattr(speculation_request.PositionGumbel, "__call__", lambda self, ids, scores: scores)
    elif rule == "one-seed":  # the same noise for every request: one outcome
        monkeypatch.setattr(speculation_request, "request_seed", lambda: 7)
    reuse(target)
    empirical = _first_token_histogram(target, prompt, draft, draws=DRAWS if rule == "ours" else BIASED_DRAWS)
    spec = last_request_stats(target).speculation
    assert spec.speculative_rounds >= 1 and spec.drafted_tokens >= 1
    print(f"{rule}: TV(empirical, target) = {_tv(empirical, p):.4f}, TV(draft, target) = {_tv(q, p):.4f}")
    if rule == "ours":
        assert _tv(empirical, p) < TV_BOUND, (empirical, p)
    else:
        assert _tv(empirical, p) > TV_BOUND, (empirical, p)
        assert int((empirical > 0).sum()) == 1, empirical  # the point mass that BIASED_DRAWS relies on


def test_restricted_vocabulary_draft_and_lookup_keep_the_distribution(reuse):
    """A self-draft whose head knows 3 of 8 tokens (q = 0 elsewhere) and a lookup draft (no logits)."""
    target, _ = _models()
    prompt = torch.tensor([[1, 5, 3, 6, 4, 5, 3]])
    p = _next_token_probs(target, prompt, temperature=0.7)

    class Tokenizer:  # three token ids are frequent in the "corpus"
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(t) for t in text.split()]}

        def get_vocab(self):
            return {str(i): i for i in range(VOCAB)}

        all_special_ids: list[int] = []

    draft = make_draft(target, bits=8, vocab=3, tokenizer=Tokenizer(), texts=["3 3 3 5 5 7 4"])
    reuse(target)
    for kind in (draft, "prompt-lookup"):
        empirical = _first_token_histogram(target, prompt, kind, temperature=0.7)
        print(f"{getattr(kind, 'draft_name', kind)}: TV(empirical, target) = {_tv(empirical, p):.4f}")
        assert _tv(empirical, p) < TV_BOUND, (kind, empirical, p)
