"""Each misuse is a ValueError that names the setting."""

from __future__ import annotations

import json
import shutil

import pytest

from kvboost_hf.streaming import StreamingAWQConfig
from tests.conftest import make_tiny
from tests.streaming.conftest import load_awq


def _copy_with_quant_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_float_checkpoint_is_refused(tmp_path):
    make_tiny("llama", num_layers=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quant_method"):
        load_awq(tmp_path, residency_mode="full_resident")


def test_other_quant_method_is_refused(tiny_awq, tmp_path):
    path = _copy_with_quant_config(tiny_awq["qwen2"][1], tmp_path / "gptq", quant_method="gptq")
    with pytest.raises(ValueError, match="quant_method"):
        load_awq(path, residency_mode="full_resident")


def test_bits_other_than_4(tiny_awq, tmp_path):
    path = _copy_with_quant_config(tiny_awq["qwen2"][1], tmp_path / "bits", bits=8)
    with pytest.raises(ValueError, match="bits"):
        load_awq(path, residency_mode="full_resident")
    with pytest.raises(ValueError, match="bits"):
        StreamingAWQConfig(bits=3)


def test_group_size_not_dividing_in_features(tiny_awq, tmp_path):
    path = _copy_with_quant_config(tiny_awq["qwen2"][1], tmp_path / "group", group_size=48)
    with pytest.raises(ValueError, match="group_size"):
        load_awq(path, residency_mode="full_resident")


def test_gemv_layout_is_refused(tiny_awq, tmp_path):
    path = _copy_with_quant_config(tiny_awq["qwen2"][1], tmp_path / "gemv", version="gemv")
    with pytest.raises(ValueError, match="version"):
        load_awq(path, residency_mode="full_resident")


def test_keep_first_plus_last_exceeds_layers(tiny_awq):
    with pytest.raises(ValueError, match="keep_first_k"):
        load_awq(tiny_awq["qwen2"][1], residency_mode="partial_resident", keep_first_k=4, keep_last_k=3)
    with pytest.raises(ValueError, match="keep_first_k"):
        load_awq(tiny_awq["qwen2"][1], residency_mode="ffn_only_stream", keep_first_k=7, keep_last_k=0)


@pytest.mark.parametrize("slots", [0, -1, 1.5])
def test_staging_slots_below_one(slots):
    with pytest.raises(ValueError, match="n_staging_slots"):
        StreamingAWQConfig(n_staging_slots=slots)


@pytest.mark.parametrize(
    "setting, value",
    [("residency_mode", "stream_everything"), ("host", "disk"), ("keep_first_k", -1), ("keep_last_k", "2"),
     ("throttle_bytes_per_s", 0), ("kernel", "mkl"), ("huge_pages", "yes"), ("head_tiles", "yes")],
)
def test_other_settings(setting, value):
    with pytest.raises(ValueError, match=setting):
        StreamingAWQConfig(**{setting: value})
