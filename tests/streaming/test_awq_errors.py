"""Each misuse is a ValueError that names the setting (an unknown setting: a TypeError)."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvboost_hf.streaming import QUANT_METHOD, StreamingAWQConfig, StreamingAWQQuantizer
from kvboost_hf.streaming.config import SETTINGS
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


@pytest.mark.parametrize("name, hint", [("dtype", "from_pretrained's own argument"),
                                        ("torch_dtype", "from_pretrained's own argument"),
                                        ("device_map", "from_pretrained's own argument"),
                                        ("w_bit", "AutoAWQ's name for bits"), ("residency", "")])
def test_an_unknown_setting_is_refused_not_ignored(name, hint):
    """``StreamingAWQConfig(dtype=...)`` once loaded the checkpoint's float16 (bfloat16 on a CPU) in silence."""
    with pytest.raises(TypeError, match=rf"unknown setting\(s\) '{name}'; its settings are residency_mode.*{hint}"):
        StreamingAWQConfig(**{name: 1})


def test_the_settings_named_in_errors_are_the_constructors():
    parameters = inspect.signature(StreamingAWQConfig.__init__).parameters
    assert list(SETTINGS) == [p for p in parameters if p not in ("self", "kwargs")]


def test_another_quant_method_is_refused():
    assert StreamingAWQConfig(quant_method=QUANT_METHOD).quant_method == QUANT_METHOD
    with pytest.raises(ValueError, match="quant_method"):
        StreamingAWQConfig(quant_method="awq")


def test_the_config_round_trips_through_its_dict():
    config = StreamingAWQConfig(residency_mode="full_stream", keep_first_k=1, kernel="torch", head_tiles=False)
    again = StreamingAWQConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


def test_a_saved_setting_this_version_does_not_know_is_dropped_with_a_warning(caplog):
    """A saved config is read with from_dict: one another version wrote still loads (the constructor refuses)."""
    values = {**StreamingAWQConfig(keep_first_k=3).to_dict(), "some_later_setting": 1}
    with caplog.at_level("WARNING", logger="kvboost_hf.streaming.config"):
        config = StreamingAWQConfig.from_dict(values)
    assert config.keep_first_k == 3 and not hasattr(config, "some_later_setting")
    assert "some_later_setting" in caplog.text


def test_a_loaded_model_has_the_dtype_asked_of_from_pretrained(tiny_awq):
    path = tiny_awq["qwen2"][1]
    assert load_awq(path, residency_mode="full_resident").dtype == torch.bfloat16  # float16 checkpoint, on a CPU
    for dtype in (torch.float32, torch.bfloat16):
        assert load_awq(path, dtype, residency_mode="full_resident").dtype == dtype
    for device_map in ("cpu", torch.device("cpu"), {"": "cpu"}):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=StreamingAWQConfig(),
                                                     device_map=device_map)
        assert model.dtype == torch.bfloat16 and model.device.type == "cpu"


@pytest.mark.parametrize("device_map, cuda, expected", [
    (None, False, torch.bfloat16), (None, True, torch.bfloat16), ("cpu", True, torch.bfloat16),
    ({"": "cpu"}, True, torch.bfloat16), ({"": "disk"}, True, torch.bfloat16), ({"": "meta"}, True, torch.bfloat16),
    ("auto", False, torch.bfloat16), ("auto", True, torch.float16), ("cuda:0", True, torch.float16),
    (0, True, torch.float16), ({"model": 0, "lm_head": "cuda:0"}, True, torch.float16),
])
def test_float16_becomes_bfloat16_where_the_model_is_placed_on_a_cpu(device_map, cuda, expected, monkeypatch):
    """By the placement, not by whether the machine has a GPU: a CPU model on a GPU machine computed in float16,
    which no CPU int4 kernel takes (every fused path fell back to transformers' forward there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    quantizer = StreamingAWQQuantizer(StreamingAWQConfig(), pre_quantized=True)
    quantizer.update_device_map(device_map)
    assert quantizer.update_dtype(torch.float16) == expected
    assert quantizer.update_dtype(None) == (torch.bfloat16 if expected == torch.bfloat16 else None)
    assert quantizer.update_dtype(torch.float32) == torch.float32


def test_a_device_map_keeps_its_values_as_given():
    """accelerate reads an int as a CUDA index; its string ("0") is no device (transformers failed on it)."""
    quantizer = StreamingAWQQuantizer(StreamingAWQConfig(), pre_quantized=True)
    assert quantizer.update_device_map({"model": 0, "lm_head": 0}) == {"": 0}
    assert quantizer.update_device_map({"model": "cpu", "lm_head": torch.device("cpu")}) == {"": "cpu"}
    with pytest.raises(ValueError, match="one device"):
        quantizer.update_device_map({"model": 0, "lm_head": "cpu"})
    with pytest.raises(ValueError, match="balanced_low_0.*one"):
        quantizer.update_device_map("balanced_low_0")
