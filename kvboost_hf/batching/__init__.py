"""Step-level continuous batching over per-request caches.

Each request keeps its own cache (a :class:`~kvboost_hf.cache.ChunkReuseCache` when reuse is
on, so the store lookup and commit are the library's own). A step forwards every decoding
request's next token and the step's prompt chunks (chunked prefill) in **one packed forward**
(:class:`PackedRowsCache`): the new tokens of all rows side by side in one sequence, each row's
K/V written into that row's cache and attended to by that row only (SDPA per row). Models on
eager attention use :class:`PaddedRowsCache` instead: rows right-padded with prepared masks, a
decode forward plus prompt-chunk forwards.

- :mod:`.packed`: the cache view and attention of one packed forward (SDPA);
- :mod:`.rows_cache`: the cache view of one padded forward and its attention masks (eager);
- :mod:`.prefill`: a prompt's lookup (the reuse hook's own) and its chunked prefill;
- :mod:`.sampling`: per-row sampling (the row's own processors, warpers and generator) and raw logprobs;
- :mod:`.sequence`: one request's state (tokens, text, stop, finish);
- :mod:`.scheduler`: decides each step (admissions, prefill chunks) — decides only;
- :mod:`.runner`: executes a step's forwards — executes only.
"""

from kvboost_hf.batching.packed import PackedRowsCache
from kvboost_hf.batching.rows_cache import PaddedRowsCache, row_masks
from kvboost_hf.batching.runner import BatchRunner
from kvboost_hf.batching.sampling import RawLogprob, RowSampling, next_token, raw_logprob
from kvboost_hf.batching.scheduler import BatchLimits, StepPlan, group_chunks, plan_step
from kvboost_hf.batching.sequence import Sequence

__all__ = [
    "BatchLimits",
    "BatchRunner",
    "PackedRowsCache",
    "PaddedRowsCache",
    "RawLogprob",
    "RowSampling",
    "Sequence",
    "StepPlan",
    "row_masks",
    "next_token",
    "raw_logprob",
    "group_chunks",
    "plan_step",
]
