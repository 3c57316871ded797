import pytest
import torch

from kvboost_hf.store.codec import StoredChunk, encode_chunk
from kvboost_hf.store.quant import _pack4, _unpack4, default_group_size, quantize_keys, quantize_values


def test_int4_packing_round_trips_odd_lengths():
    codes = torch.randint(0, 16, (7, 5), dtype=torch.uint8)
    packed = _pack4(codes)
    assert packed.numel() == 18
    assert torch.equal(_unpack4(packed, codes.numel()).reshape(7, 5), codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_per_channel_error_is_bounded_per_channel(bits):
    torch.manual_seed(0)
    keys = torch.randn(2, 64, 32)
    keys[..., 3] *= 100  # an outlier channel must not cost the others precision
    q = quantize_keys(keys, bits)
    err = (q.dequantize() - keys).abs()
    span = keys.amax(dim=1, keepdim=True) - keys.amin(dim=1, keepdim=True)
    step = span / ((1 << bits) - 1)
    assert (err <= step / 2 + 1e-3 * span + 1e-6).all()
    assert err[..., :3].max() < err[..., 3].max() / 20


@pytest.mark.parametrize("bits", [8, 4])
def test_values_per_token_groups(bits):
    torch.manual_seed(1)
    values = torch.randn(2, 16, 32)
    values[:, 5] *= 50  # an outlier token must not cost the others precision
    q = quantize_values(values, bits, group_size=8)
    err = (q.dequantize() - values).abs()
    assert err[:, :5].max() < err[:, 5].max() / 10
    with pytest.raises(ValueError, match="does not divide"):
        quantize_values(values, bits, group_size=12)


def test_bad_bits_are_refused():
    with pytest.raises(ValueError, match="kv_bits"):
        quantize_keys(torch.zeros(1, 2, 8), 3)


def _entry_bytes(dtype, bits, tokens=128, layers=4, head_dim=256):
    keys = [torch.randn(1, tokens, head_dim).to(dtype) for _ in range(layers)]
    values = [torch.randn(1, tokens, head_dim).to(dtype) for _ in range(layers)]
    fields = encode_chunk(keys, values, bits, default_group_size(head_dim), 0)
    return StoredChunk(b"k", b"p", b"n", 0, tuple(range(tokens)), **fields).nbytes


@pytest.mark.parametrize(
    "dtype, bits, limit",
    [(torch.float32, 8, 0.28), (torch.float32, 4, 0.15), (torch.bfloat16, 8, 0.55), (torch.bfloat16, 4, 0.30)],
)
def test_bytes_per_token_against_the_models_own_dtype(dtype, bits, limit):
    ratio = _entry_bytes(dtype, bits) / _entry_bytes(dtype, None)
    assert ratio <= limit, ratio


def test_sink_tokens_stay_exact():
    torch.manual_seed(2)
    keys = [torch.randn(1, 16, 8)]
    values = [torch.randn(1, 16, 8)]
    chunk = StoredChunk(b"k", b"p", b"n", 0, tuple(range(16)), **encode_chunk(keys, values, 4, 8, 4))
    assert not chunk.is_exact and chunk.exact_tokens(16) == 4
    k, v = chunk.layer_states(0, 16)
    assert torch.equal(k[:, :4], keys[0][:, :4]) and torch.equal(v[:, :4], values[0][:, :4])
    assert not torch.equal(k[:, 4:], keys[0][:, 4:])
    assert (k - keys[0]).abs().max() < 1.0
