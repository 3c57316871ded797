"""row_blocked_head: multi-row logits of a tall CPU head in row blocks, only where bitwise identical."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from kvboost_hf.speculative import verify_head
from kvboost_hf.speculative.verify_head import block_rows, blocked_linear, row_blocked_head


class _Holder(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def _tall_head(bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    head = nn.Linear(64, verify_head.MIN_VOCAB_ROWS + 320, bias=bias)  # not a multiple of the block
    head.requires_grad_(False)
    return head


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_product_is_the_plain_product(rows, bias):
    head = _tall_head(bias)
    x = torch.randn(rows, 64)
    assert block_rows(64, 4) < head.out_features
    assert torch.equal(blocked_linear(x, head.weight, head.bias), nn.functional.linear(x, head.weight, head.bias))


def test_installed_inside_only_and_same_logits():
    head = _tall_head()
    model = _Holder(head)
    x = torch.randn(1, 6, 64)
    with torch.no_grad():
        ref = head(x)
        with row_blocked_head(model):
            assert "forward" in head.__dict__
            with row_blocked_head(model):  # re-entrant: the inner exit keeps it installed
                pass
            assert "forward" in head.__dict__
            before = verify_head.measuring_seconds()
            first = head(x)  # the first call at 6 rows measures both ways: cost models leave that time out
            measured = verify_head.measuring_seconds()
            again = head(x)
            assert measured > before and verify_head.measuring_seconds() == measured
        assert "forward" not in head.__dict__
    assert torch.equal(first, ref) and torch.equal(again, ref)
    assert (6, torch.float32) in verify_head._choices[head]


def test_a_blocked_way_that_differs_is_never_chosen(monkeypatch):
    """If the blocked product differed in one bit, the plain one is kept for that row count."""
    head = _tall_head()
    model = _Holder(head)
    x = torch.randn(5, 64)
    calls = []

    def slightly_off(x2, weight, bias):
        calls.append(x2.shape[0])
        out = nn.functional.linear(x2, weight, bias)
        out[0, 0] += 1e-3
        return out

    monkeypatch.setattr(verify_head, "blocked_linear", slightly_off)
    with torch.no_grad(), row_blocked_head(model):
        outs = [head(x) for _ in range(3)]
    ref = nn.functional.linear(x, head.weight)
    assert all(torch.equal(o, ref) for o in outs)
    assert verify_head._choices[head][(5, torch.float32)] is False and calls == [5]  # measured once, then plain


def test_small_heads_are_not_blocked_but_their_near_ties_are_recomputed():
    """A small vocabulary (a few thousand tokens) gains nothing from blocking, but a multi-row product
    may still order a near tie differently from the decode step's one-row product."""
    torch.manual_seed(1)
    small = nn.Linear(8, 32).requires_grad_(False)
    x = torch.randn(5, 8)
    with torch.no_grad():
        reference = nn.functional.linear(x, small.weight, small.bias)
        tie = reference[3].argmax()
        small.bias[(tie + 1) % 32] += float(reference[3, tie] - reference[3, (tie + 1) % 32])  # an exact tie
        with row_blocked_head(_Holder(small)):
            assert "forward" in small.__dict__
            out = small(x.view(1, 5, 8))[0]
        decode_steps = torch.cat([nn.functional.linear(x[i : i + 1], small.weight, small.bias) for i in range(5)])
    assert small not in verify_head._choices  # never measured for blocking
    assert torch.equal(out[3], decode_steps[3])  # the tied row is the decode step's, bit for bit
    assert "forward" not in small.__dict__


def test_other_heads_and_calls_are_left_alone():
    head = _tall_head()
    head.weight.requires_grad_(True)
    with row_blocked_head(_Holder(head)):
        out = head(torch.randn(4, 64))  # autograd on: plain F.linear, gradients flow
        out.sum().backward()
    assert head.weight.grad is not None


def test_concurrent_requests_install_once_and_remove_last():
    head = _tall_head()
    model = _Holder(head)
    inside, release = threading.Barrier(3, timeout=60), threading.Event()  # a failed entry breaks it: no hang

    def request():
        with row_blocked_head(model):
            inside.wait()
            release.wait(60)

    threads = [threading.Thread(target=request) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert "forward" in head.__dict__
    release.set()
    for t in threads:
        t.join()
    assert "forward" not in head.__dict__


def test_near_ties_are_recomputed_as_a_decode_step():
    """A row whose two best logits are within the error bound is recomputed alone (the decode step's
    one-row product, bit for bit); rows with a clear winner are left as computed."""
    from kvboost_hf.speculative.verify_head import redo_near_ties

    head = _tall_head()
    x = torch.randn(6, 64)
    with torch.no_grad():
        out = nn.functional.linear(x, head.weight)
        fake = out.clone()
        top = fake[2].argmax()
        fake[2, top] += 1.0  # a value no float error explains: recomputing must replace it
        fake[2, (top + 1) % fake.shape[1]] = fake[2, top] - 1e-7  # and a near tie in row 2
        fake[4] += 0.5  # a clear winner, left alone even though off
        changed = redo_near_ties(head, x, fake)
        decode_step = nn.functional.linear(x[2].view(1, 1, -1), head.weight)[0, 0]
    assert changed == 1
    assert torch.equal(fake[2], decode_step)
    assert torch.equal(fake[4], out[4] + 0.5)
