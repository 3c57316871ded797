"""Per-token logprobs kept with stored chunks, so prompt logprobs (``echo``) need no recompute.

A token's logprob given everything before it is a property of the token chain and the model,
which is exactly what a chunk key names (a chained hash under the model's namespace). It costs
4 bytes per token (float32). It is only known where a forward computed logits at every position
(a prompt scored for ``echo`` + ``logprobs``), so it is attached to already stored chunks
afterwards; the disk tier's files and the Redis copies are rewritten with them. The store counts
those 4 bytes in every entry's size from the start (``codec.TOKEN_BYTES``), so attaching them
never takes it past its budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvboost_hf.store.keys import Key


def stored_logprobs(store, namespace: Key, token_ids: Sequence[int], *, shared: Key | None = None) -> list[float | None]:
    """Logprobs of the leading tokens of ``token_ids`` that the store holds; stops at the first chunk without.

    The first token of a chain has none (``None``); every later entry is a float.
    """
    out: list[float | None] = []
    for hit in store.lookup(namespace, token_ids, shared=shared):
        values = hit.chunk.logprobs
        if values is None or not hit.exact:
            break
        out.extend(None if math.isnan(v) else v for v in values[hit.offset : hit.offset + hit.num_tokens].tolist())
    return out


def attach_logprobs(store, namespace: Key, token_ids: Sequence[int], logprobs: Sequence[float | None], *,
                    shared: Key | None = None, owner: str | None = None) -> int:
    """Keep ``logprobs[i]`` (of ``token_ids[i]``) with every stored chunk of ``owner``'s in the prompt's prefix
    chain that lies wholly inside it; returns how many chunks got them. Shared chunks (another owner's)
    are left as they are: whether they hold logprobs would tell one owner what another asked."""
    if len(logprobs) != len(token_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
    attached = []
    for hit in store.lookup(namespace, token_ids, shared=shared):
        if not hit.exact or hit.offset or hit.num_tokens != hit.chunk.num_tokens or hit.chunk.owner != owner:
            continue  # a chunk reaching past the prompt: the logprobs of its other tokens are unknown here
        values = logprobs[hit.start : hit.start + hit.num_tokens]
        hit.chunk.logprobs = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
        attached.append(hit.chunk)
    store.persist(attached)  # the disk tier's files get them too
    return len(attached)
