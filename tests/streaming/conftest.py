"""AWQ checkpoints for the streaming tests: tiny families and the embedded Gemma, packed once per session."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

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
