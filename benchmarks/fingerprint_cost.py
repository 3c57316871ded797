"""What identifying the model costs on Gemma-3-270M: the full-content fingerprint and the per-request check.

- fingerprint, first: hashing every parameter and buffer right after loading (the weights are
  mmap'd from the checkpoint, so this includes paging them in, as a first forward would);
- fingerprint, resident: the same with the weights in memory (what a re-hash after a weight
  change costs);
- per-request check: ``model_state_token`` (version counters, pointers, 16 sampled values per
  tensor, adapters, config digest), paid by every request;
- memoised namespace: the namespace lookup a request does when nothing changed.

Writes docs/benchmarks/fingerprint.json. Usage: ``python benchmarks/fingerprint_cost.py [--reps 9]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, median, write_json  # noqa: E402

from kvboost_hf.models import load_default_model  # noqa: E402
from kvboost_hf.models.fingerprint import model_state_token, state_tensors, weights_fingerprint  # noqa: E402
from kvboost_hf.models.namespace import namespace  # noqa: E402


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    model, _ = load_default_model()
    nbytes = sum(t.numel() * t.element_size() for _, t in state_tensors(model))
    start = time.perf_counter()
    weights_fingerprint(model)
    first_ms = (time.perf_counter() - start) * 1000.0
    resident_ms = timed(lambda: weights_fingerprint(model), args.reps)
    namespace(model)
    token_ms = timed(lambda: model_state_token(model), args.reps * 10)
    memo_ms = timed(lambda: namespace(model), args.reps * 10)
    result = {
        "model": "gemma-3-270m (float32)",
        "weight_bytes": nbytes,
        "fingerprint_first_ms": round(first_ms, 1),
        "fingerprint_resident_ms": round(resident_ms, 1),
        "fingerprint_gb_per_s": round(nbytes / resident_ms / 1e6, 1),
        "per_request_check_ms": round(token_ms, 3),
        "memoised_namespace_ms": round(memo_ms, 3),
        "reps": args.reps,
        "environment": environment(),
    }
    print(result)
    print(f"wrote {write_json('fingerprint.json', result)}")


if __name__ == "__main__":
    main()
