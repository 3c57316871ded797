"""The memory planner's predicted peak against the measured peak on Gemma-3-270M, prompts of 128 to 4,096 tokens.

Each prompt length runs in a fresh subprocess (freed memory of an earlier request would otherwise
be reused without raising the resident set): load the model, one short generate (it pages the
weights in), ``malloc_trim`` (freed heap back to the OS; a fixed glibc mmap threshold, see MALLOC_ENV), then
reset the kernel's peak-RSS counter (``/proc/self/clear_refs``), run ``generate`` (greedy, 8 new
tokens, plain DynamicCache: sliding layers keep their window) and read ``VmHWM``. Measured =
peak resident set minus the resident set before the request. Predicted = the planner's
``peak_bytes`` for the same request with ``sliding_capped=True`` and the plan's prefill chunk.
The quantized rungs are measured the same way, with the request's cache a ``KIVICache`` of 8 or
4 bits (``--kv-bits``, prompts of 1,024 tokens and more).

Writes docs/benchmarks/memory_planner.json. Usage: ``python benchmarks/memory_planner.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import environment, essays, write_json  # noqa: E402

LENGTHS = (128, 256, 512, 1024, 2048, 4096)
# A fixed mmap threshold: glibc otherwise raises it as large blocks are freed and serves later
# ones from a heap it keeps, so the resident set stops following what is live (runs disagreed by
# a third). With it, every tensor above 128 KiB is mapped and unmapped on its own.
MALLOC_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
NEW_TOKENS = 8


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def one(length: int, chunk: int | None, kv_bits: int | None = None) -> dict:
    """Run in the child: measure one request of ``length`` prompt tokens."""
    import torch

    from kvboost_hf import KIVICache
    from kvboost_hf.models import load_default_model
    from kvboost_hf.planner.memory import MemoryPlanner

    model, tokenizer = load_default_model()
    text = "\n\n".join(essays()[:12])
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :length]
    assert ids.shape[1] == length
    kwargs = {} if chunk is None else {"prefill_chunk_size": chunk}
    if kv_bits is not None:
        kwargs["past_key_values"] = KIVICache(model.config, bits=kv_bits)
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=2, do_sample=False)  # pages the weights in
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the request's own growth shows
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
        before = status_kib("VmRSS") * 1024
        model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    measured = status_kib("VmHWM") * 1024 - before
    planner = MemoryPlanner.for_model(model, memory_limit=1 << 40, reuse=False)
    predicted = planner.peak_bytes(length, NEW_TOKENS, prefill_chunk_size=chunk, kv_bits=kv_bits)
    return {"prompt_tokens": length, "prefill_chunk_size": chunk, "kv_bits": kv_bits, "predicted_mb": predicted / 2**20,
            "measured_mb": measured / 2**20, "residual": measured / predicted - 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    parser.add_argument("--kv-bits", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-quantized", action="store_true", help="skip the KIVICache rows")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one(args.child, args.chunk, args.kv_bits)))
        return
    rows = []
    runs = [(length, chunk, None) for length in args.lengths for chunk in ((None, 512) if length > 512 else (None,))]
    if not args.no_quantized:
        runs += [(length, 512, bits) for length in args.lengths if length >= 1024 for bits in (8, 4)]
    for length, chunk, bits in runs:
        cmd = [sys.executable, __file__, "--child", str(length)] + (["--chunk", str(chunk)] if chunk else [])
        cmd += ["--kv-bits", str(bits)] if bits else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=MALLOC_ENV)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{row['prompt_tokens']:>6} chunk={str(row['prefill_chunk_size']):>5} kv_bits={str(bits):>4} predicted "
              f"{row['predicted_mb']:8.1f} MiB  measured {row['measured_mb']:8.1f} MiB  "
              f"residual {row['residual']:+.1%}", flush=True)
    path = write_json("memory_planner.json", {"new_tokens": NEW_TOKENS, "rows": rows, "environment": environment()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
