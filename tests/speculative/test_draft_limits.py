"""Drafts never carry decoding past a stop string, and a sampled request's tokens depend only on its seed.

transformers' assisted decoding asks stopping criteria about the end of a round only, so a stop
string completed by an accepted draft token in mid-round was missed (``draft="prompt-lookup"`` ran
to ``max_new_tokens``). And its sampling drew the random numbers of a round in one call whose shape
is the draft length, which our controller picks from wall-clock costs: one seed, several replies.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

from kvboost_hf import ControllerSettings, make_draft, make_head_draft
from kvboost_hf.speculative.draft_limits import DraftLimits, draft_limits
from tests.conftest import VOCAB, make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
ALWAYS = ControllerSettings(adaptive=False, max_tokens=6, start_tokens=1, probe_tokens=1)
PROMPT = torch.tensor([[1, 5, 9, 7, 5, 9, 7, 5, 9, 11, 13, 5, 9, 7]])


def _drafts(target) -> list:
    return ["prompt-lookup", "store", make_draft(target, bits=8), make_head_draft(target)]


def _tokenizer():
    """Word-level, ``" w<i>"`` per token; it knows ``abcdef``, which HF's StopStringCriteria tokenizes to
    find how tokens print."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "abcdef": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _stop_string(tokenizer, generated: list[int], after: int) -> tuple[str, int]:
    """A stop string of two tokens' text, completed first by generated token ``j >= after``: (string, j)."""
    pieces = [" " + piece for piece in tokenizer.convert_ids_to_tokens(generated)]
    for j in range(after, len(pieces)):
        stop = pieces[j - 1] + pieces[j]
        text = "".join(pieces[: j + 1])
        if text.find(stop) + len(stop) == len(text):
            return stop, j
    raise AssertionError("no usable stop string in the reply")


@pytest.mark.parametrize("family, seed", [("llama", 6), ("qwen2", 6), ("mistral", 5)])
def test_stop_strings_end_a_draft_request_where_plain_decoding_ends(family, seed, reuse):
    target = make_tiny(family, seed=seed)
    tokenizer = _tokenizer()
    reuse(target)
    full = target.generate(PROMPT, max_new_tokens=40, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    checked = 0
    for after in (4, 9, 15):
        stop, j = _stop_string(tokenizer, full, after)
        plain = target.generate(PROMPT, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        assert plain.shape[1] == PROMPT.shape[1] + j + 1  # plain decoding stops at the completing token
        for draft in _drafts(target):
            out = target.generate(PROMPT, max_new_tokens=40, do_sample=False, stop_strings=[stop],
                                  tokenizer=tokenizer, draft=draft, speculation=ALWAYS)
            assert out.tolist() == plain.tolist(), (stop, getattr(draft, "draft_name", draft))
            checked += 1
    assert checked == 3 * len(_drafts(target))


class _StopAfterText(StoppingCriteria):
    """A side-effect-free criterion of the kind the server uses: stop once the ids contain ``ids``."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.calls = ids, 0

    def would_stop(self, input_ids: torch.LongTensor) -> bool:
        row, n = input_ids[0].tolist(), len(self.ids)
        return any(row[i : i + n] == self.ids for i in range(PROMPT.shape[1], len(row) - n + 1))

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        self.calls += 1
        return torch.tensor([self.would_stop(input_ids)])


def test_a_side_effect_free_criterion_of_the_caller_cuts_drafts_too(reuse):
    target = make_tiny("llama", seed=6)
    reuse(target)
    full = target.generate(PROMPT, max_new_tokens=30, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    ids = full[10:12]
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False,
                            stopping_criteria=StoppingCriteriaList([_StopAfterText(ids)]))
    for draft in _drafts(target):
        out = target.generate(PROMPT, max_new_tokens=30, do_sample=False, draft=draft, speculation=ALWAYS,
                              stopping_criteria=StoppingCriteriaList([_StopAfterText(ids)]))
        assert out.tolist() == plain.tolist()


def test_limits_cut_before_the_completing_token_and_at_a_constraint():
    class Upto:  # allows draft tokens while they are below 50
        def allowed_prefix(self, input_ids, draft):
            return next((i for i, t in enumerate(draft) if t >= 50), len(draft))

    class StopOn:
        def would_stop(self, input_ids):
            return int(input_ids[0, -1]) == 7

    ids = torch.tensor([[1, 2, 3]])
    assert DraftLimits([Upto()]).allowed(ids, torch.tensor([4, 5, 60, 6])) == 2
    assert DraftLimits(stops=[StopOn()]).allowed(ids, torch.tensor([4, 5, 7, 6])) == 2
    assert DraftLimits([Upto()], [StopOn()]).allowed(ids, torch.tensor([7, 60])) == 0
    assert not draft_limits([], None, None, [])
    with pytest.raises(ValueError, match="tokenizer"):
        draft_limits([], ["x"], None, [])


def test_the_assisted_loop_reads_do_sample_after_asking_for_the_candidate_generator():
    """Our sampled requests become greedy over perturbed scores by flipping ``do_sample`` inside
    ``_get_candidate_generator``: that works only while the loop reads it afterwards."""
    source = inspect.getsource(GenerationMixin._assisted_decoding)
    asked = source.index("self._get_candidate_generator(")
    read = source.index("do_sample = generation_config.do_sample")
    assert asked < read
    assert "logits_processor(candidate_input_ids[:, : cur_len + i]" in source


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_seeded_sampled_reply_does_not_depend_on_the_draft_length_or_kind(family, reuse):
    target = make_tiny(family, seed=4)
    reuse(target)
    replies = []
    settings = [ControllerSettings(adaptive=False, max_tokens=k, start_tokens=1, probe_tokens=1) for k in (1, 3, 7)]
    runs = [(d, s) for d in ("prompt-lookup", "store") for s in settings]
    runs += [(make_draft(target, bits=8), settings[1]), (make_head_draft(target), settings[2]),
             ("prompt-lookup", ControllerSettings(min_gain=0.5))]
    for draft, setting in runs:
        torch.manual_seed(123)
        out = target.generate(PROMPT, max_new_tokens=30, do_sample=True, temperature=1.3, top_k=20,
                              draft=draft, speculation=setting)
        replies.append(out[0].tolist())
    assert all(r == replies[0] for r in replies), replies
    torch.manual_seed(124)
    other = target.generate(PROMPT, max_new_tokens=30, do_sample=True, temperature=1.3, top_k=20,
                            draft="prompt-lookup", speculation=settings[0])
    assert other[0].tolist() != replies[0]  # the seed decides
