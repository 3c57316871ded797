"""``model.generate`` with reuse: switching it on for a model, the generate wrapper, warming the store,
and the extension point other capabilities (speculative decoding) join a generate call through.

Sits on :mod:`kvboost_hf.reuse`, :mod:`kvboost_hf.cache`, :mod:`kvboost_hf.models` and
:mod:`kvboost_hf.store`; it imports no extension (see :mod:`kvboost_hf.generation.extension`).
"""

from kvboost_hf.generation.enable import (
    disable_chunk_reuse,
    enable_chunk_reuse,
    is_chunk_reuse_enabled,
    last_request_stats,
)
from kvboost_hf.generation.extension import (
    GenerateExtension,
    GenerateSession,
    register_extension,
    unregister_extension,
)
from kvboost_hf.generation.timing import FirstTokenTimer
from kvboost_hf.generation.warm import chat_prefix, reusable_tokens, warm

__all__ = [
    "FirstTokenTimer",
    "GenerateExtension",
    "GenerateSession",
    "chat_prefix",
    "disable_chunk_reuse",
    "enable_chunk_reuse",
    "is_chunk_reuse_enabled",
    "last_request_stats",
    "register_extension",
    "reusable_tokens",
    "unregister_extension",
    "warm",
]
