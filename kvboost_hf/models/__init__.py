"""What kvboost_hf knows of a transformers model: the unwrapped target, its shape and K/V byte costs,
its weight fingerprint and namespace, the attention implementation switch, RoPE, loading, and
weights on huge pages.

Imports only :mod:`kvboost_hf.store` (for key types and entry sizes) below it.
"""

from kvboost_hf.models.huge_pages import HugePageReport, back_with_huge_pages
from kvboost_hf.models.loading import (
    DEFAULT_MODEL_NAME,
    GEMMA_CHAT_TEMPLATE,
    cache_dir,
    default_model_path,
    load_default_model,
    load_model,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GEMMA_CHAT_TEMPLATE",
    "HugePageReport",
    "back_with_huge_pages",
    "cache_dir",
    "default_model_path",
    "load_default_model",
    "load_model",
    "load_tokenizer",
]
