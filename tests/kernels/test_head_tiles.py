"""The head's tile layout (``kernels.tile_layout``, ``KernelLinear.use_tiles``): the amx_bf16 path computes a bf16
head on AMX tiles from it with rows bit-independent; every other path ignores it; a copy never outlives a change
of the weight it was made from."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from kvboost_hf import kernels
from kvboost_hf.kernels.linear import TileCopy
from tests.kernels.test_gemm import reference


def bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_tile_layout_places_each_element_as_documented():
    weight = bf16_weight(40, 96, seed=1)  # 40 rows: padded to 64 (an even number of 16-column blocks)
    tiles = kernels.tile_layout(weight)
    assert tiles.shape == (4, 3, 16, 16, 2) and tiles.is_contiguous()
    b, c, p, j, e = torch.meshgrid(*[torch.arange(s) for s in tiles.shape], indexing="ij")
    row, col = 16 * b + j, 32 * c + 2 * p + e
    inside = row < 40
    assert torch.equal(tiles[inside], weight[row[inside], col[inside]])
    assert torch.all(tiles[~inside] == 0)


def test_tile_layout_refuses_weights_it_cannot_hold():
    with pytest.raises(ValueError, match="bf16"):
        kernels.tile_layout(torch.randn(32, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.tile_layout(bf16_weight(32, 48, seed=0))


@pytest.mark.parametrize("shape", [(203, 160), (64, 32), (33, 640)])
def test_tiles_keep_rows_independent_on_amx_and_are_ignored_elsewhere(shape, isa_paths):
    n, k = shape
    weight = bf16_weight(n, k, seed=n)
    tiles = kernels.tile_layout(weight)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for isa in isa_paths:
        kernels.select_isa(isa)
        out = kernels.linear(x, weight, tiles=tiles)
        if isa != "amx_bf16":
            assert torch.equal(out, kernels.linear(x, weight)), isa
            continue
        assert out.dtype == torch.bfloat16 and out.shape == (40, n)
        # fp32 accumulation, then the bf16 output's rounding (half an ulp of bf16)
        want = reference(x.float(), weight.float())
        assert torch.all((out.float() - want).abs() <= want.abs() * 2.0**-8 + 1e-3)
        alone = torch.cat([kernels.linear(x[i : i + 1], weight, tiles=tiles) for i in range(40)])
        assert torch.equal(out, alone)
        for m in range(1, 40):  # one row tile (1-16 rows), several, and a zero-padded last one (17-39)
            assert torch.equal(kernels.linear(x[:m], weight, tiles=tiles), out[:m]), m
        assert torch.equal(kernels.linear(x, weight, bias, tiles=tiles), out + bias)
        float_out = kernels.linear(x.float(), weight, tiles=tiles)  # float activations: the row-major kernel
        assert torch.equal(float_out, kernels.linear(x.float(), weight))


@pytest.mark.parametrize("shape", [(64, 640), (33, 96), (203, 160)])
def test_the_head_rounds_each_sum_to_bf16_as_torch_casts_it(shape, isa_paths):
    # Small integers: every partial sum is an integer below 2**24, exact in float32 in any order, so each path's
    # float result is the exact sum and the bf16 output must be torch's rounding of it (to nearest, ties to even:
    # bf16 keeps 8 bits, so sums past 256 round). The amx_bf16 path rounds inside the kernel, from its tiles.
    n, k = shape
    gen = torch.Generator().manual_seed(n)
    weight = torch.randint(-8, 9, (n, k), generator=gen).to(torch.bfloat16)
    x = torch.randint(-16, 17, (40, k), generator=gen).to(torch.bfloat16)
    x[3, 5] = float("nan")
    want = (x.double() @ weight.double().T).float().to(torch.bfloat16)
    assert (want.float().abs() > 256).float().mean() > 0.2  # the rounding is exercised
    tiles = kernels.tile_layout(weight)
    for isa in isa_paths:
        kernels.select_isa(isa)
        for m in (1, 9, 16, 17, 40):  # one row tile, a full one, a zero-padded last one
            out = kernels.linear(x[:m], weight, tiles=tiles)
            assert out.dtype == torch.bfloat16 and out.shape == (m, n) and out.is_contiguous(), (isa, m)
            assert torch.equal(out.isnan(), want[:m].isnan()), (isa, m)
            assert torch.equal(out.nan_to_num(0.0), want[:m].nan_to_num(0.0)), (isa, m)


def test_a_tile_layout_of_another_shape_is_refused_on_amx(built):
    weight = bf16_weight(64, 64, seed=4)
    wrong = kernels.tile_layout(bf16_weight(64, 96, seed=4))
    x = torch.randn(2, 64).to(torch.bfloat16)
    if kernels.current_isa() == "amx_bf16":
        with pytest.raises(RuntimeError, match="tile layout"):
            kernels.linear(x, weight, tiles=wrong)
    else:  # the path in effect does not read tiles
        assert torch.equal(kernels.linear(x, weight, tiles=wrong), kernels.linear(x, weight))


def head(n: int = 96, k: int = 64, seed: int = 5) -> kernels.KernelLinear:
    linear = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(bf16_weight(n, k, seed))
    adopted = kernels.KernelLinear.adopt(linear)
    assert adopted.use_tiles()
    return adopted


def fresh(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return kernels.linear(x, weight, tiles=kernels.tile_layout(weight))


@pytest.mark.parametrize("edit", ["in_place", "through_data", "new_parameter", "set_"])
def test_a_changed_weight_gets_a_new_tile_copy_before_it_is_read(edit, built):
    layer = head()
    x = torch.randn(9, 64).to(torch.bfloat16)
    before = layer.tiles
    with torch.no_grad():
        if edit == "in_place":  # load_state_dict, optimizer steps: the version counter moves
            layer.weight.mul_(-2)
        elif edit == "through_data":  # no version counter: a sampled element changes
            layer.weight.data.normal_()
        elif edit == "new_parameter":
            layer.weight = torch.nn.Parameter(bf16_weight(96, 64, seed=6))
        else:
            layer.weight.set_(bf16_weight(96, 64, seed=7))
    assert torch.equal(layer(x), fresh(x, layer.weight))
    assert layer.tiles is not before and torch.equal(layer.tiles, kernels.tile_layout(layer.weight))
    tiles = layer.tiles
    layer(x)
    assert layer.tiles is tiles  # an unchanged weight keeps its copy


def test_a_tile_copy_is_dropped_where_the_weight_no_longer_allows_one_and_made_again_where_it_does(built):
    layer = head()
    layer.float()
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), kernels.linear(x, layer.weight))
    assert layer.tiles is None
    layer.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    assert torch.equal(layer(x), fresh(x, layer.weight)) and layer.tiles is not None
    layer.float()
    assert not layer.use_tiles()  # float32: none made
    with torch.inference_mode():  # inference tensors track no in-place change: none made
        frozen = kernels.KernelLinear.adopt(torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16))
    assert not frozen.use_tiles()
    layer = head()
    assert not layer.use_tiles(False) and layer.tiles is None


def test_a_tile_copy_checks_its_samples():
    weight = bf16_weight(203, 160, seed=8)
    copy = TileCopy.of(weight)
    assert copy.holds(weight)
    flat = copy.weight_index[len(copy.weight_index) // 2]
    weight.data.view(-1)[flat] += 1  # one sampled element, behind the version counter's back
    assert not copy.holds(weight)
    assert not TileCopy.of(weight).holds(weight.clone())  # another tensor


@pytest.mark.parametrize("shape", [(256, 64), (262144, 640)])
def test_the_samples_cover_every_column_band_whatever_the_shape(shape):
    """N * K / 128 a multiple of K (any N a multiple of 128) once put every sample in column 0."""
    n, k = shape
    weight = torch.zeros(n, k, dtype=torch.bfloat16)
    copy = TileCopy.of(weight)
    assert len(set((copy.weight_index % k).tolist())) > 32
    weight.data[:, 1:].fill_(1)  # all but column 0, through .data
    assert not copy.holds(weight)


def test_a_nan_in_the_weight_is_held_as_itself(built):
    layer = head()
    x = torch.randn(2, 64).to(torch.bfloat16)
    sampled = layer.tile_copy.weight_index[0]
    layer.weight.data.view(-1)[sampled] = float("nan")  # behind the version counter: remade once
    layer(x)
    tiles = layer.tiles
    layer(x)
    assert layer.tiles is tiles and layer.tile_copy.holds(layer.weight)


def test_copies_and_pickles_leave_the_tile_copy_out_and_make_their_own(built, tmp_path):
    layer = head()
    x = torch.randn(4, 64).to(torch.bfloat16)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.tiles is None and other.weight.data_ptr() != layer.weight.data_ptr()
        assert torch.equal(other(x), fresh(x, other.weight)) and other.tiles is not None
    torch.save(layer, tmp_path / "with.pt")
    layer.use_tiles(False)
    torch.save(layer, tmp_path / "without.pt")
    assert (tmp_path / "with.pt").stat().st_size < 1.2 * (tmp_path / "without.pt").stat().st_size


def test_a_compiled_head_computes_on_the_weight_rows(built):
    layer = head()
    x = torch.randn(5, 64).to(torch.bfloat16)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), kernels.linear(x, layer.weight))
    assert torch.equal(layer(x), fresh(x, layer.weight))  # eager: the tile copy


def test_a_tile_tensor_without_dimensions_is_refused_clearly(built):
    weight = bf16_weight(64, 64, seed=4)
    x = torch.randn(2, 64).to(torch.bfloat16)
    if kernels.current_isa() == "amx_bf16":
        with pytest.raises(RuntimeError, match="tile layout"):
            kernels.linear(x, weight, tiles=torch.tensor(1.0, dtype=torch.bfloat16))
    else:
        assert torch.equal(kernels.linear(x, weight, tiles=torch.tensor(1.0)), kernels.linear(x, weight))
