"""``StreamingAWQConfig``: how an AutoAWQ GEMM checkpoint is loaded and which layers stream.

The checkpoint's own ``quantization_config`` (``quant_method: "awq"``) supplies ``bits``,
``group_size``, ``zero_point`` and ``version``; the fields a user sets here are loading
attributes: residency, staging slots, host and prefetch.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

logger = logging.getLogger(__name__)

QUANT_METHOD = "kvboost_awq_streaming"
RESIDENCY_MODES = ("full_resident", "partial_resident", "ffn_only_stream", "full_stream")
HOSTS = ("ram", "mmap")
KERNEL_CHOICES = ("auto", "kvboost", "torch")
# Fields the checkpoint decides; everything else is a loading attribute chosen by the user.
CHECKPOINT_FIELDS = ("bits", "group_size", "zero_point", "version", "modules_to_not_convert")
SETTINGS = ("residency_mode", "keep_first_k", "keep_last_k", "n_staging_slots", "host", "prefetch", "mmap_dir",
            "throttle_bytes_per_s", *CHECKPOINT_FIELDS, "kernel", "huge_pages", "head_tiles")


class StreamingAWQConfig(QuantizationConfigMixin):
    """Load an AutoAWQ GEMM (int4) checkpoint, streaming layer weights.

    - ``residency_mode``: ``full_resident`` (every layer in memory), ``partial_resident``
      (the first ``keep_first_k`` and last ``keep_last_k`` decoder layers resident, the others
      streamed), ``ffn_only_stream`` (attention projections resident everywhere; MLP weights of
      the layers outside the kept ones streamed), ``full_stream`` (every decoder layer streamed;
      ``keep_first_k`` / ``keep_last_k`` are not used).
    - ``n_staging_slots``: at most this many streamed layers are materialised at once (on CUDA,
      device buffers; on a CPU, which computes on the host tensors in place, layers prefetched).
    - ``host``: where streamed packed weights live: ``"ram"`` (host memory, pinned on CUDA) or
      ``"mmap"`` (a converted int4 file mapped from disk; its pages are file-backed, not anonymous).
    - ``prefetch``: load the next streamed layers on a background thread while the current one
      computes (``False`` loads each streamed layer when it is needed).
    - ``mmap_dir``: where ``host="mmap"`` keeps converted files (default: the kvboost_hf cache).
    - ``throttle_bytes_per_s``: benchmarks only: slow the host source down to this bandwidth.
    - ``kernel``: the int4 GEMM: ``"kvboost"`` (this package's CPU kernels, :mod:`kvboost_hf.kernels`:
      each weight decoded once per call, rows bit-independent), ``"torch"`` (torch's packed int4 op),
      or ``"auto"`` (kvboost on CPU when its kernels are built, else torch).
    - ``huge_pages``: on a CPU, back the weights held in RAM (resident layers, the head and embedding,
      ``host="ram"`` streamed layers) with transparent huge pages after loading
      (:func:`kvboost_hf.models.huge_pages.back_with_huge_pages`: in place, values unchanged; a decode step
      streams them faster). ``False`` leaves them as loaded.
    - ``head_tiles``: keep a copy of the bf16 output head in AMX's tile layout
      (:meth:`kvboost_hf.kernels.KernelLinear.use_tiles`: the head's size again in memory, tied or not;
      335 MB for Gemma-3-270M's 262k x 640 head), which the ``amx_bf16`` kernel path reads instead of the
      weight: a verification's or a batch's rows then cost about what one row costs (9 rows: ~1.5x ->
      ~1.05x). ``None`` (default): where the kernels run the ``amx_bf16`` path; ``False``: never.
    """

    def __init__(
        self,
        residency_mode: str = "partial_resident",
        keep_first_k: int = 2,
        keep_last_k: int = 2,
        n_staging_slots: int = 2,
        host: str = "ram",
        prefetch: bool = True,
        mmap_dir: str | None = None,
        throttle_bytes_per_s: float | None = None,
        bits: int = 4,
        group_size: int = 128,
        zero_point: bool = True,
        version: str = "gemm",
        modules_to_not_convert: list[str] | None = None,
        kernel: str = "auto",
        huge_pages: bool = True,
        head_tiles: bool | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_unknown(kwargs)
        self.quant_method = QUANT_METHOD
        self.residency_mode = residency_mode
        self.keep_first_k = keep_first_k
        self.keep_last_k = keep_last_k
        self.n_staging_slots = n_staging_slots
        self.host = host
        self.prefetch = prefetch
        self.mmap_dir = mmap_dir
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.bits = bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.version = version
        self.modules_to_not_convert = modules_to_not_convert
        self.kernel = kernel
        self.huge_pages = huge_pages
        self.head_tiles = head_tiles
        self.post_init()

    def post_init(self) -> None:
        """Check every setting; each error is a ValueError naming the setting."""
        if self.residency_mode not in RESIDENCY_MODES:
            raise ValueError(f"residency_mode must be one of {', '.join(RESIDENCY_MODES)}, got {self.residency_mode!r}")
        if self.host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)}, got {self.host!r}")
        for name in ("keep_first_k", "keep_last_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        slots = self.n_staging_slots
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"n_staging_slots must be an int >= 1, got {self.n_staging_slots!r}")
        if self.kernel not in KERNEL_CHOICES:
            raise ValueError(f"kernel must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernel!r}")
        if not isinstance(self.huge_pages, bool):
            raise ValueError(f"huge_pages must be True or False, got {self.huge_pages!r}")
        if self.head_tiles not in (None, True, False):
            raise ValueError(f"head_tiles must be None, True or False, got {self.head_tiles!r}")
        if self.throttle_bytes_per_s is not None and not self.throttle_bytes_per_s > 0:
            raise ValueError(f"throttle_bytes_per_s must be positive or None, got {self.throttle_bytes_per_s!r}")
        self.check_checkpoint_fields()

    def check_checkpoint_fields(self) -> None:
        """Check the fields that come from the checkpoint (bits, group size, layout version)."""
        if self.bits != 4:
            raise ValueError(f"bits must be 4 for AWQ layer streaming (int4 kernels), got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1 or self.group_size % 2:
            raise ValueError(f"group_size must be a positive even int, got {self.group_size!r}")
        if str(self.version).lower() != "gemm":
            raise ValueError(f"version must be 'gemm' (AutoAWQ GEMM layout), got {self.version!r}")

    def merged_with_checkpoint(self, checkpoint: dict[str, Any]) -> StreamingAWQConfig:
        """A copy whose checkpoint fields come from the checkpoint's AWQ ``quantization_config``."""
        method = checkpoint.get("quant_method")
        if str(method).lower() != "awq":
            raise ValueError(
                f"quantization_config.quant_method of the checkpoint must be 'awq' (AutoAWQ GEMM) to load it "
                f"with StreamingAWQConfig, got {method!r}"
            )
        values = self.to_dict()
        values.pop("quant_method", None)
        for name in CHECKPOINT_FIELDS:
            if name in checkpoint:
                values[name] = checkpoint[name]
        # AutoAWQ writes "w_bit"/"q_group_size" in older configs.
        values["bits"] = checkpoint.get("bits", checkpoint.get("w_bit", values["bits"]))
        values["group_size"] = checkpoint.get("group_size", checkpoint.get("q_group_size", values["group_size"]))
        return StreamingAWQConfig(**values)

    def streamed_layers(self, num_layers: int) -> list[int]:
        """Indices of the decoder layers whose (some) weights stream, for ``num_layers`` layers."""
        if self.residency_mode == "full_resident":
            return []
        if self.residency_mode == "full_stream":
            return list(range(num_layers))
        if self.keep_first_k + self.keep_last_k > num_layers:
            raise ValueError(
                f"keep_first_k + keep_last_k ({self.keep_first_k} + {self.keep_last_k}) exceeds the model's "
                f"{num_layers} decoder layers"
            )
        return list(range(self.keep_first_k, num_layers - self.keep_last_k))

    def is_streamed(self, layer: int, module_suffix: str, num_layers: int) -> bool:
        """Whether the linear ``module_suffix`` (e.g. ``mlp.down_proj``) of ``layer`` streams."""
        if layer not in self.streamed_layers(num_layers):
            return False
        if self.residency_mode == "ffn_only_stream":
            return module_suffix.split(".")[0] in ("mlp", "feed_forward", "block_sparse_moe")
        return True

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, **{name: getattr(self, name) for name in SETTINGS}}

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """As transformers reads a saved config: a setting this version does not know (one a later version wrote)
        is dropped with a warning, where the constructor refuses it."""
        unknown = sorted(set(config_dict) - {"quant_method", *SETTINGS})
        if unknown:
            logger.warning("StreamingAWQConfig: ignoring setting(s) this version does not know: %s", unknown)
        values = {k: v for k, v in config_dict.items() if k in SETTINGS}
        return super().from_dict(values, return_unused_kwargs=return_unused_kwargs, **kwargs)


# from_pretrained's own arguments, and AutoAWQ's names for settings of ours: the hint an unknown name gets
_HINTS = {
    **dict.fromkeys(("dtype", "torch_dtype", "device_map", "low_cpu_mem_usage", "attn_implementation"),
                    "is from_pretrained's own argument: from_pretrained(path, quantization_config="
                    "StreamingAWQConfig(...), {name}=...)"),
    "w_bit": "is AutoAWQ's name for bits (read from the checkpoint)",
    "q_group_size": "is AutoAWQ's name for group_size (read from the checkpoint)",
}


def _refuse_unknown(kwargs: dict[str, Any]) -> None:
    """TypeError for any keyword that is not a setting; quant_method (to_dict's key) may only be ours."""
    method = kwargs.get("quant_method", QUANT_METHOD)
    if str(method) != QUANT_METHOD:
        raise ValueError(f"StreamingAWQConfig's quant_method is {QUANT_METHOD!r}, got {method!r}")
    unknown = sorted(set(kwargs) - {"quant_method"})
    if unknown:
        hints = "".join(f" {name!r} {_HINTS[name].format(name=name)}." for name in unknown if name in _HINTS)
        raise TypeError(f"StreamingAWQConfig got unknown setting(s) {', '.join(map(repr, unknown))}; its settings "
                        f"are {', '.join(SETTINGS)}.{hints}")
