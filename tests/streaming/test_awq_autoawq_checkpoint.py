"""A checkpoint packed the way AutoAWQ's ``WQLinear_GEMM.from_linear`` packs (re-implemented
here loop for loop, independent of kvboost's packer) loads and computes the dequantised weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kvboost_hf.streaming.quantize import rtn_quantize
from tests.conftest import make_tiny
from tests.streaming.conftest import load_awq

GROUP = 32


def autoawq_pack(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype):
    """AutoAWQ 0.2 GEMM packing of one linear: returns qweight, qzeros, scales and the dequantised weight."""
    codes, zeros, scales = rtn_quantize(weight, group_size, zero_point=True, scale_dtype=scale_dtype)
    out_features, in_features = weight.shape
    intweight = codes.t().contiguous()  # [in, out], as AutoAWQ builds it
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros((in_features, out_features // 8), dtype=torch.int32)
    for col in range(out_features // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
    izeros = zeros.to(torch.int32)  # [in/G, out]
    qzeros = torch.zeros((izeros.shape[0], out_features // 8), dtype=torch.int32)
    for col in range(out_features // 8):
        for i in range(8):
            qzeros[:, col] |= izeros[:, col * 8 + order_map[i]] << (i * 4)
    s = scales.t().repeat_interleave(group_size, 1)
    z = zeros.t().repeat_interleave(group_size, 1)
    dequantised = (codes.float() - z) * s
    return qweight, qzeros, scales.to(scale_dtype), dequantised


def write_autoawq_checkpoint(model, path, scale_dtype):
    """Quantize every decoder-layer linear of ``model``; return a float copy holding the dequantised weights."""
    reference = make_tiny("llama", seed=21, num_layers=4)
    reference.load_state_dict(model.state_dict())
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            qweight, qzeros, scales, dequantised = autoawq_pack(module.weight.detach(), GROUP, scale_dtype)
            tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales})
            reference.get_submodule(name).weight.data.copy_(dequantised)
    quantized = {k.rsplit(".", 1)[0] for k in tensors}
    for key, value in model.state_dict().items():
        if key.rsplit(".", 1)[0] not in quantized:
            tensors[key] = value.to(torch.float16)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "GEMM"}  # AutoAWQ writes the version in capitals
    config["dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_autoawq_packed_checkpoint(tmp_path, scale_dtype):
    model = make_tiny("llama", seed=21, num_layers=4)
    reference = write_autoawq_checkpoint(model, tmp_path, scale_dtype)
    resident = load_awq(tmp_path, residency_mode="full_resident", dtype=torch.float32)
    streamed = load_awq(tmp_path, residency_mode="full_stream", n_staging_slots=1, dtype=torch.float32)
    prompt = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.float()(prompt).logits
        got = resident(prompt).logits
        assert torch.equal(got, streamed(prompt).logits)
    # bf16 activations and bf16 scale/zero in torch's kernel: close to the dequantised float model.
    assert (got - expected).abs().max() <= 0.03 * expected.abs().max() + 1e-3, (got - expected).abs().max()
