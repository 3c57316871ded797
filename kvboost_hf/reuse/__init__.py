"""The reuse engine: per-model state, the forward hooks that load stored K/V into a request's cache,
lookup, commit, and the repair strategies for chunks reused away from their stored position.

Sits on :mod:`kvboost_hf.cache`, :mod:`kvboost_hf.models` and :mod:`kvboost_hf.store`; the generation
layer (:mod:`kvboost_hf.generation`) installs it on a model and drives it per ``generate`` call.
"""

from kvboost_hf.reuse.commit import commit_request
from kvboost_hf.reuse.hooks import install, start_request
from kvboost_hf.reuse.state import STATE_ATTR, ReuseState, reuse_state

__all__ = ["STATE_ATTR", "ReuseState", "commit_request", "install", "reuse_state", "start_request"]
