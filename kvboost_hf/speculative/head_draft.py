"""Head drafts: the target's own layers propose with a small head; verification runs only the full head.

A self-draft (:func:`~kvboost_hf.make_draft`) of an int4 target runs the target's int4 layers with a
cheaper head, so every drafted token's layers run twice: once in the draft, once more in the
verification forward (which on CPU costs more per row than a decode step). A head draft runs them
once. It advances the **target's own cache** one token at a time with the target's decoder, called
with the inputs a decode step of ``generate`` passes (so each row gets the decode step's bits), and
picks each next token with a quantized head over the most frequent tokens (:class:`DraftHead`).
When transformers' assisted loop then verifies the candidates, the target's decoder computes only
the rows the draft has not (the last candidate), and the target's own LM head scores every row at
once, as any verification does. Rejected rows are cropped from the cache by the assisted loop.

So the output is the target's own, whatever the head drafts: the head only decides how many
tokens a round gets. The draft holds no weights but its head and no cache of its own.

Used as ``model.generate(ids, draft=make_head_draft(model, vocab=32768, tokenizer=tok))`` on a model
with chunk reuse enabled (``--draft head`` in the server). It pays off where a decode step's time is
mostly the LM head (small models with large vocabularies, an int4 model's bf16 head). A streamed
model (``partial_resident``) reads its layers again for every drafted token: use a self-draft there.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from kvboost_hf.kernels.draft_round import DraftRound, draft_round
from kvboost_hf.kernels.plan import plan_held
from kvboost_hf.models import attention
from kvboost_hf.speculative.exact_rows import route_rows
from kvboost_hf.speculative.head import DraftHead
from kvboost_hf.speculative.instance_forward import forward_installed, installed_alone
from kvboost_hf.speculative.quantized import BlockedInt8Linear
from kvboost_hf.speculative.vocab import draft_vocabulary, special_token_ids, token_ranking

# Inputs a CausalLM forward consumes itself and does not pass on to its decoder.
_HEAD_ARGUMENTS = ("labels", "logits_to_keep", "return_dict")
# Per-row inputs of a verification forward, sliced to the rows the decoder still computes.
_ROW_ARGUMENTS = ("position_ids", "cache_position", "token_type_ids")


class HeadDraft:
    """What ``generate(draft=...)`` takes to draft with the target's own layers and ``head``."""

    def __init__(self, head: DraftHead, hidden_size: int, vocab_size: int, name: str) -> None:
        self.head, self.hidden_size, self.vocab_size, self.draft_name = head, hidden_size, vocab_size, name

    @torch.no_grad()
    def next_token(self, hidden: torch.Tensor) -> int:
        """The head's top token for one row of the decoder's output (``[..., hidden_size]``)."""
        scores = self.head.linear(hidden.reshape(1, -1))
        index = int(scores.argmax(dim=-1))
        return index if self.head.tokens is None else int(self.head.tokens[index])

    def check(self, model: nn.Module) -> None:
        """Raise ValueError when this draft cannot draft for ``model``."""
        config = model.config.get_text_config(decoder=True)
        if (config.hidden_size, config.vocab_size) != (self.hidden_size, self.vocab_size):
            raise ValueError(f"this head draft was built for hidden size {self.hidden_size} and {self.vocab_size} "
                             f"tokens; the model has {config.hidden_size} and {config.vocab_size}: build it from "
                             "the model it drafts for (make_head_draft(model, ...))")
        if not callable(getattr(model, "get_decoder", None)) or not isinstance(model.get_decoder(), nn.Module):
            raise TypeError("a head draft needs a decoder-only CausalLM with get_decoder(), got "
                            f"{type(model).__name__}")


def make_head_draft(model: nn.Module, vocab: int | None = None, *, tokenizer=None, texts=None,
                    head_bits: int = 8) -> HeadDraft:
    """A head draft of ``model``: its own layers, and its LM head quantized to ``head_bits`` (8 or 4),
    restricted to the ``vocab`` most frequent tokens when given (needs ``tokenizer``; counted on
    ``texts`` or the offline essays, as :func:`~kvboost_hf.make_draft` counts them)."""
    if head_bits not in (4, 8):
        raise ValueError(f"make_head_draft(head_bits=...) must be 4 or 8, got {head_bits!r}")
    config = model.config.get_text_config(decoder=True)
    if vocab is not None and tokenizer is None:
        raise ValueError("make_head_draft(vocab=N) needs tokenizer= (token frequencies are counted with it)")
    if vocab is not None and not 1 <= vocab <= config.vocab_size:
        raise ValueError(f"make_head_draft(vocab=...) must be in 1..{config.vocab_size}, got {vocab!r}")
    tokens = None
    if vocab is not None:
        tokens = draft_vocabulary(token_ranking(tokenizer, config.vocab_size, texts), vocab,
                                  special_token_ids(model, tokenizer))
    head = DraftHead.build(model.get_output_embeddings(), head_bits, config.vocab_size, tokens, None)
    name = f"head-int{head_bits}" + (f"-vocab{vocab}" if vocab else "")
    draft = HeadDraft(head, config.hidden_size, config.vocab_size, name)
    draft.check(model)
    return draft


@dataclass
class DraftedRows:
    """Rows a head draft forwarded into the target's cache, waiting for the verification forward."""

    cache: object
    base: int  # the cache's length before the draft's rows
    tokens: list[int]  # the tokens forwarded (the last accepted token, then all drafts but the last)
    hidden: torch.Tensor  # [1, len(tokens), hidden]: the decoder's output for each
    exact_rows: bool  # route attention per row (exact_rows.py) for the rows the verification computes

    def undo(self) -> None:
        """Remove the draft's rows from the cache: a forward that is not their verification came first. The
        cache's tracked token ids are left alone (the rows were never tracked: :func:`_drop_rows`)."""
        if self.tokens and self.cache.get_seq_length() == self.base + len(self.tokens):
            _drop_rows(self.cache, len(self.tokens))

    def verify(self, forward, kwargs: dict, config):
        """The decoder's output for a verification forward of ``kwargs``: the draft's rows for the tokens it
        forwarded and the decoder's own row for the last candidate. A forward of other tokens, or one asking
        for per-layer outputs, gets the draft's rows removed and runs as it would."""
        input_ids = kwargs.get("input_ids")
        ids = input_ids[0].tolist() if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else None
        n = len(self.tokens)
        if (ids is None or input_ids.shape[0] != 1 or ids[:n] != self.tokens or len(ids) > n + 1
                or kwargs.get("past_key_values") is not self.cache or kwargs.get("inputs_embeds") is not None
                or self.cache.get_seq_length() != self.base + n or wants_layer_outputs(kwargs, config)):
            self.undo()
            return forward(**kwargs)
        if len(ids) == n:  # the draft stopped at a token a limit refused: every candidate's row is here
            return BaseModelOutputWithPast(last_hidden_state=self.hidden, past_key_values=self.cache)
        rest = dict(kwargs, input_ids=input_ids[:, n:])
        for key in _ROW_ARGUMENTS:
            value = rest.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == len(ids):
                rest[key] = value[..., n:]
        with _routed(1 if self.exact_rows else None):
            out = forward(**rest)
        out.last_hidden_state = torch.cat([self.hidden.to(out.last_hidden_state.dtype), out.last_hidden_state], dim=1)
        return out


def wants_layer_outputs(kwargs: dict, config) -> bool:
    """Whether a forward returns per-layer hidden states or attentions (a head draft's rows carry neither)."""
    return any(kwargs.get(name) if kwargs.get(name) is not None else getattr(config, name, False)
               for name in ("output_hidden_states", "output_attentions"))


def _drop_rows(cache, count: int) -> None:
    """Remove the last ``count`` rows of ``cache`` without untracking token ids (a ChunkReuseCache tracks the
    tokens of its forwards: a head draft's rows are tracked only by the verification that takes them)."""
    drop = getattr(cache, "drop_rows", None)
    if drop is not None:
        drop(count)
    else:
        cache.crop(-count)


class HeadProposer:
    """Drafts ``k`` tokens by forwarding the target's own decoder one token at a time (see the module doc)."""

    takes_prompt_from_target = True  # round 0 is the prompt's prefill: nothing to draft from yet
    fused_rounds = True  # a plain round as one op call (_fused_round); False: always token by token

    def __init__(self, model: nn.Module, draft: HeadDraft, eos: list[int], exact_rows: bool, limits=None) -> None:
        self.model, self.draft, self.eos, self.exact_rows = model, draft, set(eos), exact_rows
        self.limits = limits if limits else None  # DraftLimits: asked before each drafted token is forwarded
        self.name = draft.draft_name
        self.decoder = model.get_decoder()
        self.model_kwargs: dict | None = None  # generate's, given by the candidate generator each round

    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, k: int) -> tuple[torch.LongTensor, None]:
        kwargs = self.model_kwargs or {}
        cache = kwargs.get("past_key_values")
        if (cache is None or input_ids.shape[0] != 1 or cache.get_seq_length() != input_ids.shape[1] - 1
                or wants_layer_outputs(kwargs, self.decoder.config)):
            return input_ids, None
        base, ids, tokens, rows, drafted = cache.get_seq_length(), input_ids, [], [], []
        # plan_held: the decoder's layers are checked once a round, not once a drafted token
        with _routed(1 if self.exact_rows else None), _dropped_on_error(cache, tokens), plan_held(self.decoder):
            fused = self._fused_round(ids, kwargs, k)
            if fused is not None:  # the whole round in one op call, or the loop below token by token
                tokens.extend([int(ids[0, -1]), *fused.tokens[:-1]])
                rows.append(fused.hidden)
                drafted = fused.tokens
                ids = torch.cat([ids, ids.new_tensor([drafted])], dim=1)
                k = 0
            for _ in range(k):
                hidden = self._decode_step(ids, kwargs)
                tokens.append(int(ids[0, -1]))
                rows.append(hidden)
                token = self.draft.next_token(hidden)
                # Asked before the token is forwarded: a candidate cut after drafting would leave rows to crop.
                if self.limits is not None and self.limits.allowed(input_ids, ids.new_tensor(drafted + [token])) \
                        <= len(drafted):
                    break
                drafted.append(token)
                ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
                if token in self.eos:
                    break
        if tokens:
            _set_drafted(self.decoder, DraftedRows(cache, base, tokens, torch.cat(rows, dim=1), self.exact_rows))
        return ids, None

    def _fused_round(self, ids: torch.LongTensor, kwargs: dict, k: int) -> DraftRound | None:
        """The round as one op call (:func:`~kvboost_hf.kernels.draft_round.draft_round`: the same tokens and rows
        as the loop's forwards), where nothing runs between the loop's forwards but the decoder and the head: no
        limits to ask, an int8 head without bias, and the decoder called as it is (its own verification wrapper
        only, no rows of an earlier round pending). None: the loop drafts."""
        linear = self.draft.head.linear
        if (not self.fused_rounds or self.limits is not None or type(linear) is not BlockedInt8Linear
                or linear.bias is not None or _local.__dict__.get("drafted", {}).get(id(self.decoder)) is not None
                or ("forward" in self.decoder.__dict__ and not installed_alone(self.decoder))):
            return None
        tokens = self.draft.head.tokens
        return draft_round(self.decoder, self._step_inputs(ids, kwargs), k, linear.blocks,
                           None if tokens is None else tokens.to(torch.long), self.eos)

    def _decode_step(self, ids: torch.LongTensor, kwargs: dict) -> torch.Tensor:
        """The decoder's output row for ``ids``' last token, computed as generate's decode step computes it."""
        return self.decoder(**self._step_inputs(ids, kwargs)).last_hidden_state[:, -1:]

    def _step_inputs(self, ids: torch.LongTensor, kwargs: dict) -> dict:
        """The decoder's arguments for a forward of ``ids``' last token, as generate's decode step makes them."""
        step = dict(kwargs)
        length = ids.shape[1]
        mask = step.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] < length:
            step["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], length - mask.shape[1]))], dim=-1)
        positions = step.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.shape[-1] < length:
            more = torch.arange(1, length - positions.shape[-1] + 1, dtype=positions.dtype, device=positions.device)
            step["position_ids"] = torch.cat([positions, positions[..., -1:] + more], dim=-1)
        inputs = self.model.prepare_inputs_for_generation(ids, next_sequence_length=1, is_first_iteration=False, **step)
        for key in _HEAD_ARGUMENTS:
            inputs.pop(key, None)
        return inputs

    def update(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        _set_drafted(self.decoder, None)  # consumed by the verification (or stale)

    def finish(self, sequence: torch.LongTensor) -> None:
        return None

    def unseen(self, input_ids: torch.LongTensor) -> int:
        return 0  # the rows it forwards are the target's own: none is extra work


_local = threading.local()  # .drafted: {id(decoder): DraftedRows} of this thread


def _set_drafted(decoder: nn.Module, rows: DraftedRows | None) -> None:
    drafted = _local.__dict__.setdefault("drafted", {})
    if rows is None:
        drafted.pop(id(decoder), None)
    else:
        drafted[id(decoder)] = rows


@contextlib.contextmanager
def head_verification(model: nn.Module) -> Iterator[None]:
    """While inside, ``model``'s decoder answers a verification forward that follows a head draft's rows
    on this thread with those rows (:meth:`DraftedRows.verify`); any other forward runs as it would.
    Re-entrant and thread-safe: installed by the first entry, removed by the last exit."""
    decoder = model.get_decoder()

    def verifying_forward(module: nn.Module, original):
        names = _positional_names(original)

        def forward(*args, **kwargs):
            rows = _local.__dict__.get("drafted", {}).pop(id(module), None)
            if rows is None:
                return original(*args, **kwargs)
            if len(args) > len(names):  # not bindable by name: the rows leave, the forward runs as called
                rows.undo()
                return original(*args, **kwargs)
            return rows.verify(original, {**dict(zip(names, args)), **kwargs}, module.config)

        return forward

    with forward_installed(decoder, verifying_forward):
        try:
            yield
        finally:
            stale = _local.__dict__.get("drafted", {}).pop(id(decoder), None)
            if stale is not None:
                stale.undo()


def _positional_names(forward) -> list[str]:
    """The names of ``forward``'s positional parameters (some CausalLMs pass ``input_ids`` positionally)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(forward).parameters.values() if p.kind in kinds]


@contextlib.contextmanager
def _routed(rows: int | None) -> Iterator[None]:
    """Attention routed for forwards of ``rows`` rows (exact_rows.py) while inside, then as it was; None: left
    as it is."""
    if rows is None:
        yield
        return
    previous = attention.attention_route()
    route_rows(rows)
    try:
        yield
    finally:
        attention.set_attention_route(previous)


@contextlib.contextmanager
def _dropped_on_error(cache, tokens: list) -> Iterator[None]:
    """The rows forwarded so far (one per entry of ``tokens``) leave ``cache`` if drafting raises."""
    try:
        yield
    except BaseException:
        if tokens:
            _drop_rows(cache, len(tokens))
        raise
