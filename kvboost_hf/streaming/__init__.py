"""AWQ layer streaming: a transformers quantizer plugin for int4 models larger than memory.

```python
from transformers import AutoModelForCausalLM
from kvboost_hf.streaming import StreamingAWQConfig, streaming_stats

model = AutoModelForCausalLM.from_pretrained(
    "path/to/awq-checkpoint",
    quantization_config=StreamingAWQConfig(residency_mode="partial_resident", keep_first_k=2, keep_last_k=2),
)
model.generate(...)
streaming_stats(model)
```

Importing this package registers the config and quantizer with transformers and installs the
small compatibility wrapper described in :mod:`kvboost_hf.streaming.compat`.
"""

from __future__ import annotations

import os

from torch import nn

from kvboost_hf.streaming import compat
from kvboost_hf.streaming.config import QUANT_METHOD, RESIDENCY_MODES, StreamingAWQConfig
from kvboost_hf.streaming.loader import RUNTIME_ATTR
from kvboost_hf.streaming.quantizer import StreamingAWQQuantizer, register
from kvboost_hf.streaming.stats import StreamingStats

register()
compat.install()


def _runtime(model: nn.Module):
    runtime = getattr(model, RUNTIME_ATTR, None)
    if runtime is None and hasattr(model, "get_base_model"):
        runtime = getattr(model.get_base_model(), RUNTIME_ATTR, None)
    return runtime


def is_streaming_model(model: nn.Module) -> bool:
    """Whether ``model`` was loaded with :class:`StreamingAWQConfig`."""
    return _runtime(model) is not None


def streaming_stats(model: nn.Module) -> StreamingStats:
    """A snapshot of the model's streaming counters (hits, late, misses, bytes moved, blocked ms)."""
    runtime = _runtime(model)
    if runtime is None:
        raise ValueError("model was not loaded with StreamingAWQConfig")
    return runtime.stats.snapshot()


def load_awq_model(path: str | os.PathLike, config: StreamingAWQConfig, **kwargs):
    """``(model, tokenizer)`` for an AutoAWQ GEMM checkpoint directory, loaded with ``config``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, **kwargs)
    return model.eval(), tokenizer


def reset_streaming_stats(model: nn.Module) -> None:
    """Zero the counters (not the configuration figures)."""
    runtime = _runtime(model)
    if runtime is None:
        raise ValueError("model was not loaded with StreamingAWQConfig")
    runtime.stats.reset()


__all__ = [
    "QUANT_METHOD",
    "RESIDENCY_MODES",
    "StreamingAWQConfig",
    "StreamingAWQQuantizer",
    "StreamingStats",
    "is_streaming_model",
    "load_awq_model",
    "reset_streaming_stats",
    "streaming_stats",
]
