import torch

from kvboost_hf.models.fingerprint import active_adapters, model_namespace, model_state_token
from kvboost_hf.store.keys import chunk_key, chunk_spans, namespace_key
from tests.conftest import make_tiny


def test_chunk_key_depends_on_parent_and_every_token():
    root = namespace_key({"model": "a"})
    base = chunk_key(root, [1, 2, 3])
    assert chunk_key(root, [1, 2, 3]) == base
    assert chunk_key(root, [1, 2, 4]) != base
    assert chunk_key(root, [1, 2]) != base
    assert chunk_key(namespace_key({"model": "b"}), [1, 2, 3]) != base
    assert chunk_key(base, [1, 2, 3]) != base


def test_chunk_spans_cover_sequence_with_partial_tail():
    assert list(chunk_spans(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(chunk_spans(8, 4)) == [(0, 4), (4, 8)]
    assert list(chunk_spans(0, 4)) == []


def test_namespace_separates_weights_dtype_and_config():
    a = make_tiny("llama", seed=0)
    same = make_tiny("llama", seed=0)
    other_weights = make_tiny("llama", seed=1)
    other_config = make_tiny("qwen2", seed=0)
    assert model_namespace(a) == model_namespace(same)
    assert model_namespace(a) != model_namespace(other_weights)
    assert model_namespace(a) != model_namespace(other_config)
    assert model_namespace(a) != model_namespace(make_tiny("llama", seed=0).to(torch.float64))


def test_state_token_moves_on_in_place_weight_change():
    model = make_tiny("llama")
    before = model_state_token(model)
    with torch.no_grad():
        next(model.parameters()).add_(0.0)
    assert model_state_token(model) != before


def test_peft_adapter_changes_namespace():
    import peft

    base = make_tiny("llama")
    plain = model_namespace(base)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    inner = lora.get_base_model()
    assert active_adapters(inner) == ["default"]
    with_adapter = model_namespace(inner)
    assert with_adapter != plain
    with lora.disable_adapter():
        assert active_adapters(inner) == []
