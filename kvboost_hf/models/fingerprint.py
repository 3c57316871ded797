"""Model fingerprints: the namespace key of a transformers model's K/V, and a cheap token that moves with it.

The namespace covers everything that changes K/V besides the tokens: config (RoPE settings
included), every weight byte, dtype, device type, active peft adapters and their scales, the
attention family.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import xxhash

from kvboost_hf.models.attention import owned_attention
from kvboost_hf.store.keys import Key, namespace_key

# Elements per tensor that model_state_token samples on every request (the fingerprint itself
# reads every byte, once per model state).
_SAMPLES_PER_TENSOR = 16
# Device tensors are copied to the CPU for hashing in blocks of this many bytes.
_DEVICE_BLOCK_BYTES = 64 << 20


# Config fields that do not change K/V: where the weights came from (what they are is covered by
# the weights fingerprint) and run-time switches (Trainer sets use_cache=False, for example).
_VOLATILE_CONFIG = (
    "_name_or_path", "_model_name_or_path", "transformers_version", "_commit_hash",
    "use_cache", "output_hidden_states", "output_attentions", "return_dict",
)


def _config_description(model: torch.nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    if config is None:
        return {}
    description = config.to_dict()
    for volatile in _VOLATILE_CONFIG:
        description.pop(volatile, None)
    return description


def config_digest(model: torch.nn.Module) -> bytes:
    """A short hash of the config fields that can change K/V (about 0.1 ms)."""
    return xxhash.xxh3_64_digest(json.dumps(_config_description(model), sort_keys=True, default=str).encode())


class UnfingerprintableModel(ValueError):
    """The model's weights cannot be read to fingerprint them (e.g. parameters on the meta device)."""


def state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` (tied tensors once): all that can change K/V."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def _tensor_bytes(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The raw bytes of ``tensor`` in blocks (device tensors are copied to the CPU block by block)."""
    if tensor.device.type == "meta":
        raise UnfingerprintableModel("a parameter or buffer is on the meta device (offloaded or not loaded)")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return
    if flat.device.type == "cpu":
        yield memoryview(flat.contiguous().view(torch.uint8).numpy())
        return
    block = max(1, _DEVICE_BLOCK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), block):
        yield memoryview(flat[start : start + block].contiguous().view(torch.uint8).cpu().numpy())


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A 128-bit hash of every byte of every parameter and buffer, with names, shapes and dtypes.

    xxh3 reads about 16 GB/s on one core here (Gemma-3-270M, 1.07 GB in fp32: ~70 ms once the
    weights are in memory); it is a non-cryptographic hash, so it separates models, it does not
    authenticate them. Raises :class:`UnfingerprintableModel` when a tensor cannot be read.
    """
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, tensor in state_tensors(model):
            h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            for block in _tensor_bytes(tensor):
                h.update(block)
    return h.hexdigest()


def tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The peft tuner layers (LoRA and the like) inside ``model``; empty without peft."""
    return [m for m in model.modules() if hasattr(m, "active_adapters") and hasattr(m, "disable_adapters")]


def active_adapters(model: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> list[str]:
    """Names of the peft adapters that take part in the forward pass (empty without peft)."""
    names: set[str] = set()
    for module in tuner_layers(model) if layers is None else layers:
        if module.disable_adapters or getattr(module, "merged", False):
            # Disabled adapters do not act; merged ones live in the base weights already.
            continue
        adapters = module.active_adapters
        names.update([adapters] if isinstance(adapters, str) else adapters)
    return sorted(names)


def adapter_scales(model: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> str:
    """A digest of every active peft adapter's scaling per layer (``rescale_adapter_scale``, ``set_scale``
    change it without touching any weight); empty without peft."""
    parts = []
    for module in tuner_layers(model) if layers is None else layers:
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and not module.disable_adapters:
            parts.append(repr(sorted((str(k), float(v)) for k, v in scaling.items() if not isinstance(v, torch.Tensor))))
    return xxhash.xxh3_64_hexdigest("|".join(parts).encode()) if parts else ""


def _sampled_values(tensors: list[torch.Tensor]) -> bytes:
    """A strided sample of every tensor's values: catches most edits that bypass version counters.

    One strided view per tensor (no copies), concatenated per device and dtype: about 0.5 ms for
    Gemma-3-270M's 241 tensors.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        n = tensor.numel()
        if n == 0 or tensor.device.type == "meta":
            continue
        step = max(1, n // _SAMPLES_PER_TENSOR)
        if tensor.dim() > 1 and step > 1 and step % tensor.shape[-1] == 0:
            step -= 1  # a multiple of the row length would sample one column only (still _SAMPLES_PER_TENSOR of them)
        count = min(_SAMPLES_PER_TENSOR, (n + step - 1) // step)
        if tensor.is_contiguous():
            sample = tensor.detach().as_strided((count,), (step,), tensor.storage_offset())
        else:  # the same elements, without copying the tensor (fused projections' per-group views)
            sample = torch.take(tensor.detach(), torch.arange(count, device=tensor.device) * step)
        groups.setdefault((tensor.device, tensor.dtype), []).append(sample)
    # One copy to the CPU per device and dtype, not one per tensor (each would synchronise a GPU).
    return b"".join(torch.cat(parts).cpu().view(torch.uint8).numpy().tobytes() for parts in groups.values())


_tuners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_state_token(model: torch.nn.Module) -> tuple:
    """A cheap token (about 1.5 ms on Gemma-3-270M) that changes when the model's K/V may have changed.

    Covered: every in-place write to a parameter or buffer (``_version`` counters: optimizer
    steps, ``load_state_dict``, ``copy_``, adapter merges), tensors replaced or moved (storage
    pointers, dtype, device), adapters switched or rescaled, the attention implementation or a
    config field that changes K/V (RoPE settings, for instance) changed. Edits made
    through ``.data`` (or numpy views) bypass the version counter: they are caught only when they
    touch one of the strided samples; :func:`kvboost_hf.refresh_namespace` covers the rest.
    """
    tensors = [t for _, t in state_tensors(model)]
    layout = tuple((t.data_ptr(), t.dtype, t.device) for t in tensors)
    memo = _tuners.get(model)
    if memo is None or memo[0] != layout:  # adapters and swapped modules bring tensors: the layout changes
        memo = (layout, tuner_layers(model), numeric_modules(model))
        _tuners[model] = memo
    layers = memo[1]
    return (
        layout,
        # Inference tensors (made under torch.inference_mode) have no version counter: pointer and samples only.
        tuple(-1 if t.is_inference() else t._version for t in tensors),
        xxhash.xxh3_64_digest(_sampled_values(tensors)),
        tuple(active_adapters(model, layers)),
        adapter_scales(model, layers),
        _attention_family(model),  # kvboost_sdpa (switched on for some requests) computes SDPA's K/V
        module_numerics(model, memo[2]),  # evaluated each time: a kernel's numerics follow the ISA path in effect
        config_digest(model),
    )


def numeric_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` whose class declares ``kvboost_numerics`` (see :func:`module_numerics`)."""
    return [m for m in model.modules() if hasattr(type(m), "kvboost_numerics")]


def module_numerics(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> tuple[str, ...]:
    """The ``kvboost_numerics`` names of the modules kvboost_hf put in ``model`` that compute their own bits
    (``FusedRMSNorm`` and its kernel subclass; an int4 linear on kvboost_hf's kernel, whose name follows the
    ISA path in effect), sorted; empty for a stock model. ``modules``: :func:`numeric_modules`, if known."""
    modules = numeric_modules(model) if modules is None else modules
    return tuple(sorted({name for m in modules if (name := m.kvboost_numerics)}))


def _attention_family(model: torch.nn.Module) -> str | None:
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    # kvboost's registered SDPA (same kernel, position-aware masks) computes the same K/V as SDPA,
    # unless the model computes attention its own way (models.attention.own_attention).
    if name == "kvboost_sdpa":
        owned = owned_attention(model)
        return "sdpa" if owned is None else owned.name
    return name


def model_namespace(model: torch.nn.Module, extra: dict[str, Any] | None = None) -> Key:
    """Namespace key for a model: config (incl. RoPE settings), every weight byte, dtype, device type, adapters.

    Reads every parameter and buffer (see :func:`weights_fingerprint`): memoise it per model state
    (:func:`model_state_token`) rather than calling it per request.
    """
    first = next(model.parameters(), None)
    parts: dict[str, Any] = {
        "config": _config_description(model),
        "weights": weights_fingerprint(model),
        "dtype": str(first.dtype) if first is not None else None,
        "device_type": first.device.type if first is not None else None,
        "adapters": active_adapters(model),
        "adapter_scales": adapter_scales(model),
        "attn_implementation": _attention_family(model),
    }
    numerics = module_numerics(model)
    if numerics:  # only then: a stock model's namespace stays what it always was
        parts["module_numerics"] = list(numerics)
    if extra:
        parts["extra"] = extra
    return namespace_key(parts)
