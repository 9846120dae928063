"""The activation store of the sequential calibration: memory up to its budget, files past it, nothing left."""

from __future__ import annotations

import torch

from normswap.calibrate.activations import ActivationStore


def test_tensors_past_the_budget_go_to_disk_and_come_back_equal(tmp_path):
    store = ActivationStore(budget=3 * 400, parent=tmp_path)  # room for three (10, 10) fp32 tensors
    tensors = {("o", b): torch.randn(10, 10, generator=torch.Generator().manual_seed(b)) for b in range(5)}
    for key, tensor in tensors.items():
        store.put(key, tensor)
    assert store.held_bytes == 1200 and store.spilled_bytes == 800
    assert len(list(tmp_path.glob(".normswap-activations-*/*.safetensors"))) == 2
    for key, tensor in tensors.items():
        assert torch.equal(store.get(key), tensor)
    store.put(("o", 0), torch.zeros(10, 10))  # a replaced tensor frees its room
    assert torch.equal(store.get(("o", 0)), torch.zeros(10, 10)) and store.held_bytes == 1200
    store.put(("o", 4), torch.ones(10, 10))  # a spilled one is replaced by a file of its own
    assert torch.equal(store.get(("o", 4)), torch.ones(10, 10))
    assert len(list(tmp_path.glob(".normswap-activations-*/*.safetensors"))) == 2
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_within_the_budget_nothing_is_written(tmp_path):
    store = ActivationStore(budget=10**6, parent=tmp_path)
    store.put("h", torch.ones(4, 4, dtype=torch.bfloat16))
    assert store.get("h").dtype == torch.bfloat16 and not store.spilled and store.peak_held_bytes == 32
    store.close()
    assert list(tmp_path.iterdir()) == []
