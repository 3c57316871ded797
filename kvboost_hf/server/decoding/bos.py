"""Completion prompts that miss the ``<bos>`` their model expects (or carry it twice).

A model "needs" ``<bos>`` when its tokenizer puts one before every text (Gemma, Llama): the model
was trained that way, and without it a base model's replies and scores are off (Gemma-3-270M
answers nothing and scores multiple choice at chance). Text prompts get it from the tokenizer;
prompts sent as token ids are the client's to build, and lm-eval's remote tokenizer builds them
without it. The server keeps the ids it was given and says so: a response header
(:data:`BOS_WARNING_HEADER`) on every such response and a log warning once per server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi.responses import JSONResponse, Response

logger = logging.getLogger(__name__)

BOS_WARNING_HEADER = "X-Kvboost-Warning"


def bos_needed(tokenizer) -> int | None:
    """The bos token id when ``tokenizer`` starts every encoded text with it, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if list(ids[:1]) == [bos] else None


class BosCheck:
    """Checks completion prompts against the model's ``<bos>`` (no-op for models that need none)."""

    def __init__(self, tokenizer) -> None:
        self.bos_id = bos_needed(tokenizer)
        self.bos_token = getattr(tokenizer, "bos_token", None)
        self._logged = False

    def warning(self, prompts: Sequence[Sequence[int]]) -> str | None:
        """The warning for a request whose tokenized prompts are ``prompts`` (None when all are fine);
        logged the first time one is found."""
        if self.bos_id is None:
            return None
        missing = [i for i, ids in enumerate(prompts) if not ids or ids[0] != self.bos_id]
        doubled = [i for i, ids in enumerate(prompts) if list(ids[:2]) == [self.bos_id, self.bos_id]]
        parts = []
        if missing:
            parts.append(f"prompt {_indices(missing)} does not start with {self.bos_token} (id {self.bos_id}), which "
                         f"this model's tokenizer puts before every text: replies and logprobs will be off; prepend "
                         f"{self.bos_id} to token-id prompts or send text (lm-eval: tokenizer_backend=huggingface,"
                         f"tokenizer=<the model's tokenizer>,add_bos_token=True)")
        if doubled:
            parts.append(f"prompt {_indices(doubled)} starts with {self.bos_token} twice (the tokenizer adds one "
                         f"to text prompts): drop the one in the prompt")
        if not parts:
            return None
        message = "; ".join(parts)
        if not self._logged:
            self._logged = True
            logger.warning("%s (logged once; every such response carries the %s header)", message, BOS_WARNING_HEADER)
        return message


def _indices(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")


def with_warning(result, warning: str | None):
    """``result`` (a response or a response body) with the warning header added when there is one."""
    if warning is None:
        return result
    if isinstance(result, Response):
        result.headers[BOS_WARNING_HEADER] = warning
        return result
    return JSONResponse(result.model_dump(mode="json"), headers={BOS_WARNING_HEADER: warning})
