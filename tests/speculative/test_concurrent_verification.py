"""Speculative requests on threads: one request ending never unroutes another's verification forwards.

The model's attention implementation is shared by every thread; routes are per thread. A request
that put the shared implementation back to stock SDPA when it ended made a request still
verifying on another thread run a verification forward on stock SDPA (not row-exact).
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvboost_hf import ChunkStore, ControllerSettings, enable_chunk_reuse, last_request_stats, make_draft
from kvboost_hf.models import attention
from kvboost_hf.models.fingerprint import model_namespace, model_state_token
from kvboost_hf.speculative.exact_rows import route_rows, verifying
from kvboost_hf.streaming import StreamingAWQConfig
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import SLIDING_WINDOW, make_tiny, random_ids

pytestmark = pytest.mark.usefixtures("one_thread")
WAIT_S = 60  # a deadlock guard, not a timing assertion


def _int4_target(path, family: str = "gemma3", layers: int = 3, residency: str = "partial_resident"):
    model = make_tiny(family, seed=3, num_layers=layers)
    pack_model(model, path, group_size=32)
    config = StreamingAWQConfig(residency_mode=residency, keep_first_k=1, keep_last_k=1)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32).eval()


def _routed_layers(model, ids: torch.Tensor, prefix: int) -> tuple[int, torch.Tensor]:
    """Inside ``verifying``: prefill ``ids[:prefix]``, then one verification forward of the rest with
    its route wrapped; returns how many layers went through the route, and the rows' hidden states."""
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
    route_rows(ids.shape[1] - prefix)
    route, calls = attention.attention_route(), []
    attention.set_attention_route(lambda *args, **kwargs: calls.append(1) or route(*args, **kwargs))
    hidden = model.model(input_ids=ids[:, prefix:], past_key_values=cache, use_cache=True).last_hidden_state[0]
    route_rows(None)
    return len(calls), hidden


def test_a_request_ending_does_not_unroute_one_still_verifying(tmp_path):
    """Request A enters, B enters, A ends, then B verifies: every layer of B's forward is routed."""
    target = _int4_target(tmp_path / "ckpt")
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def request_a() -> None:
        try:
            with verifying(target):
                a_inside.set()
                assert b_inside.wait(WAIT_S)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
        finally:
            a_done.set()

    ids, prefix = random_ids(SLIDING_WINDOW + 6, 4), SLIDING_WINDOW
    with torch.no_grad():
        with verifying(target):
            reference = _routed_layers(target, ids, prefix)[1]  # alone: routed, row-exact
        worker = threading.Thread(target=request_a)
        worker.start()
        assert a_inside.wait(WAIT_S)
        with verifying(target) as exact:
            b_inside.set()
            assert a_done.wait(WAIT_S)
            routed, hidden = _routed_layers(target, ids, prefix)
        worker.join(WAIT_S)
    assert not errors and exact
    assert routed == target.config.num_hidden_layers
    assert torch.equal(hidden, reference)
    assert attention.attention_route() is None  # nothing left routed on this thread


def test_switching_attention_keeps_the_store_namespace_and_its_entries():
    """``kvboost_sdpa`` is switched on for good on first use: what was stored before still matches."""
    model = make_tiny("gemma3", seed=5)
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    enable_chunk_reuse(model, store)
    namespace, token = model_namespace(model), model_state_token(model)
    ids = random_ids(SLIDING_WINDOW + 9, 6)
    first = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert model.config._attn_implementation == "sdpa"
    assert attention.use_kvboost_sdpa(model) and attention.use_kvboost_sdpa(model)  # idempotent
    assert model.config._attn_implementation == attention.ATTENTION_NAME
    assert model_namespace(model) == namespace and model_state_token(model) == token
    again = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(again, first)
    assert last_request_stats(model).reused_tokens >= 16


def test_use_kvboost_sdpa_leaves_other_implementations_alone():
    model = make_tiny("llama")
    model.set_attn_implementation("eager")
    assert not attention.use_kvboost_sdpa(model)
    assert model.config._attn_implementation == "eager"


def test_concurrent_speculative_requests_on_an_int4_target_are_greedy(tmp_path):
    """Three speculative requests on threads give plain greedy decoding's tokens, each of them."""
    target = _int4_target(tmp_path / "ckpt", layers=4)
    draft = make_draft(target, bits=4)
    enable_chunk_reuse(target, ChunkStore(max_bytes=50_000_000, chunk_size=8))
    settings = ControllerSettings(min_gain=1e-6, start_tokens=3, max_tokens=6)
    prompts = [random_ids(SLIDING_WINDOW + 3 + 5 * seed, seed) for seed in (1, 2, 3)]
    expected = [target.generate(p, max_new_tokens=20, do_sample=False) for p in prompts]
    outputs: dict[int, torch.Tensor] = {}
    errors = []
    start = threading.Barrier(len(prompts))

    def request(i: int) -> None:
        try:
            start.wait(WAIT_S)
            outputs[i] = target.generate(prompts[i], max_new_tokens=20, do_sample=False, draft=draft,
                                         speculation=settings)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 5)
    assert not errors and len(outputs) == len(prompts)
    for i, ref in enumerate(expected):
        assert torch.equal(outputs[i], ref), i
    assert last_request_stats(target).speculation.drafted_tokens > 0  # the latest request did speculate
    assert target.config._attn_implementation == attention.ATTENTION_NAME  # switched once, for good
