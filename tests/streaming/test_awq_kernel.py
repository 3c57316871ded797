"""AWQ models on kvboost_hf's int4 kernels (``StreamingAWQConfig(kernel=...)``): every residency mode
computes what the resident model computes, the result tracks torch's kernel, and the choice fails
loudly or falls back as documented."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import kernels
from kvboost_hf.streaming import kernel as kernel_module
from kvboost_hf.streaming.linear import AWQInt4Linear
from tests.streaming.conftest import load_awq


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def kernel_names(model) -> set[str]:
    return {m.kernel.name for m in model.modules() if isinstance(m, AWQInt4Linear)}


@pytest.fixture
def kernels_built():
    assert kernels.available().built, kernels.available().reason


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_every_mode_on_the_kvboost_kernel_equals_its_resident_model(family, tiny_awq, mmap_dir, kernels_built):
    _, path = tiny_awq[family]
    reference = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    assert kernel_names(reference) == {"kvboost"}
    prompt = _ids(20, 3)
    with torch.no_grad():
        ref_logits = reference(prompt).logits
        ref_tokens = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    for settings in (dict(residency_mode="full_stream", n_staging_slots=1),
                     dict(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1, host="mmap"),
                     dict(residency_mode="ffn_only_stream", keep_first_k=1, keep_last_k=1, prefetch=False)):
        model = load_awq(path, mmap_dir=str(mmap_dir), kernel="kvboost", **settings)
        with torch.no_grad():
            assert torch.equal(model(prompt).logits, ref_logits), settings
            assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), ref_tokens), settings


def test_kvboost_kernel_tracks_torch_kernel(tiny_awq, kernels_built):
    _, path = tiny_awq["qwen2"]
    ours = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    theirs = load_awq(path, residency_mode="full_resident", kernel="torch")
    assert kernel_names(theirs) == {"torch"}
    prompt = _ids(24, 5)
    with torch.no_grad():
        a, b = ours(prompt).logits.float(), theirs(prompt).logits.float()
    # same weights, different rounding (ours accumulates in float32, torch's in bf16 steps)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_a_converted_mmap_file_of_one_kernel_is_never_read_by_the_other(tiny_awq, tmp_path, kernels_built):
    """The two kernels pack different bytes: the mmap cache is keyed by kernel."""
    _, path = tiny_awq["llama"]
    prompt = _ids(16, 8)
    settings = dict(residency_mode="full_stream", host="mmap", mmap_dir=str(tmp_path))
    with torch.no_grad():
        first = load_awq(path, kernel="torch", **settings)(prompt).logits
        second = load_awq(path, kernel="kvboost", **settings)(prompt).logits
        resident = load_awq(path, residency_mode="full_resident", kernel="kvboost")(prompt).logits
    assert torch.equal(second, resident)
    assert len(list(tmp_path.iterdir())) == 2
    assert not torch.equal(first, second)


def test_kvboost_without_built_kernels_is_an_error_and_auto_falls_back(tiny_awq, monkeypatch):
    _, path = tiny_awq["llama"]
    missing = kernels.KernelStatus(False, None, None, "no C++ compiler")
    monkeypatch.setattr(kernel_module.kernels, "available", lambda: missing)
    with pytest.raises(RuntimeError, match="kernel='kvboost' but the kvboost_hf kernels are not built: no C"):
        load_awq(path, residency_mode="full_resident", kernel="kvboost")
    assert kernel_names(load_awq(path, residency_mode="full_resident")) == {"torch"}


def test_kvboost_off_cpu_is_refused():
    with pytest.raises(ValueError, match="runs on CPU only"):
        kernel_module.resolve_int4_kernel("kvboost", torch.device("meta"))
    assert kernel_module.resolve_int4_kernel("auto", torch.device("meta")).name == "torch"
