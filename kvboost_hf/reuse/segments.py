"""Where chunks should start: segment boundaries (documents, chat turns, separators).

A chunk that straddles two documents can only be reused where both appear together; chunks
that start where segments start can be found wherever each segment appears.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Special tokens that open a chat turn in common chat templates.
TURN_START_TOKENS = ("<start_of_turn>", "<|im_start|>", "<|start_header_id|>", "[INST]", "<|user|>",
                     "<|assistant|>", "<|system|>", "<|turn>")


def turn_start_ids(tokenizer) -> tuple[int, ...]:
    """Ids of the tokenizer's chat-turn opening tokens (empty without a chat template)."""
    if tokenizer is None:
        return ()
    vocab = tokenizer.get_vocab()
    return tuple(vocab[t] for t in TURN_START_TOKENS if t in vocab)


def separator_ids(tokenizer, separator: str | None) -> tuple[int, ...]:
    """Token ids of ``separator`` as it tokenizes on its own (no special tokens)."""
    if not separator:
        return ()
    if tokenizer is None:
        raise ValueError("separator= needs tokenizer= to be turned into token ids")
    ids = tuple(tokenizer(separator, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"separator {separator!r} tokenizes to nothing")
    return ids


def segment_starts(
    token_ids: Sequence[int],
    turn_tokens: Iterable[int] = (),
    separator: Sequence[int] = (),
    extra: Iterable[int] = (),
    leading_special: Iterable[int] = (),
) -> list[int]:
    """Positions where a segment starts: after leading special tokens (BOS), at every turn-start
    token, right after every occurrence of ``separator``, and at the ``extra`` positions."""
    ids = list(token_ids)
    starts = {p for p in extra if 0 < p < len(ids)}
    special = set(leading_special)
    lead = 0
    while lead < len(ids) and ids[lead] in special:
        lead += 1
    if 0 < lead < len(ids):
        starts.add(lead)
    turns = set(turn_tokens)
    starts.update(i for i, t in enumerate(ids) if i and t in turns)
    n = len(separator)
    if n:
        sep = list(separator)
        starts.update(i + n for i in range(len(ids) - n) if ids[i : i + n] == sep)
    return sorted(starts)
