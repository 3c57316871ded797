"""The transformers call site the plugin depends on, and its registration.

If one of these fails after a transformers upgrade, read kvboost_hf/streaming/compat.py: either
the wrapper must follow the new call site, or transformers stopped refusing a different config
class for ``quant_method: awq`` and the wrapper can go.
"""

from __future__ import annotations

import inspect
import re

import pytest
from transformers.quantizers import auto
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING, AutoHfQuantizer

from kvboost_hf.streaming import QUANT_METHOD, StreamingAWQConfig, StreamingAWQQuantizer, is_streaming_model
from kvboost_hf.streaming.compat import original_merge
from tests.streaming.conftest import load_awq

AWQ_DICT = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": False, "version": "gemm"}


def test_get_hf_quantizer_still_calls_merge_with_checkpoint_then_user_config():
    source = inspect.getsource(auto.get_hf_quantizer)
    call = (r"AutoHfQuantizer\.merge_quantization_configs\("
            r"\s*quantization_params_from_config,\s*quantization_config\s*\)")
    assert re.search(call, source), "transformers changed the call site kvboost_hf/streaming/compat.py wraps"
    params = list(inspect.signature(original_merge()).parameters)
    assert params == ["cls", "quantization_config", "quantization_config_from_args"]


def test_from_pretrained_goes_through_the_wrapper(tiny_awq):
    model = load_awq(tiny_awq["qwen2"][1], residency_mode="full_resident")
    assert is_streaming_model(model)
    assert isinstance(model.config.quantization_config, StreamingAWQConfig)


def test_transformers_alone_still_refuses_our_config_for_awq_checkpoints():
    with pytest.raises(ValueError, match="AwqConfig"):
        original_merge()(AutoHfQuantizer, dict(AWQ_DICT), StreamingAWQConfig())


def test_wrapper_merges_checkpoint_fields_and_keeps_loading_attributes():
    ours = StreamingAWQConfig(residency_mode="full_stream", n_staging_slots=3, host="mmap", group_size=128)
    merged = AutoHfQuantizer.merge_quantization_configs(dict(AWQ_DICT), ours)
    assert isinstance(merged, StreamingAWQConfig)
    assert (merged.group_size, merged.zero_point) == (64, False)
    assert (merged.residency_mode, merged.n_staging_slots, merged.host) == ("full_stream", 3, "mmap")


def test_other_configs_are_untouched():
    # No config from the user: transformers' own path (AwqConfig for an AWQ checkpoint).
    merged = AutoHfQuantizer.merge_quantization_configs(dict(AWQ_DICT), None)
    assert type(merged).__name__ == "AwqConfig"


def test_registered_with_transformers():
    assert AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] is StreamingAWQConfig
    assert AUTO_QUANTIZER_MAPPING[QUANT_METHOD] is StreamingAWQQuantizer
