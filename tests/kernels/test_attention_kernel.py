"""The attention kernel against a float64 reference on every ISA path; a row's bits depend only on its
query and the keys it reads (not on the rows, threads, path, or keys it may not read); transformers'
SDPA semantics in ``KernelAttention``."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvboost_hf import kernels
from kvboost_hf.kernels import ops
from kvboost_hf.kernels.attention import KernelAttention
from tests.conftest import torch_threads


def tensors(batch, heads, kv_heads, rows, keys, dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, dim, generator=gen)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    v = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def keep(rows, keys, causal, window, mask=None):
    """[.., rows, keys] bool: what each row may read."""
    position = keys - rows + torch.arange(rows)[:, None]
    key = torch.arange(keys)[None, :]
    allowed = torch.ones(rows, keys, dtype=torch.bool)
    if causal:
        allowed &= key <= position
    if window:
        allowed &= key > position - window
    return allowed if mask is None else allowed & mask


def reference(q, k, v, allowed, scale, bias=None):
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.double()
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row reading nothing gives zeros
    return (weights @ v).transpose(1, 2)


# (batch, heads, kv_heads, rows, keys, dim): odd head sizes take the 16-lane tail, GQA groups 1..4
SHAPES = [(1, 4, 1, 9, 60, 256), (2, 2, 2, 5, 5, 16), (1, 6, 3, 7, 33, 40), (2, 4, 2, 1, 17, 64), (1, 1, 1, 12, 70, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 6)])
def test_matches_a_float64_reference_and_every_path_gives_the_same_bits(shape, causal, window, isa_paths):
    batch, heads, kv_heads, rows, keys, dim = shape
    q, k, v = tensors(*shape, seed=sum(shape))
    want = reference(q, k, v, keep(rows, keys, causal, window), dim**-0.5)
    outs = {}
    for isa in isa_paths:
        kernels.select_isa(isa)
        outs[isa] = ops.attention(q, k, v, scale=dim**-0.5, causal=causal, window=window)
        assert outs[isa].shape == (batch, rows, heads, dim) and outs[isa].dtype == torch.float32
        assert (outs[isa].double() - want).abs().max() < 1e-5, isa
    for isa in isa_paths:
        assert torch.equal(outs[isa], outs["scalar"]), isa


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_inputs_give_their_dtype_of_the_float32_result(dtype, isa_paths):
    q, k, v = tensors(1, 4, 1, 9, 60, 256, dtype=dtype, seed=3)
    want = reference(q, k, v, keep(9, 60, True, None), 0.0625)
    for isa in isa_paths:
        kernels.select_isa(isa)
        out = ops.attention(q, k, v, scale=0.0625, causal=True)
        assert out.dtype == dtype
        assert torch.equal(out, ops.attention(q.float(), k.float(), v.float(), scale=0.0625, causal=True).to(dtype))
        assert (out.double() - want).abs().max() < 2e-2 * want.abs().max()


@pytest.mark.parametrize("window", [None, 5])
def test_a_row_equals_its_decode_step_for_every_row_count(window, built):
    """Rows computed together (a verification, a prompt chunk) equal each row alone over the keys its
    decode step holds (the whole past, or the last ``window``), bit for bit, for M = 1..64."""
    q, k, v = tensors(1, 4, 2, 64, 80, 64, dtype=torch.bfloat16, seed=11)
    alone = []
    for i in range(64):
        end = 80 - 64 + i + 1
        start = max(0, end - window) if window else 0
        alone.append(ops.attention(q[:, :, i : i + 1], k[:, :, start:end], v[:, :, start:end], scale=0.125))
    alone = torch.cat(alone, dim=1)
    for rows in (1, 2, 3, 8, 9, 17, 64):
        got = ops.attention(q[:, :, 64 - rows :], k, v, scale=0.125, causal=True, window=window)
        assert torch.equal(got, alone[:, 64 - rows :]), rows


def test_keys_a_row_may_not_read_are_skipped_not_added(built):
    """A mask (bool, -inf, or dtype-min float) gives the bits of a call without those keys: a batch row with
    left padding equals the request alone, a cache holding more than a window equals one holding it."""
    q, k, v = tensors(1, 2, 1, 1, 40, 32, seed=5)
    alone = ops.attention(q, k[:, :, 13:], v[:, :, 13:], scale=0.3)
    hidden = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    hidden[..., 13:] = True
    assert torch.equal(ops.attention(q, k, v, hidden, scale=0.3), alone)
    for fill in (float("-inf"), torch.finfo(torch.float32).min):
        additive = torch.zeros(1, 1, 1, 40).masked_fill(~hidden, fill)
        assert torch.equal(ops.attention(q, k, v, additive, scale=0.3), alone)
    k[:, :, :13] = float("nan")  # what a skipped key holds does not matter
    assert torch.equal(ops.attention(q, k, v, hidden, scale=0.3), alone)
    assert torch.equal(ops.attention(q, k, v, torch.zeros(1, 1, 1, 40).masked_fill(~hidden, float("-inf")), scale=0.3),
                       alone)
    assert ops.attention(q, k, v, scale=0.3).isnan().all()  # a key the row reads holds NaN: NaN, as SDPA
    # a row that may read nothing (a padding row) gives zeros
    assert torch.equal(ops.attention(q, k, v, torch.zeros_like(hidden), scale=0.3), torch.zeros(1, 1, 2, 32))


def test_masks_broadcast_and_float_masks_add_to_the_scores(built):
    q, k, v = tensors(2, 4, 2, 6, 20, 32, seed=8)
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, 6, 20, generator=gen) > 0.3
    mask[..., 0] = True
    want = reference(q, k, v, mask.expand(2, 4, 6, 20), 0.2)
    assert (ops.attention(q, k, v, mask, scale=0.2).double() - want).abs().max() < 1e-5
    bias = torch.randn(1, 4, 6, 20, generator=gen)
    want = reference(q, k, v, torch.ones(6, 20, dtype=torch.bool), 0.2, bias=bias)
    assert (ops.attention(q, k, v, bias, scale=0.2).double() - want).abs().max() < 1e-5


def test_strided_queries_and_thread_counts_never_change_a_bit(built):
    q, k, v = tensors(1, 4, 1, 9, 300, 256, dtype=torch.bfloat16, seed=2)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # transformers' [B, H, M, D] view of [B, M, H, D]
    assert not strided.is_contiguous()
    outs = []
    for n in (1, 2, 3):
        with torch_threads(n):
            outs += [ops.attention(q, k, v, scale=0.0625, causal=True),
                     ops.attention(strided, k, v, scale=0.0625, causal=True)]
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("batch,heads,kv_heads,rows,dim,dtype", [
    (1, 4, 1, 1, 48, torch.bfloat16), (1, 4, 1, 9, 48, torch.bfloat16), (1, 14, 2, 1, 48, torch.bfloat16),
    (1, 12, 1, 3, 48, torch.bfloat16), (2, 6, 2, 2, 40, torch.float32), (2, 9, 3, 5, 72, torch.float32),
    (1, 24, 1, 2, 24, torch.bfloat16)])
def test_heads_sharing_a_key_head_give_each_heads_bits_alone(batch, heads, kv_heads, rows, dim, dtype, isa_paths):
    """The query heads of a key head are computed together (each key and value row read once for all of them), in
    groups that depend on the thread count; each head's result is still the one it gets alone, also where only some
    heads skip a key (a per-head mask, an exp that underflows) or read none (a dead head), with head sizes that
    leave a 16-lane tail, batches, float32."""
    q, k, v = tensors(batch, heads, kv_heads, rows, 41, dim, dtype=dtype, seed=heads + rows)
    q[:, 1] *= 60  # scores far apart: some of this head's exps underflow to zero (keys it then skips)
    mask = torch.zeros(batch, heads, rows, 41)
    mask[:, 2, :, 5:9] = float("-inf")  # one head skips keys the others read (one holding NaN: they give NaN)
    v[:, 2 * kv_heads // heads, 6, 3] = float("nan")
    mask[:, heads - 1] = float("-inf")  # one head reads nothing: zeros
    for isa in isa_paths:
        kernels.select_isa(isa)
        alone = torch.cat([ops.attention(q[:, h : h + 1], k[:, h * kv_heads // heads : h * kv_heads // heads + 1],
                                         v[:, h * kv_heads // heads : h * kv_heads // heads + 1], mask[:, h : h + 1],
                                         scale=0.125) for h in range(heads)], dim=2)
        for n in (1, 2, 3):
            with torch_threads(n):
                got = ops.attention(q, k, v, mask, scale=0.125)
                bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                assert torch.equal(got.view(bits), alone.view(bits)), (isa, n)  # NaN bits too
                causal = ops.attention(q, k, v, scale=0.125, causal=True, window=7)
                for h in (0, heads - 1):
                    g = h * kv_heads // heads
                    assert torch.equal(causal[:, :, h : h + 1], ops.attention(
                        q[:, h : h + 1], k[:, g : g + 1], v[:, g : g + 1], scale=0.125, causal=True, window=7)), (isa, n)
    assert alone[:, :, heads - 1].eq(0).all() and alone[:, :, 2].isfinite().all() and alone[:, :, 0].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_softmax_gives_a_score_the_same_weight_in_a_vector_of_16_and_in_the_tail(dtype, isa_paths):
    # 17 keys: the first 16 scores are scaled and exponentiated 16 lanes at a time, the 17th alone. Key 16 repeats
    # key j's, and value row r is one-hot at r, so out[j] and out[16] are the two weights, which must be the same
    # bits. Scales from 0.01 to 30 walk the exponential's whole range (weights down to the 0 below e^-87).
    gen = torch.Generator().manual_seed(7)
    v = torch.eye(17, 32).to(dtype)[None, None]
    for isa in isa_paths:
        kernels.select_isa(isa)
        for trial in range(60):
            q = (torch.randn(1, 2, 1, 32, generator=gen) * 10.0 ** (trial % 6 / 2.0 - 1.0)).to(dtype)
            k = torch.randn(1, 1, 17, 32, generator=gen).to(dtype)
            j = trial % 16
            k[0, 0, 16] = k[0, 0, j]
            out = ops.attention(q, k, v, scale=0.5)
            assert torch.equal(out[0, 0, :, j], out[0, 0, :, 16]), (isa, trial)
            assert out.float().sum(-1).gt(0.99).all()  # every row's weights sum to ~1


@pytest.mark.parametrize("rows, keys", [(1, 15), (1, 16), (1, 200), (9, 209), (16, 33)])
def test_a_mask_that_hides_nothing_changes_no_bit(rows, keys, isa_paths):
    # No mask: the scores are scaled and their maximum found 16 lanes at a time; a mask takes a loop over the keys.
    q, k, v = tensors(1, 4, 1, rows, keys, 64, torch.bfloat16, seed=keys)
    q[0, 1, 0, :] *= 40.0  # a head whose largest weight dwarfs the rest
    everything = torch.ones(1, 1, rows, keys, dtype=torch.bool)
    for isa in isa_paths:
        kernels.select_isa(isa)
        for causal in (True, False):
            plain = ops.attention(q, k, v, causal=causal)
            assert torch.equal(plain, ops.attention(q, k, v, everything, causal=causal)), (isa, causal)
            assert torch.equal(plain, ops.attention(q, k, v, torch.zeros(1, 1, rows, keys), causal=causal))


def test_no_query_heads_give_an_empty_result(built):
    q, k, v = tensors(1, 0, 1, 1, 5, 16)
    assert ops.attention(q, k, v, scale=0.125).shape == (1, 1, 0, 16)


def test_bad_inputs_say_what_to_change(built):
    q, k, v = tensors(1, 4, 2, 3, 10, 16)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.attention(q, k.double(), v)
    with pytest.raises(RuntimeError, match="multiple of key heads"):
        ops.attention(q[:, :3], k, v)
    with pytest.raises(RuntimeError, match="only given with causal"):
        ops.attention(q, k, v, window=4)
    with pytest.raises(RuntimeError, match="as many keys"):
        ops.attention(q, k[:, :, :2], v[:, :, :2], causal=True)
    with pytest.raises(RuntimeError, match="key and value must be"):
        ops.attention(q, k, v[..., :8])
    with pytest.raises(RuntimeError, match="mask must be bool"):  # a 0/1 keep-mask is not added to scores
        ops.attention(q, k, v, torch.ones(1, 1, 3, 10, dtype=torch.uint8))
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="not implemented"):
        ops.attention(q, k, v, causal=True).sum().backward()


def test_the_op_traces_under_torch_compile(built):
    q, k, v = tensors(1, 4, 2, 3, 10, 16)
    torch.library.opcheck(torch.ops.kvboost.attention.default, (q, k, v, None, 0.25, True, 0),
                          test_utils=("test_schema", "test_faketensor"))
    f = lambda q: ops.attention(q, k, v, scale=0.25, causal=True) * 2  # noqa: E731
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(q), f(q))


class Layer(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def stock(*args, **kwargs):
    q, k, v, mask = (t.float() if t is not None and t.is_floating_point() else t for t in args)
    return sdpa_attention_forward(Layer(), q, k, v, mask, **kwargs)[0]


def test_kernel_attention_follows_sdpa_semantics(built):
    attend = KernelAttention()
    layer = Layer()
    q, k, v = tensors(1, 4, 2, 5, 5, 32, seed=4)
    cases = {
        "prefill, is_causal": (q, k, v, None),
        "decode row, no mask": (q[:, :, -1:], k, v, None),
        "bool mask": (q, k, v, torch.ones(5, 5, dtype=torch.bool).tril()[None, None]),
        "float mask": (q, k, v, torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -1e9)),
        "empty static cache": (q, *(torch.cat([t, torch.zeros(1, 2, 7, 32)], dim=2) for t in (k, v)), None),
    }
    for name, args in cases.items():
        got, weights = attend(layer, *args, scaling=0.3)
        assert weights is None
        assert (got - stock(*args, scaling=0.3)).abs().max() < 1e-5, name
    bias = torch.randn(1, 4, 5, 5)
    got, _ = attend(layer, q, k, v, None, scaling=0.3, position_bias=bias)
    assert (got - stock(q, k, v, None, scaling=0.3, position_bias=bias)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="dropout"):
        attend(layer, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="softcap"):
        attend(layer, q, k, v, None, softcap=30.0)
    assert attend.applies(q) and not attend.applies(q.to("meta")) and not attend.applies(q.double())
