"""OpenAI-compatible HTTP server with cross-request KV reuse (``kvboost-hf serve``).

Needs the ``server`` extra: ``pip install 'kvboost_hf[server]'`` (FastAPI, uvicorn,
prometheus_client, tqdm, xgrammar). ``create_app(model, tokenizer, store, settings)`` builds the app
from objects in memory; ``kvboost-hf serve`` / ``python -m kvboost_hf.server`` load a model
and run it with uvicorn.
"""

from __future__ import annotations

from typing import Any

from kvboost_hf.server.settings import RECOMPUTE_STRATEGIES, ServerSettings

__all__ = ["RECOMPUTE_STRATEGIES", "ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so `kvboost-hf --help` and the CLI's other commands work without the extra.
    if name == "create_app":
        from kvboost_hf.server.routes.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
