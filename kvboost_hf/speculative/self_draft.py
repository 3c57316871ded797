"""``make_draft``: a self-draft built from the target's own weights (no small sibling model needed).

The draft is a structural clone of the target (same class, own module objects, shared
embedding) whose decoder linears are weight-only int4 or int8 and whose RMSNorms are fused
(:mod:`kvboost_hf.models.fused_norm`), computing in bf16 where the CPU does so natively, optionally
keeping only the first ``layers`` decoder layers, with an LM head optionally restricted to the
``vocab`` most frequent tokens (FR-Spec). A restricted head still returns full-vocabulary
logits, ``-inf`` outside its set, so HF's speculative sampling stays exact.

A streamed AWQ target (:mod:`kvboost_hf.streaming`) gives a resident int4 draft holding the
checkpoint's own int4 weights (``bits=4`` only); its streamed layers are read from the
streamer's host source once. Every int4 draft linear also keeps its codes for a dense bf16 path
on many-row calls (the draft's prompt prefill and catch-up; see :class:`Int4DraftLinear`).
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict

import torch
from torch import nn

from kvboost_hf.cache.buffer import in_place_layer
from kvboost_hf.generation.model_class import ReuseGenerateMixin
from kvboost_hf.kernels.attention import cpu_attention
from kvboost_hf.kernels.decoder import fuse_decoder
from kvboost_hf.kernels.layer import ARGUMENTS_ATTR, fuse_layers
from kvboost_hf.kernels.norm import cpu_norm
from kvboost_hf.models.attention import own_attention
from kvboost_hf.models.fused_norm import FusedRMSNorm, fuse_norms
from kvboost_hf.models.huge_pages import back_with_huge_pages
from kvboost_hf.reuse import STATE_ATTR
from kvboost_hf.speculative.head import DraftHead
from kvboost_hf.speculative.quantized import Int4DraftLinear, quantized_linear
from kvboost_hf.speculative.shared_prompt import record_source
from kvboost_hf.speculative.vocab import draft_vocabulary, special_token_ids, token_ranking
from kvboost_hf.streaming.fused import fuse_projections
from kvboost_hf.streaming.linear import AWQInt4Linear
from kvboost_hf.streaming.loader import RUNTIME_ATTR

logger = logging.getLogger(__name__)

_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_DROPPED = (STATE_ATTR, RUNTIME_ATTR, ARGUMENTS_ATTR)


@torch.no_grad()
def make_draft(model: nn.Module, bits: int = 4, vocab: int | None = None, layers: int | None = None, *,
               tokenizer=None, texts=None, head_bits: int = 8,
               activations: torch.dtype | str = "auto") -> nn.Module:
    """A self-draft of ``model`` for ``model.generate(..., draft=...)`` / ``assistant_model=``.

    ``bits`` (4 or 8): weight-only precision of the decoder linears. ``head_bits`` (8 or 4): that of
    the LM head (int8 by default: on Gemma-3-270M an int4 round-to-nearest head picks the float
    head's top token 81% of the time on essay text, int8 97%).
    ``vocab``: keep the ``vocab`` most frequent tokens in the LM head (needs ``tokenizer``; counted
    on ``texts`` or the offline essays, cached). ``layers``: keep the first ``layers`` decoder layers.
    ``activations``: the dtype the draft computes in (hidden states, K/V, attention). ``"auto"``:
    bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else the model's dtype.
    The target is not modified; the embedding is shared, not copied.
    """
    if bits not in (4, 8):
        raise ValueError(f"make_draft(bits=...) must be 4 or 8, got {bits!r}")
    if head_bits not in (4, 8):
        raise ValueError(f"make_draft(head_bits=...) must be 4 or 8, got {head_bits!r}")
    config = model.config.get_text_config(decoder=True)
    if layers is not None and not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"make_draft(layers=...) must be in 1..{config.num_hidden_layers}, got {layers!r}")
    if vocab is not None and tokenizer is None:
        raise ValueError("make_draft(vocab=N) needs tokenizer= (token frequencies are counted with it)")
    if vocab is not None and not 1 <= vocab <= config.vocab_size:
        raise ValueError(f"make_draft(vocab=...) must be in 1..{config.vocab_size}, got {vocab!r}")
    compute_dtype = activation_dtype(activations, model)
    runtime = getattr(model, RUNTIME_ATTR, None)
    if runtime is not None and bits != 4:
        raise ValueError("an AWQ model's self-draft uses its own int4 weights: make_draft(bits=4)")
    draft = clone_structure(model)
    inner, decoder = _decoder_layers(draft)
    if layers is not None:
        del decoder[layers:]
        draft.config.num_hidden_layers = layers
        if getattr(draft.config, "layer_types", None) is not None:
            draft.config.layer_types = draft.config.layer_types[:layers]
    for name, module in list(decoder.named_modules()):
        if isinstance(module, nn.Linear):
            _replace(decoder, name, quantized_linear(module.weight, module.bias, bits))
        elif isinstance(module, AWQInt4Linear):
            _replace(decoder, name, _resident_copy(module, runtime, f"{_layers_name(model)}.{name}"))
    fuse_projections(decoder)  # q/k/v and gate/up in one kernel call each (kvboost_hf's int4 kernel)
    tokens = None
    if vocab is not None:
        ranking = token_ranking(tokenizer, config.vocab_size, texts)
        tokens = draft_vocabulary(ranking, vocab, special_token_ids(model, tokenizer))
    draft.lm_head = DraftHead.build(model.get_output_embeddings(), head_bits, config.vocab_size, tokens,
                                    getattr(config, "final_logit_softcapping", None))
    if getattr(draft.config, "final_logit_softcapping", None) is not None:
        draft.config.final_logit_softcapping = None  # applied inside DraftHead, before the -inf fill
    draft.config.tie_word_embeddings = False
    compute_in(draft, compute_dtype)
    on_cpu = _device_of(model).type == "cpu"
    fuse_norms(draft, compute_dtype, cpu_norm() if on_cpu else FusedRMSNorm)
    owned = cpu_attention(compute_dtype) if on_cpu else None
    if owned is not None:  # a draft's numerics are ours: the kernel's attention, or float32 SDPA
        own_attention(draft, owned)
    if on_cpu and bits == 4:
        fuse_layers(draft)  # int4 layers on kvboost_hf's kernel: two op calls a layer, the same bits
        fuse_decoder(draft, fresh_layer=in_place_layer)  # a plain generate on the draft appends in place too
    draft.draft_name = (f"int{bits}" + (f"-vocab{vocab}" if vocab else "") + (f"-layers{layers}" if layers else "")
                        + ("-bf16" if compute_dtype == torch.bfloat16 else ""))
    draft.eval()
    if on_cpu:  # the draft's own weights (its head, int4 copies); those it shares with the target stay as they are
        back_with_huge_pages(draft, exclude=model)
    record_source(draft, model)  # its first round starts from the target's prompt K/V (shared_prompt.py)
    return draft


def activation_dtype(requested: torch.dtype | str, model: nn.Module) -> torch.dtype:
    """The dtype a draft of ``model`` computes in, for ``make_draft(activations=requested)``."""
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if requested == "auto":
        return torch.bfloat16 if native_bf16(_device_of(model)) else model_dtype
    if requested in (torch.float32, torch.bfloat16):
        return requested
    raise ValueError(f"make_draft(activations=...) must be 'auto', torch.float32 or torch.bfloat16, got {requested!r}")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively: a CPU with AVX512-BF16 or AMX, or a CUDA GPU that
    supports it. Elsewhere bf16 elementwise work is emulated and slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    capabilities = torch.cpu.get_capabilities() if device.type == "cpu" else {}
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def _device_of(model: nn.Module) -> torch.device:
    return next((t.device for t in model.parameters()), torch.device("cpu"))


def compute_in(draft: nn.Module, dtype: torch.dtype) -> None:
    """Make ``draft`` compute in ``dtype``: its other floating parameters (norms, biases) get their own
    copies in ``dtype``, and the shared embedding's output is cast. Buffers (rotary frequencies) keep
    their dtype. The quantized linears already take bf16 and return their input's dtype."""
    # Always recorded, even when nothing is converted: the config is what keeps a float32 and a bf16
    # draft of one model in different store namespaces (their weights may hash the same).
    draft.config.dtype = dtype
    embedding = draft.get_input_embeddings()
    if embedding.weight.dtype == dtype:
        return
    for module in draft.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype or param is embedding.weight:
                continue
            module._parameters[name] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
    embedding.register_forward_hook(lambda _module, _args, output: output.to(dtype))


def clone_structure(model: nn.Module) -> nn.Module:
    """New module objects sharing every parameter and buffer of ``model``, without hooks, reuse state or
    streaming runtime; the config and generation config are copied (the clone may change them)."""
    old_config = getattr(model, "config", None)
    new_config = copy.deepcopy(old_config)
    return _clone(model, {id(old_config): new_config} if old_config is not None else {})


def _clone(module: nn.Module, configs: dict) -> nn.Module:
    cls = type(module)
    if issubclass(cls, ReuseGenerateMixin):
        cls = cls._kvboost_base
    new = cls.__new__(cls)
    state = {k: v for k, v in module.__dict__.items() if k not in _DROPPED}
    for key in _HOOKS:
        if key in state:
            state[key] = OrderedDict()
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    if isinstance(module, AWQInt4Linear):
        state["group"] = None  # a fused group computes with the original's members; the clone may fuse anew
    state["_modules"] = {name: None if child is None else _clone(child, configs)
                         for name, child in module._modules.items()}
    for key, value in state.items():
        if id(value) in configs:
            state[key] = configs[id(value)]
    if "generation_config" in state:
        state["generation_config"] = copy.deepcopy(state["generation_config"])
    new.__dict__.update(state)
    return new


def _decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"make_draft expects a decoder-only CausalLM with .model.layers, got {type(model).__name__}")
    return base, layers


def _replace(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _layers_name(model: nn.Module) -> str:
    """The target's module name of its decoder ModuleList (e.g. ``model.layers``)."""
    layers = _decoder_layers(model)[1]
    return next(full for full, module in model.named_modules() if module is layers)


def _resident_copy(module: AWQInt4Linear, runtime, name: str) -> Int4DraftLinear:
    """A resident :class:`Int4DraftLinear` with ``module``'s packed weight (a streamed one read from the
    streamer's host source) and, for many-row calls, its codes read again from the checkpoint."""
    packed = module.int4_weight
    if module.streamed:
        source = getattr(runtime, "source", None)
        if source is None or name not in source:
            raise ValueError(f"streamed weight of {name} not found in the model's host source")
        # the host copy (pinned RAM on CUDA) goes to the device the model computes on, in its own memory
        packed = source.tensor(name).to(module.int4_scales_zeros.device, copy=True)
    copy_ = Int4DraftLinear(module.in_features, module.out_features, module.group_size, bias=module.bias is not None,
                            kernel=module.kernel)
    copy_.set_weight(packed, module.int4_scales_zeros)
    codes = runtime.codes(name) if runtime is not None and not module.kernel.amortises_rows else None
    if codes is not None:
        copy_.set_codes(codes.to(packed.device))
    if module.bias is not None:
        copy_.bias = module.bias
    return copy_
