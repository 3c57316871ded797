"""The one place that reaches into transformers' private loading API.

A checkpoint whose ``config.json`` says ``quant_method: "awq"`` makes
``AutoHfQuantizer.merge_quantization_configs`` raise for any config class other than
transformers' ``AwqConfig`` (it compares class names), before any quantizer is chosen. We wrap
that classmethod: when the config passed to ``from_pretrained`` is a
:class:`StreamingAWQConfig`, the checkpoint's AWQ fields (bits, group size, zero point, layout
version) are merged into it and it is returned, so our quantizer is chosen; every other call
goes to the original unchanged.

Why this option: the alternative (load the config, drop its ``quantization_config``, pass ours)
would change what users type (``from_pretrained(path, config=..., quantization_config=...)``).
The wrapper depends on ``get_hf_quantizer`` calling
``AutoHfQuantizer.merge_quantization_configs(checkpoint_config, config_from_args)``;
``tests/streaming/test_compat.py`` fails if that call site changes or if transformers stops
refusing (then this module can go).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from transformers.quantizers.auto import AutoHfQuantizer

from kvboost_hf.streaming.config import StreamingAWQConfig

logger = logging.getLogger(__name__)

_MARK = "_kvboost_streaming_wrapper"


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config)


def install() -> None:
    """Wrap ``AutoHfQuantizer.merge_quantization_configs`` once (idempotent)."""
    current = AutoHfQuantizer.__dict__["merge_quantization_configs"]
    original = current.__func__ if isinstance(current, classmethod) else current
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def merge_quantization_configs(cls, quantization_config, quantization_config_from_args):
        if isinstance(quantization_config_from_args, StreamingAWQConfig):
            if isinstance(quantization_config, StreamingAWQConfig):
                return quantization_config_from_args
            merged = quantization_config_from_args.merged_with_checkpoint(_as_dict(quantization_config))
            logger.info("loading an AWQ checkpoint with StreamingAWQConfig: %s", merged.to_dict())
            return merged
        return original(cls, quantization_config, quantization_config_from_args)

    setattr(merge_quantization_configs, _MARK, True)
    merge_quantization_configs.__wrapped_original__ = original
    AutoHfQuantizer.merge_quantization_configs = classmethod(merge_quantization_configs)


def original_merge():
    """transformers' own ``merge_quantization_configs`` function (unwrapped), for tests."""
    current = AutoHfQuantizer.__dict__["merge_quantization_configs"].__func__
    return getattr(current, "__wrapped_original__", current)
