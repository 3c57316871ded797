"""A fused decoder that runs transformers' forward says why, once per reason, at DEBUG (the float16 model of a GPU
machine's CPU fell back at every call with nothing to show for it)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache

from tests.streaming.fused_models import awq_model
from tests.streaming.test_awq_fused_decoder import NOT_PLAIN

LOGGER = "kvboost_hf.kernels.decoder"
REASONS = {
    "left padding": "not a 2-D mask of ones",
    "shifted positions": "not the cache's next ones",
    "hidden states": "asks for more",
    "a 4-D mask": "not a 2-D mask of ones",
    "a static cache": "(StaticCache) is not one the fused loop reproduces",
    "a quantized cache": "(KIVICache) is not one the fused loop reproduces",
    "a layer hook": "is not one the fused loop reproduces",
    "a layer in training mode": "is not one the fused loop reproduces",
    "a packed route": "asks for more",
    "scattered queries": "asks for more",
}


def fallback_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "not the fused loop" in r.getMessage()]


@pytest.mark.parametrize("case", list(NOT_PLAIN))
def test_a_fallback_names_its_reason_once(case, tiny_awq, kernels_built, caplog):
    assert set(REASONS) == set(NOT_PLAIN)
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(8))
    setup, arguments = NOT_PLAIN[case]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(2):
            undo = setup(model) if setup else None
            try:
                cache = DynamicCache(config=model.config)
                model(input_ids=ids, **{"past_key_values": cache, **arguments(model, ids, cache)})
            finally:
                if undo:
                    undo()
    messages = fallback_messages(caplog)
    assert len(messages) == 1 and REASONS[case] in messages[0], messages


def test_inputs_of_a_dtype_the_ops_do_not_take_say_so(tiny_awq, kernels_built, caplog):
    model = awq_model("gemma3", tiny_awq, None)
    embeds = torch.randn(1, 6, model.config.hidden_size, dtype=torch.float16)
    with caplog.at_level(logging.DEBUG, logger=LOGGER), torch.no_grad():
        model.model(inputs_embeds=embeds, past_key_values=DynamicCache(config=model.config))
    (message,) = fallback_messages(caplog)
    assert "torch.float16" in message and "from_pretrained(dtype=...)" in message


def test_nothing_is_kept_or_logged_above_debug(tiny_awq, kernels_built, caplog):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(9))
    with caplog.at_level(logging.INFO, logger=LOGGER), torch.no_grad():
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config), output_hidden_states=True)
    assert not fallback_messages(caplog) and "kvboost_fallbacks" not in model.model.__dict__


def test_a_plain_call_logs_nothing(tiny_awq, kernels_built, caplog):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(10))
    with caplog.at_level(logging.DEBUG, logger=LOGGER), torch.no_grad():
        model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
    assert not fallback_messages(caplog)
