"""``kvboost-hf awq-pack MODEL OUT``: write an AutoAWQ GEMM checkpoint from a float HF model.

Every ``nn.Linear`` inside the decoder layers is quantized to int4 (group size ``G``, zero
point by default); embeddings, norms and the LM head stay float (AutoAWQ's convention) and are
written in ``--dtype`` (fp16 by default, like AutoAWQ). Without calibration text the weights are
rounded to nearest; with ``--calibration-file`` AWQ's activation-aware input-channel scales are
searched per layer (q/k/v after the input norm, gate/up after the MLP norm, down after up) and
folded into the preceding norm or ``up_proj``. Activations come from the float model (not layer
by layer from the already-quantized one); there is no clipping search.

Round-to-nearest needs no tokenizer: a checkpoint of weights and config only is packed as it is
(the model's tokenizer, when it has one, is written with the checkpoint). Calibration text needs
one: ``--tokenizer`` names it when the model directory holds none.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from kvboost_hf.cli_checks import FlagError, first_line, model_path_flag
from kvboost_hf.streaming.awq_format import pack_awq
from kvboost_hf.streaming.loader import decoder_layers
from kvboost_hf.streaming.quantize import rtn_quantize, search_scales

logger = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Any of these in a model directory means it ships a tokenizer (fast, sentencepiece, BPE or WordPiece files).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                    "vocab.txt", "tekken.json")
# (linears sharing one input, the norm before them); "mlp norm" is resolved per architecture.
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")


def _collect_inputs(model: nn.Module, prefix: str, n_layers: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs ``[T, K]`` of q_proj, gate_proj and down_proj of every layer for calibration ``ids``."""
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i in range(n_layers):
        for suffix in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
            name = f"{prefix}.{i}.{suffix}"
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue

            def hook(mod, args, name=name):
                captured.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for row in ids:
                model(input_ids=row.unsqueeze(0), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v) for k, v in captured.items()}


def _is_gemma_norm(norm: nn.Module) -> bool:
    """Gemma's RMSNorm multiplies by ``1 + weight`` instead of ``weight``."""
    return "gemma" in type(norm).__name__.lower()


def _fold_into_norm(sd: dict, norm_name: str, norm: nn.Module, s: torch.Tensor) -> None:
    w = sd[norm_name + ".weight"]
    sd[norm_name + ".weight"] = (1.0 + w) / s - 1.0 if _is_gemma_norm(norm) else w / s


def _scale_layer(model, sd, layer_name, layer, inputs, group_size, zero_point, scale_dtype) -> dict[str, float]:
    """Search and fold activation-aware scales for one decoder layer (in ``sd``); return the alphas."""
    alphas: dict[str, float] = {}
    # Gemma 3 normalises the MLP input with pre_feedforward_layernorm; Llama-style models with post_attention_layernorm.
    mlp_norm = "pre_feedforward_layernorm"
    if not hasattr(layer, mlp_norm):
        mlp_norm = "post_attention_layernorm"
    plans = [(_ATTN, "self_attn.q_proj", "input_layernorm"), (_MLP, "mlp.gate_proj", mlp_norm),
             (("mlp.down_proj",), "mlp.down_proj", None)]
    for group, input_of, norm in plans:
        names = [f"{layer_name}.{g}" for g in group]
        x = inputs.get(f"{layer_name}.{input_of}")
        if x is None or not all(n + ".weight" in sd for n in names):
            continue
        if norm is not None and not hasattr(layer, norm):
            continue
        if norm is None and f"{layer_name}.mlp.up_proj.weight" not in sd:
            continue
        s, alpha = search_scales(x, [sd[n + ".weight"] for n in names], group_size, zero_point, scale_dtype=scale_dtype)
        for n in names:
            sd[n + ".weight"] = sd[n + ".weight"] * s
        if norm is not None:
            _fold_into_norm(sd, f"{layer_name}.{norm}", getattr(layer, norm), s)
        else:
            up = f"{layer_name}.mlp.up_proj"
            sd[up + ".weight"] = sd[up + ".weight"] / s.unsqueeze(1)
            if up + ".bias" in sd:
                sd[up + ".bias"] = sd[up + ".bias"] / s
        alphas[group[0]] = alpha
    return alphas


@torch.no_grad()
def pack_model(
    model: nn.Module,
    out_dir: str | Path,
    group_size: int = 128,
    calibration_ids: torch.Tensor | None = None,
    zero_point: bool = True,
    dtype: torch.dtype = torch.float16,
    tokenizer=None,
    progress: bool = True,
) -> dict:
    """Write ``model`` as an AutoAWQ GEMM checkpoint to ``out_dir``; return a summary dict.

    With ``progress``, tqdm bars on stderr over the layers' scale search and the linears packed.
    Raises :class:`PackError` when ``group_size`` does not divide a linear's input width."""
    out = Path(out_dir)
    prefix, layers = decoder_layers(model)
    full = model.state_dict()
    seen: dict[int, str] = {}
    sd: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():  # tied weights (embeddings / LM head) are written once
        if tensor.data_ptr() in seen and tensor.numel() > 0:
            continue
        seen[tensor.data_ptr()] = name
        sd[name] = tensor.detach().to(torch.float32).clone() if tensor.is_floating_point() else tensor.clone()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(prefix + ".")]
    for name in linears:
        in_features = model.get_submodule(name).in_features
        if in_features % group_size:
            raise PackError(f"group size {group_size} does not divide in_features {in_features} of {name}; "
                            "pick a divisor of it (32, 64 or 128 usually)")
    alphas: dict[str, dict[str, float]] = {}
    if calibration_ids is not None:
        inputs = _collect_inputs(model, prefix, len(layers), calibration_ids)
        for i, layer in enumerate(tqdm(layers, desc="AWQ scale search", unit="layer", disable=not progress)):
            alphas[str(i)] = _scale_layer(model, sd, f"{prefix}.{i}", layer, inputs, group_size, zero_point, dtype)
            logger.info("layer %d: activation-aware alphas %s", i, alphas[str(i)])
    tensors: dict[str, torch.Tensor] = {}
    for name in tqdm(linears, desc="int4 packing", unit="linear", disable=not progress):
        weight = sd.pop(name + ".weight")
        codes, zeros, scales = rtn_quantize(weight, group_size, zero_point, scale_dtype=dtype)
        tensors[name + ".qweight"] = pack_awq(codes.t().contiguous())
        if zero_point:
            tensors[name + ".qzeros"] = pack_awq(zeros.to(torch.int32))
        tensors[name + ".scales"] = scales.to(dtype).contiguous()
    for name, tensor in sd.items():
        tensors[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.quantization_config = {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": zero_point,
        "version": "gemm", "modules_to_not_convert": None,
    }
    config.dtype = dtype
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    summary = {"linears": len(linears), "group_size": group_size, "zero_point": zero_point,
               "activation_aware": calibration_ids is not None, "alphas": alphas, "path": str(out)}
    logger.info("wrote AWQ checkpoint %s (%d int4 linears)", out, len(linears))
    return summary


class PackError(ValueError):
    """``awq-pack`` cannot do what it was asked; the CLI prints the message as one line and exits 2."""


def add_awq_pack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="float HF model directory, or 'default' for the embedded Gemma-3-270M")
    parser.add_argument("out", help="output directory for the AutoAWQ GEMM checkpoint")
    parser.add_argument("--group-size", type=int, default=128,
                        help="input channels sharing one scale and zero point; must divide every linear's input width")
    parser.add_argument("--calibration-file", default=None,
                        help="text file for activation-aware scale search (without it: round-to-nearest)")
    parser.add_argument("--calibration-tokens", type=int, default=512,
                        help="tokens of --calibration-file used for the scale search")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or HF id: tokenizes --calibration-file and is written with the "
                             "checkpoint (default: MODEL's own, when it has tokenizer files)")
    parser.add_argument("--no-zero-point", action="store_true", help="symmetric quantization (zero_point false)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float16", help="dtype of scales and float weights")


def _linear_widths(source: str) -> dict[str, int]:
    """Input widths of the decoder's linears, from the config alone (empty when it does not say)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise PackError(f"{source}: cannot read its config ({first_line(err)}); pass a float model directory "
                        "with config.json, or 'default'") from err
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    widths = {"hidden_size": hidden, "intermediate_size": getattr(config, "intermediate_size", None),
              "num_attention_heads * head_dim": heads * head_dim if heads and head_dim else None}
    return {k: v for k, v in widths.items() if isinstance(v, int)}


def check_pack_args(args: argparse.Namespace, source: str) -> None:
    """Cheap checks before the tokenizer and any weights load: the model directory, --group-size,
    --calibration-tokens. Raises :class:`PackError` (one line)."""
    try:
        model_path_flag("MODEL", source)
    except FlagError as err:
        raise PackError(str(err)) from None
    if args.group_size < 2 or args.group_size % 2:
        raise PackError(f"--group-size {args.group_size}: must be a positive even number (32, 64 or 128 usually)")
    if args.calibration_tokens < 1:
        raise PackError(f"--calibration-tokens {args.calibration_tokens}: must be 1 or more")


def check_group_size(group_size: int, source: str) -> None:
    """PackError unless ``group_size`` divides the input widths the config of ``source`` gives."""
    for what, width in _linear_widths(source).items():
        if width % group_size:
            raise PackError(f"--group-size {group_size} does not divide {what} ({width}) of {source}; "
                            "pick a divisor of it (32, 64 or 128 usually)")


def _has_tokenizer_files(path: Path) -> bool:
    """False for a local directory without any tokenizer file; True otherwise (an HF id is asked later)."""
    return not path.is_dir() or any((path / name).exists() for name in _TOKENIZER_FILES)


def load_pack_tokenizer(model: str, tokenizer: str | None):
    """``(tokenizer or None, why none)`` for packing ``model``. An explicit ``tokenizer`` that does
    not load raises :class:`PackError`; the model's own is optional (a directory of weights and
    config only has none; one that does not load is reported, not raised)."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        local = Path(tokenizer).expanduser()
        if (local.is_absolute() or tokenizer.startswith(".")) and not local.exists():
            raise PackError(f"--tokenizer {tokenizer}: no such directory")
        if not _has_tokenizer_files(local):
            raise PackError(f"--tokenizer {tokenizer} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
        try:
            return AutoTokenizer.from_pretrained(tokenizer), ""
        except (OSError, ValueError, ImportError) as err:
            raise PackError(f"cannot load the tokenizer {tokenizer!r} ({first_line(err)})") from err
    if not _has_tokenizer_files(Path(model)):
        return None, f"{model} has no tokenizer files"
    try:
        return AutoTokenizer.from_pretrained(model), ""
    except (OSError, ValueError, ImportError) as err:  # missing files, or a slow tokenizer it cannot convert
        return None, f"the tokenizer of {model} does not load ({first_line(err)})"


def awq_pack_command(args: argparse.Namespace) -> str:
    """Run ``kvboost-hf awq-pack``; return the line the CLI prints. Raises :class:`PackError`, before
    loading any weights, for a missing model directory, a group size that does not divide the model's
    widths, or calibration text without a tokenizer or that cannot be read."""
    from transformers import AutoModelForCausalLM

    from kvboost_hf.models import default_model_path

    try:
        source = str(default_model_path()) if args.model == "default" else args.model
    except ImportError as err:
        raise PackError(f"{first_line(err)}; pip install 'kvboost_hf[model]'") from err
    check_pack_args(args, source)
    tokenizer, missing = load_pack_tokenizer(source, args.tokenizer)
    check_group_size(args.group_size, source)
    text = None
    if args.calibration_file:
        if tokenizer is None:
            raise PackError(f"--calibration-file needs a tokenizer and {missing}: pass --tokenizer PATH (a directory "
                            "or HF id with this model's tokenizer files), or drop --calibration-file to pack "
                            "round-to-nearest")
        try:
            text = Path(args.calibration_file).read_text(encoding="utf-8")
        except OSError as err:
            raise PackError(f"cannot read --calibration-file ({first_line(err)})") from err
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = None if text is None else tokenizer(text, return_tensors="pt")["input_ids"][:, : args.calibration_tokens]
    if tokenizer is None:
        logger.info("packing without a tokenizer (%s): none is written with the checkpoint", missing)
    summary = pack_model(model, args.out, group_size=args.group_size, calibration_ids=ids,
                         zero_point=not args.no_zero_point, dtype=_DTYPES[args.dtype], tokenizer=tokenizer)
    mode = "activation-aware" if summary["activation_aware"] else "round-to-nearest"
    note = "" if tokenizer is not None else f"; no tokenizer ({missing})"
    return f"wrote {summary['path']}: {summary['linears']} int4 linears, group size {args.group_size}, {mode}{note}"
