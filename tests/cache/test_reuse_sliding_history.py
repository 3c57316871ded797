"""ReuseSlidingLayer's history (the K/V its window drops, kept for the store): crops trim it from the end."""

from __future__ import annotations

import random

import torch

from kvboost_hf.cache.chunk_reuse import ReuseSlidingLayer


def test_the_history_is_every_token_kept_after_any_sequence_of_appends_updates_crops_and_loads():
    rng = random.Random(4)
    for _ in range(20):
        layer = ReuseSlidingLayer(sliding_window=6)
        layer.activate_past_recording()  # as assisted decoding's cache: crops past the window are allowed
        reference = torch.empty(1, 2, 0, 4)  # every token the layer holds, in order
        for _ in range(30):
            action, n = rng.choice(["update", "update", "append", "crop"]), rng.randint(1, 5)
            states = torch.randn(1, 2, n, 4)
            if action == "update":
                layer.update(states, -states)
                reference = torch.cat([reference, states], dim=-2)
            elif action == "append":
                layer.append(states, -states)
                reference = torch.cat([reference, states], dim=-2)
            elif layer.get_seq_length() > n:
                layer.crop(-n)
                reference = reference[..., :-n, :]
            assert layer.history_length == reference.shape[-2] == layer.get_seq_length()
            if reference.shape[-2]:
                keys, values = layer.full_states()
                assert torch.equal(keys, reference) and torch.equal(values, -reference)
        layer.reset()
        assert layer.history == [] and layer.history_length == 0
        segments = [(t, -t) for t in reference.split(7, dim=-2)]
        layer.load(segments)
        layer.crop(-3)
        assert layer.history_length == reference.shape[-2] - 3
        assert torch.equal(layer.full_states()[0], reference[..., :-3, :])
