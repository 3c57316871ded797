"""Reading an AutoAWQ GEMM checkpoint into ``AWQInt4Linear`` modules and a layer streamer.

Before weights load: every linear with a ``qweight`` in the checkpoint becomes an
``AWQInt4Linear`` without weight buffers, so transformers' loader reads only the float tensors
(and biases). After weights load: each quantized linear is converted once to torch's int4
layout; resident ones keep it as a buffer, streamed ones hand it to the host source.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvboost_hf.cache.buffer import in_place_layer
from kvboost_hf.kernels import KernelLinear, current_isa
from kvboost_hf.kernels.decoder import fuse_decoder
from kvboost_hf.kernels.layer import fuse_layers
from kvboost_hf.kernels.attention import KernelAttention
from kvboost_hf.kernels.norm import KernelRMSNorm
from kvboost_hf.models.attention import own_attention
from kvboost_hf.models.fused_norm import fuse_norms
from kvboost_hf.models.huge_pages import back_with_huge_pages, module_tensors
from kvboost_hf.streaming.awq_format import awq_to_codes, unpack_awq
from kvboost_hf.streaming.config import StreamingAWQConfig
from kvboost_hf.streaming.fused import fuse_projections
from kvboost_hf.streaming.kernel import resolve_int4_kernel
from kvboost_hf.streaming.linear import AWQInt4Linear
from kvboost_hf.streaming.source import HostSource, MmapSource, RamSource, cache_key
from kvboost_hf.streaming.stats import StreamingStats
from kvboost_hf.streaming.streamer import LayerStreamer

logger = logging.getLogger(__name__)

RUNTIME_ATTR = "_kvboost_streaming"
UNEXPECTED_PATTERNS = (r"\.qweight$", r"\.qzeros$", r"\.scales$")
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)\.")


def checkpoint_index(checkpoint_files: list[str]) -> dict[str, str]:
    """Tensor name -> file holding it, from the safetensors headers (no data read)."""
    index: dict[str, str] = {}
    for path in checkpoint_files or []:
        if not str(path).endswith(".safetensors"):
            raise ValueError(f"AWQ layer streaming reads safetensors checkpoints; got {path}")
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                index[key] = path
    return index


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder layer list (the ModuleList with ``num_hidden_layers`` entries)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and name.endswith("layers"):
            return name, module
    raise ValueError("could not find the decoder layers (a ModuleList of num_hidden_layers entries)")


def layer_of(name: str, layers_prefix: str) -> int:
    rest = name[len(layers_prefix) + 1 :]
    match = _LAYER_RE.match(rest) or _LAYER_RE.search(rest)
    if not name.startswith(layers_prefix + ".") or match is None:
        raise ValueError(f"quantized linear {name} is not inside a decoder layer ({layers_prefix}.N)")
    return int(match.group(1))


def replace_linears(model: nn.Module, config: StreamingAWQConfig, index: dict[str, str]) -> dict[str, int]:
    """Swap the checkpoint's quantized linears for ``AWQInt4Linear``; return name -> layer index."""
    quantized = sorted(k[: -len(".qweight")] for k in index if k.endswith(".qweight"))
    if not quantized:
        raise ValueError(
            "quantization_config.quant_method is 'awq' but the checkpoint holds no '.qweight' tensors"
        )
    prefix, layers = decoder_layers(model)
    config.streamed_layers(len(layers))  # validates keep_first_k + keep_last_k
    placed: dict[str, int] = {}
    for name in quantized:
        try:
            old = model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"the checkpoint quantizes {name}, which this model does not have") from err
        if not isinstance(old, nn.Linear):
            raise ValueError(f"the checkpoint quantizes {name}, which is a {type(old).__name__}, not a Linear")
        new = AWQInt4Linear(old.in_features, old.out_features, config.group_size, bias=old.bias is not None)
        if old.bias is not None:
            new.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        placed[name] = layer_of(name, prefix)
    patterns = set(model._keys_to_ignore_on_load_unexpected or ()) | set(UNEXPECTED_PATTERNS)
    model._keys_to_ignore_on_load_unexpected = patterns
    return placed


class StreamingRuntime:
    """What a streamed model carries: its streamer, stats and a lock serialising forwards."""

    def __init__(self, streamer: LayerStreamer | None, stats: StreamingStats, source: HostSource | None,
                 index: dict[str, str] | None = None) -> None:
        self.streamer = streamer
        self.stats = stats
        self.source = source
        self.index = index or {}  # checkpoint tensor name -> file, to read a linear's codes again
        self.lock = threading.RLock()
        self._hooks: list = []

    def codes(self, name: str) -> torch.Tensor | None:
        """The int4 codes ``[out, in]`` of quantized linear ``name``, read again from the checkpoint
        (None, logged, when the file is gone or does not hold it)."""
        path = self.index.get(name + ".qweight")
        if path is None:
            logger.info("the checkpoint index holds no %s.qweight", name)
            return None
        try:
            with safe_open(path, framework="pt") as f:
                return unpack_awq(f.get_tensor(name + ".qweight")).t().contiguous()
        except (OSError, SafetensorError) as err:
            logger.info("could not read %s.qweight from the checkpoint again (%s)", name, err)
            return None

    def attach(self, model: nn.Module) -> None:
        if self.streamer is not None:
            # One forward at a time: streamed layers share staging slots (e.g. several server workers).
            self._hooks.append(model.register_forward_pre_hook(self._enter))
            self._hooks.append(model.register_forward_hook(self._exit, always_call=True))
        setattr(model, RUNTIME_ATTR, self)

    def __getstate__(self) -> dict:
        """A resident model's runtime copies (``copy.deepcopy``, ``torch.save``) with a lock of its own; a streamed
        one's does not: its streamer's thread and staging slots serve the original's layers."""
        if self.streamer is not None:
            raise TypeError("a streamed AWQ model cannot be copied or pickled (its layer streamer serves the "
                            "original's layers): load the checkpoint again with from_pretrained, or load it "
                            "with residency_mode='full_resident' to copy it")
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    def _enter(self, module, args) -> None:
        self.lock.acquire()

    def _exit(self, module, args, output) -> None:
        self.lock.release()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self.streamer is not None:
            self.streamer.close()


def _read_module(f_by_file: dict, index: dict[str, str], name: str, module: AWQInt4Linear, config, with_weight: bool):
    """``(codes [N, K] or None, per-group tensor of the module's kernel)`` of one quantized linear."""

    def get(key: str) -> torch.Tensor | None:
        path = index.get(key)
        return None if path is None else f_by_file[path].get_tensor(key)

    qweight, scales = get(name + ".qweight"), get(name + ".scales")
    qzeros = get(name + ".qzeros") if config.zero_point else None
    if scales is None:
        raise ValueError(f"the checkpoint has {name}.qweight but no {name}.scales")
    K, N = module.in_features, module.out_features
    if tuple(qweight.shape) != (K, N // 8):
        raise ValueError(f"{name}.qweight has shape {tuple(qweight.shape)}, expected {(K, N // 8)} (AutoAWQ GEMM)")
    codes, zeros, s = awq_to_codes(qweight, qzeros, scales, config.group_size)
    return codes if with_weight else None, module.kernel.side(s, zeros)


def build_runtime(model: nn.Module, config: StreamingAWQConfig, index: dict[str, str],
                  placed: dict[str, int], checkpoint_files: list[str]) -> StreamingRuntime:
    """Convert every quantized linear once and set up residency and streaming."""
    _, layers = decoder_layers(model)
    num_layers = len(layers)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    kernel = resolve_int4_kernel(config.kernel, device)
    stats = StreamingStats(residency_mode=config.residency_mode, host=config.host,
                           n_staging_slots=config.n_staging_slots, prefetch=config.prefetch)
    modules = {name: model.get_submodule(name) for name in placed}
    for module in modules.values():
        module.kernel = kernel
    is_streamed = {
        name: config.is_streamed(layer, name.split(f".{layer}.", 1)[-1], num_layers) for name, layer in placed.items()
    }
    files = {path: safe_open(path, framework="pt") for path in set(index.values())}
    streamed_names = [n for n in placed if is_streamed[n]]
    source: HostSource | None = None
    mmap_ready = False
    if streamed_names and config.host == "mmap":
        from kvboost_hf.models import cache_dir

        root = Path(config.mmap_dir) if config.mmap_dir else cache_dir() / "awq-int4pack"
        key = cache_key(checkpoint_files, {"group_size": config.group_size, "zero_point": config.zero_point,
                                           "device": device.type, "names": streamed_names,
                                           "kernel": kernel.name})
        source = MmapSource(root / key, config.throttle_bytes_per_s)
        mmap_ready = source.exists()
    elif streamed_names:
        source = RamSource(pin=device.type == "cuda", throttle_bytes_per_s=config.throttle_bytes_per_s)

    def converted():
        for name in placed:
            module = modules[name]
            streamed = is_streamed[name]
            codes, sz = _read_module(files, index, name, module, config, with_weight=not (streamed and mmap_ready))
            module.set_weight(None if streamed else kernel.pack(codes, device), sz.to(device))
            if streamed:
                if codes is not None:
                    packed = kernel.pack(codes, device)
                    yield name, packed.cpu() if device.type == "cuda" else packed
            else:
                stats.resident_int4_bytes += module.int4_weight.numel() * module.int4_weight.element_size()

    if isinstance(source, MmapSource):
        if mmap_ready:
            for _ in converted():
                pass
        else:
            source.write(converted())
        source.open()
    else:
        for name, packed in converted():
            source.add(name, packed)
    if source is not None:
        stats.streamed_int4_bytes = source.total_bytes()
    files.clear()
    streamer = None
    if streamed_names:
        by_layer: dict[int, list] = defaultdict(list)
        for name in streamed_names:
            by_layer[placed[name]].append((name, modules[name]))
        streamer = LayerStreamer(layers, dict(by_layer), source, config.n_staging_slots, config.prefetch, device, stats)
        stats.streamed_layers = len(by_layer)
    logger.info(
        "AWQ streaming: %s, %s int4 kernel, %d streamed layers, resident int4 %.1f MB, streamed int4 %.1f MB on %s, "
        "staging %.1f MB", config.residency_mode, kernel.name, stats.streamed_layers, stats.resident_int4_bytes / 1e6,
        stats.streamed_int4_bytes / 1e6, config.host, stats.staging_bytes / 1e6,
    )
    head = model.get_output_embeddings()
    if kernel.amortises_rows and KernelLinear.supports(head):  # the head's rows as independent as the rest
        model.set_output_embeddings(KernelLinear.adopt(head))
    if kernel.amortises_rows:  # this model's numerics are ours: fewer, cheaper calls per decode step
        fuse_projections(model)  # exact on this kernel: columns are computed independently
        fuse_norms(_text_stack(model), model.dtype, KernelRMSNorm)  # one op call each for HF's 6-8 small ops
        own_attention(model, KernelAttention())  # rows computed alone; bf16 SDPA is slow for a decode row
        fuse_layers(model)  # the same bits in two op calls a layer, where its modules allow
        # and a plain forward's layers in one loop of op calls, without transformers' plumbing, on a cache that
        # appends in place (a new DynamicCache's layers swapped at the prefill: no copy of the history a step)
        fuse_decoder(model, fresh_layer=in_place_layer)
    runtime = StreamingRuntime(streamer, stats, source, index)
    runtime.attach(model)
    _return_freed_memory()
    if config.huge_pages and device.type == "cpu":  # after the trim: frames are filled from what stays
        held = list(module_tensors(model)) + (source.tensors() if isinstance(source, RamSource) else [])
        stats.huge_page_bytes = back_with_huge_pages(held).bytes
    _tile_head(model, config, stats)
    return runtime


def _tile_head(model: nn.Module, config: StreamingAWQConfig, stats: StreamingStats) -> None:
    """The head's tile copy (``config.head_tiles``), made after the huge pages (which may move the weight: a
    copy made before would be remade on 4 KiB pages at the first forward) and backed by them too."""
    head = model.get_output_embeddings()
    if not isinstance(head, KernelLinear):
        return
    wanted = current_isa() == "amx_bf16" if config.head_tiles is None else config.head_tiles
    if not wanted or not head.use_tiles():
        return
    if current_isa() != "amx_bf16":
        logger.warning("head_tiles=True: the head's tile copy is read only on the amx_bf16 kernel path, and this "
                       "process runs %s", current_isa())
    stats.head_tile_bytes = head.tiles.numel() * head.tiles.element_size()
    if config.huge_pages:
        stats.huge_page_bytes += back_with_huge_pages([head.tiles]).bytes


def _text_stack(model: nn.Module) -> nn.Module:
    """The decoder stack (its layers and final norm), not a vision tower's; the model if it names none."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, nn.Module) else model


def _return_freed_memory() -> None:
    """Hand conversion temporaries back to the OS (glibc keeps freed heap memory otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
