"""A decode step's cache updates: transformers' concatenating layers against the in-place layers a fused int4
decoder swaps into ``generate``'s ``DynamicCache`` (``kvboost_hf.cache.buffer.in_place_layer``).

One token of bf16 keys and values appended to each of Gemma-3-270M's 18 layers (its config: 15 sliding
layers of 512 tokens, 3 full ones) holding ``--lengths`` tokens; a 64 MB sweep before each step evicts the
CPU caches as a real step's weights do. One process, the two kinds alternating, medians.

    python benchmarks/cache_update.py --lengths 200 1000 2000 --rounds 2 --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, DynamicCache

from kvboost_hf.cache.buffer import in_place_layer
from kvboost_hf.models import default_model_path


def step_ms(config, length: int, in_place: bool, steps: int, sweep: torch.Tensor) -> float:
    """Median ms of one token's updates over every layer of a cache holding ``length`` tokens."""
    cache = DynamicCache(config=config)
    if in_place:
        cache.layers[:] = [in_place_layer(layer) or layer for layer in cache.layers]
    history = torch.randn(1, config.num_key_value_heads, length, config.head_dim, dtype=torch.bfloat16)
    one = torch.randn(1, config.num_key_value_heads, 1, config.head_dim, dtype=torch.bfloat16)
    for index in range(len(cache.layers)):
        cache.update(history, history.clone(), index)
    times = []
    for _ in range(steps):
        sweep.add_(1)
        start = time.perf_counter()
        for index in range(len(cache.layers)):
            cache.update(one, one, index)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[200, 1000, 2000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(default_model_path())
    config = getattr(config, "text_config", config)
    sweep = torch.empty(16 << 20)
    print("tokens | concatenating ms | in place ms | ratio")
    for length in args.lengths:
        runs = {False: [], True: []}
        for _ in range(args.rounds):
            for in_place in (False, True):
                runs[in_place].append(step_ms(config, length, in_place, args.steps, sweep))
        cat, own = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"{length} | {cat:.2f} ({', '.join(f'{t:.2f}' for t in runs[False])}) | "
              f"{own:.2f} ({', '.join(f'{t:.2f}' for t in runs[True])}) | {cat / own:.2f}x")


if __name__ == "__main__":
    main()
