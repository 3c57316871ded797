"""``StreamingAWQQuantizer``: the transformers quantizer plugin for :class:`StreamingAWQConfig`.

Registered with ``register_quantization_config`` / ``register_quantizer`` under
``"kvboost_awq_streaming"`` (importing :mod:`kvboost_hf.streaming` does it). It loads
pre-quantized AutoAWQ GEMM checkpoints only; no gptqmodel / autoawq needed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer

from kvboost_hf.streaming.config import QUANT_METHOD, StreamingAWQConfig
from kvboost_hf.streaming.loader import build_runtime, checkpoint_index, replace_linears

logger = logging.getLogger(__name__)


class StreamingAWQQuantizer(HfQuantizer):
    """Replaces the checkpoint's quantized linears before loading; converts and streams after."""

    requires_calibration = True
    quantization_config: StreamingAWQConfig

    def __init__(self, quantization_config: StreamingAWQConfig, **kwargs: Any) -> None:
        if not kwargs.get("pre_quantized", True):
            raise ValueError(
                "quantization_config.quant_method: StreamingAWQConfig loads AutoAWQ GEMM checkpoints "
                "(config.json quantization_config with quant_method 'awq'); this checkpoint is not one. "
                "Write one with `kvboost-hf awq-pack MODEL OUT`."
            )
        super().__init__(quantization_config, **kwargs)
        self._index: dict[str, str] = {}
        self._placed: dict[str, int] = {}
        self._files: list[str] = []
        self._device = torch.device("cpu")  # where update_device_map places the model (None: the CPU)

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        self.quantization_config.check_checkpoint_fields()

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """bfloat16 in place of float16 (an AWQ checkpoint's own dtype) for a model placed on a CPU, whose int4
        kernels take bf16; called after :meth:`update_device_map` has said where the model goes."""
        if dtype in (None, torch.float16) and self._device.type == "cpu":
            logger.info("AWQ streaming on CPU: computing in bfloat16 instead of %s (int4 kernels take bf16)", dtype)
            return torch.bfloat16
        return dtype

    def update_device_map(self, device_map: dict[str, Any] | str | None) -> dict[str, Any] | None:
        """One device for the whole model, so accelerate adds no hooks of its own."""
        placed = _one_device(device_map)
        self._device = _device(placed)
        return placed

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs: Any):
        self._files = list(checkpoint_files or [])
        self._index = checkpoint_index(self._files)
        self._placed = replace_linears(model, self.quantization_config, self._index)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        build_runtime(model, self.quantization_config, self._index, self._placed, self._files)
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Register config and quantizer with transformers (idempotent)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not StreamingAWQConfig:
        register_quantization_config(QUANT_METHOD)(StreamingAWQConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not StreamingAWQQuantizer:
        register_quantizer(QUANT_METHOD)(StreamingAWQQuantizer)


def _one_device(device_map: dict[str, Any] | str | int | torch.device | None) -> dict[str, Any] | None:
    """``device_map`` as one device for the whole model, its value as given (None stays None: the CPU)."""
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        devices = {_device_name(d) for d in device_map.values()}
        if len(devices) != 1:
            raise ValueError(f"device_map must place the whole model on one device for AWQ streaming: {devices}")
        return {"": next(iter(device_map.values()))}
    if device_map in ("auto", "balanced", "sequential"):
        return {"": "cuda:0" if torch.cuda.is_available() else "cpu"}
    if isinstance(device_map, str) and device_map.startswith("balanced"):
        raise ValueError(f"device_map={device_map!r} spreads a model over devices; AWQ streaming places the whole "
                         "model on one: give 'auto', 'cpu', 'cuda:N', an int N or {'': device}")
    return {"": device_map}


def _device_name(device: str | int | torch.device) -> str:
    """A device map's value as a comparable name: an int N (or "N") is cuda:N, as accelerate reads it; "disk" and
    other names torch does not know stay as given."""
    name = str(device)
    if name.isdigit():
        return f"cuda:{name}"
    try:
        return str(torch.device(name))
    except RuntimeError:
        return name


def _device(placed: dict[str, Any] | None) -> torch.device:
    """Where :func:`_one_device`'s map computes: the CPU for None, "cpu", "meta" and accelerate's "disk" (weights
    loaded to the CPU to compute); else its device."""
    name = "cpu" if placed is None else _device_name(placed[""])
    return torch.device("cpu" if name in ("disk", "meta") else name)
