"""AWQ checkpoints for the streaming tests: tiny families and the embedded Gemma, packed once per session."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvboost_hf import kernels
from kvboost_hf.kernels import decoder as fused_decoder
from kvboost_hf.streaming import StreamingAWQConfig
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import make_tiny

STREAM_FAMILIES = ["llama", "qwen2", "gemma3"]
TINY_LAYERS = 6
TINY_GROUP = 32


def load_awq(path, dtype: torch.dtype | None = None, **settings) -> torch.nn.Module:
    """An AWQ checkpoint loaded through ``from_pretrained`` with :class:`StreamingAWQConfig` (``settings``) in
    ``dtype`` (None: the quantizer's choice)."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=StreamingAWQConfig(**settings), **kwargs)
    assert dtype is None or model.dtype == dtype, (model.dtype, dtype)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_awq(tmp_path_factory) -> dict[str, tuple]:
    """``family -> (float model, AWQ checkpoint dir)``: 6-layer tiny models, group size 32.

    Llama is packed with activation-aware scales (folded into norms and ``up_proj``), the
    others round-to-nearest (faster).
    """
    out = {}
    for family in STREAM_FAMILIES:
        model = make_tiny(family, seed=3, num_layers=TINY_LAYERS)
        calibration = torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(1))
        path = tmp_path_factory.mktemp(f"awq-{family}")
        pack_model(model, path, group_size=TINY_GROUP, calibration_ids=calibration if family == "llama" else None)
        out[family] = (model, path)
    return out


@pytest.fixture(scope="session")
def mmap_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("awq-int4pack")


@pytest.fixture(scope="session")
def tiny_mistral_awq(tmp_path_factory):
    """A tiny Mistral (a sliding window on every layer) packed as the families of :func:`tiny_awq` are."""
    path = tmp_path_factory.mktemp("awq-mistral")
    pack_model(make_tiny("mistral", seed=3, num_layers=TINY_LAYERS), path, group_size=TINY_GROUP)
    return path


@pytest.fixture
def kernels_built():
    """The kernels' status; the test fails (it is not skipped) where they are not built."""
    status = kernels.available()
    assert status.built, status.reason
    return status


@pytest.fixture
def fast_loops(monkeypatch):
    """How many forwards took the fused decoder's loop."""
    counter = {"n": 0}
    original = fused_decoder._position_embeddings

    def counted(*args):
        out = original(*args)
        counter["n"] += out is not None
        return out

    monkeypatch.setattr(fused_decoder, "_position_embeddings", counted)
    return counter
