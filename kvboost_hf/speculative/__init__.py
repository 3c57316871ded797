"""Speculative decoding that composes with chunk reuse: drafts, an adaptive draft length, telemetry.

Drafts (``model.generate(ids, draft=...)`` on a model with chunk reuse enabled):
``"prompt-lookup"``, ``"store"`` (n-grams of every stored sequence), an HF assistant model, or
a self-draft built by :func:`make_draft` from the target's own weights, or a head draft
(:func:`make_head_draft`: the target's own layers with a small head).
"""

from kvboost_hf.speculative.controller import ControllerSettings, DraftController
from kvboost_hf.speculative.extension import set_default_draft, speculation_totals
from kvboost_hf.speculative.head_draft import HeadDraft, make_head_draft
from kvboost_hf.speculative.ngram import LookupSettings
from kvboost_hf.speculative.self_draft import make_draft
from kvboost_hf.speculative.stats import SpeculationStats
from kvboost_hf.speculative.totals import SpeculationTotals

__all__ = ["ControllerSettings", "DraftController", "HeadDraft", "LookupSettings", "SpeculationStats",
           "SpeculationTotals", "make_draft", "make_head_draft", "set_default_draft", "speculation_totals"]
