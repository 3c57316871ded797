"""Step-level continuous batching over per-request caches.

Each request keeps its own cache (a :class:`~kvboost_hf.cache.ChunkReuseCache` when reuse is
on, so the store lookup and commit are the library's own); a decode step runs every running
request's next token in one batched forward, through :class:`PaddedRowsCache`, which writes
each row's new K/V into that row's cache and shows attention the rows right-padded with a mask.
Prompts are prefilled in chunks between decode steps (chunks of similar length batched together).

- :mod:`.rows_cache`: the cache view of one batched forward and its attention masks;
- :mod:`.prefill`: a prompt's lookup (the reuse hook's own) and its chunked prefill;
- :mod:`.sampling`: per-row sampling (the row's own processors, warpers and generator) and raw logprobs;
- :mod:`.sequence`: one request's state (tokens, text, stop, finish);
- :mod:`.scheduler`: decides each step (admissions, prefill chunks) — decides only;
- :mod:`.runner`: executes a step's forwards — executes only.
"""

from .rows_cache import PaddedRowsCache, decode_masks, row_masks
from .runner import BatchRunner
from .sampling import RawLogprob, RowSampling, next_token, raw_logprob
from .scheduler import BatchLimits, StepPlan, group_chunks, plan_step
from .sequence import Sequence

__all__ = [
    "BatchLimits",
    "BatchRunner",
    "PaddedRowsCache",
    "RawLogprob",
    "RowSampling",
    "Sequence",
    "StepPlan",
    "decode_masks",
    "row_masks",
    "next_token",
    "raw_logprob",
    "group_chunks",
    "plan_step",
]
