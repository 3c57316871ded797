"""The fused decoder's Python-side choices, A/B in one process, call by call: Gemma-3-270M packed by ``awq-pack``
(round-to-nearest, group 128, resident, bf16) on kvboost_hf's kernels.

- ``decoder_step``: one ``torch.ops.kvboost.decoder_step`` call a forward on in-place cache layers against one
  ``layer_step`` call a layer from Python (forced by answering None in ``_reserved``);
- ``layer_step``: one ``torch.ops.kvboost.layer_step`` call a layer on in-place cache layers (the in-place
  protocol, ``kvboost_hf.kernels.decoder``; forced as for ``decoder_step``) against the four calls a layer (forced
  by answering False for every cache in ``_updates_layers_only``);
- ``witness``: the plan checked against its witness against the plan read again at every call
  (``kvboost_hf.kernels.plan``);
- ``head_tiles``: the bf16 head on its tile copy (``KernelLinear.use_tiles``, what the loader keeps on amx_bf16)
  against the head on its own ``[N, K]`` weight (the copy set aside): only the amx_bf16 path reads tiles;
- ``draft_round``: a head draft's plain round as one ``torch.ops.kvboost.draft_round`` call against the round
  token by token (``HeadProposer.fused_rounds`` False); only ``--what speculate`` runs head-draft rounds.

Each round prefills a 200-token prompt, then alternates the two ways call by call (ABBA) over one-token calls of
the decoder alone (``--what decoder``), of the whole model (``step``: decoder and bf16 head, ``DynamicCache``), or
of its int4 self-draft (``draft``: 32k-vocab head, ``BufferedCache``), or 9-token calls of the whole model
cropped back after each (``verify``: a speculative verification), or whole greedy requests with a head draft
(``speculate``: ``make_head_draft(model, 16384)``, 8 tokens a round, 64 new tokens after benchmarks/speculative.py's
document prompts, a 200-token essay excerpt and an instruction to copy a paragraph of it; up to 8 a round, each
prompt warmed in the request's chunk store first, so both ways reuse it, and both ways' tokens checked equal);
``--sweep`` reads 64 MB before each call,
as a step's weights evict the CPU caches. Prints each way's median and the median and quartiles of the per-pair
ratios (the second way over the first: above 1, the first is faster). The host's drift between processes is larger
than these differences; a pair's two calls are ~20-40 ms apart.

    python benchmarks/decoder_ab.py --compare decoder_step --what decoder step draft --rounds 6
    python benchmarks/decoder_ab.py --compare layer_step --what decoder step draft --rounds 6
    python benchmarks/decoder_ab.py --compare witness --what decoder --sweep
    python benchmarks/decoder_ab.py --compare head_tiles --what step verify --rounds 6
    python benchmarks/decoder_ab.py --compare draft_round --what speculate --rounds 4
"""

from __future__ import annotations

import argparse
import time

import torch


def ways(compare: str, model) -> dict:
    """The two ways of ``compare``, each as its (module, attribute, value) patches; the first is the package's own."""
    from kvboost_hf.kernels import decoder, plan

    if compare == "head_tiles":
        head = model.get_output_embeddings()
        copy = head.tile_copy
        if copy is None:
            raise SystemExit("the head keeps no tile copy here (it is kept where the amx_bf16 path runs)")
        return {"tiles": [(head, "tile_copy", copy)], "[N, K]": [(head, "tile_copy", None)]}

    if compare == "draft_round":
        from kvboost_hf.speculative.head_draft import HeadProposer

        return {"one call a round": [(HeadProposer, "fused_rounds", True)],
                "token by token": [(HeadProposer, "fused_rounds", False)]}
    if compare == "decoder_step":
        return {"one call": [(decoder, "_reserved", decoder._reserved)],
                "one call a layer": [(decoder, "_reserved", lambda *args: None)]}
    if compare == "layer_step":
        per_layer = (decoder, "_reserved", lambda *args: None)
        return {"one call": [per_layer, (decoder, "_updates_layers_only", decoder._updates_layers_only)],
                "four calls": [per_layer, (decoder, "_updates_layers_only", lambda cache: False)]}
    return {"witness": [(plan, "checked_plan", plan.checked_plan)],
            "read again": [(plan, "checked_plan", plan.layer_plan)]}


def measure(model, call, new_cache, variants: dict, rounds: int, pairs: int, sweep: bool, rows: int = 1) -> dict:
    """Per way, the seconds of each call of ``rows`` tokens; and the per-pair ratios (second way / first)."""
    prompt = torch.randint(10, 20000, (1, 201 + pairs + rows), generator=torch.Generator().manual_seed(1))
    result = {"times": {name: [] for name in variants}, "ratios": []}
    evict = torch.zeros(16 * 1024 * 1024)
    with torch.no_grad():
        for _ in range(rounds):
            cache = new_cache(model.config)
            model(prompt[:, :200], past_key_values=cache)
            model(prompt[:, 200:201], past_key_values=cache)  # the refill after a prefill's exact buffers
            for i in range(pairs):
                pair(variants, i % 2 == 1, lambda: call(model, prompt[:, 201 + i:201 + i + rows], cache), result,
                     before=(lambda: evict.add_(1)) if sweep else None)
    use(variants)
    return result


def speculate(model, tokenizer, variants: dict, rounds: int, pairs: int) -> dict:
    """Per way, the seconds of each whole greedy request with a head draft; and the per-pair ratios. ``pairs``
    document prompts a round, each warmed into the chunk store before its pair."""
    from kvboost_hf import ChunkStore, ControllerSettings, enable_chunk_reuse, make_head_draft

    from speculative import document_prompts

    head = make_head_draft(model, 16384, tokenizer=tokenizer)
    fixed = ControllerSettings(adaptive=False, max_tokens=8)
    prompts = document_prompts(tokenizer, pairs, 200)
    result = {"times": {name: [] for name in variants}, "ratios": []}
    enable_chunk_reuse(model, ChunkStore(max_bytes=512 * 2**20, chunk_size=64))
    with torch.no_grad():
        for r in range(rounds):
            for i, ids in enumerate(prompts):
                model.generate(ids, max_new_tokens=1, do_sample=False)  # the prompt stored: both ways reuse it
                replies = pair(variants, (r + i) % 2 == 1, lambda: model.generate(
                    ids, max_new_tokens=64, do_sample=False, draft=head, speculation=fixed)[0, ids.shape[1]:].tolist(),
                    result)
                if len({tuple(reply) for reply in replies.values()}) != 1:
                    raise SystemExit(f"the two ways' replies differ (prompt {i}, round {r})")
    use(variants)
    return result


def use(variants: dict, name: str | None = None) -> None:
    """Patches in the way ``name`` (None: the first, the package's own)."""
    for owner, attribute, value in variants[name or next(iter(variants))]:
        setattr(owner, attribute, value)


def pair(variants: dict, reverse: bool, call, result: dict, before=None) -> dict:
    """One timed ``call()`` per way (in reverse order where ``reverse``; ``before()`` untimed ahead of each), added to
    ``result``'s times and ratios (second way / first); returns each way's answer."""
    names, took, answers = list(variants), {}, {}
    for name in names[::-1] if reverse else names:
        use(variants, name)
        if before is not None:
            before()
        start = time.perf_counter()
        answers[name] = call()
        took[name] = time.perf_counter() - start
    for name in names:
        result["times"][name].append(took[name])
    result["ratios"].append(took[names[1]] / took[names[0]])
    return answers


def verify(model, tokens: torch.Tensor, cache) -> None:
    """A verification's forward of ``tokens`` (every row's logits), then its rows cropped off the cache again."""
    model(tokens, past_key_values=cache)
    cache.crop(-tokens.shape[1])  # (sliding-window layers take only a count to remove)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=["decoder_step", "layer_step", "witness", "head_tiles", "draft_round"],
                        default="decoder_step")
    parser.add_argument("--what", nargs="+", choices=["decoder", "step", "verify", "draft", "speculate"], default=["decoder"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=30, help="pairs of calls a round (speculate: prompts, at most 8)")
    parser.add_argument("--sweep", action="store_true", help="read 64 MB before each call")
    args = parser.parse_args()

    from transformers import DynamicCache

    from kvboost_hf import make_draft
    from kvboost_hf.cache import BufferedCache

    from _common import per_pair, resident_int4_gemma

    torch.set_num_threads(2)
    model, tokenizer = resident_int4_gemma()
    variants = ways(args.compare, model)
    for what in args.what:
        if what == "speculate":
            result = speculate(model, tokenizer, variants, args.rounds, min(args.pairs, 8))
            first, second = list(variants)
            print(f"speculate: {per_pair(result['times'], result['ratios'], f'{second} / {first}')}")
            continue
        if what == "draft":
            subject = make_draft(model, bits=4, vocab=32768, tokenizer=tokenizer)
            new_cache = lambda config: BufferedCache(config=config)  # noqa: E731
        else:
            subject, new_cache = model, lambda config: DynamicCache(config=config)  # noqa: E731
        call = (lambda m, x, c: m.model(x, past_key_values=c)) if what == "decoder" else (
            lambda m, x, c: m(x, past_key_values=c))
        if what == "verify":
            call = verify
        result = measure(subject, call, new_cache, variants, args.rounds, args.pairs, args.sweep,
                         rows=9 if what == "verify" else 1)
        first, second = list(variants)
        print(f"{what}{' (sweep)' if args.sweep else ''}: "
              f"{per_pair(result['times'], result['ratios'], f'{second} / {first}')}")


if __name__ == "__main__":
    main()
