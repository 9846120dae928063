"""A factory's model built with its parameters on the meta device and a --weights file read by rows (for
torchrun's shards): the buffers are real, the rows equal the file's, a legacy file is left to the whole
load, a file that does not cover the model is refused with the names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from normswap.errors import BadInputError
from normswap.load.factory import load_factory_without_weights
from normswap.load.model_file import weights_by_rows

_FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.norm(self.proj(x)) * self.scale


def build():
    return Net(), (torch.randn(3, 6),)
"""


@pytest.fixture
def spec(tmp_path: Path) -> str:
    path = tmp_path / "net.py"
    path.write_text(_FACTORY)
    return f"{path}:build"


def test_parameters_on_meta_buffers_and_inputs_real(spec: str) -> None:
    model, args, _ = load_factory_without_weights(spec)
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model.scale, torch.arange(4.0))  # computed as the factory computes it
    assert model.norm.running_var is not None and not model.norm.running_var.is_meta
    assert args is not None and not args[0].is_meta
    # the patch is gone: a module built afterwards has real parameters
    assert not nn.Linear(2, 2).weight.is_meta


@pytest.mark.parametrize("kind", ["safetensors", "torch zip"])
def test_rows_read_from_a_weights_file_equal_its_tensors(tmp_path: Path, kind: str) -> None:
    state = {"proj.weight": torch.randn(4, 6), "proj.bias": torch.randn(4)}
    path = tmp_path / ("w.safetensors" if kind == "safetensors" else "w.pt")
    save_file(state, path) if kind == "safetensors" else torch.save(state, path)
    stored = weights_by_rows(path)
    assert stored is not None and stored.keys() == state.keys()
    from normswap.calibrate.parallel_load import _rows

    assert torch.equal(_rows(stored["proj.weight"], 1, 3), state["proj.weight"][1:3])
    assert torch.equal(_rows(stored["proj.bias"], 0, None), state["proj.bias"])


def test_a_legacy_torch_file_is_left_to_the_whole_load(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"proj.weight": torch.randn(4, 6)}, path, _use_new_zipfile_serialization=False)
    assert weights_by_rows(path) is None


def test_a_weights_file_that_does_not_cover_the_model_is_refused_with_the_names(
    spec: str, tmp_path: Path
) -> None:
    from normswap.api.shard_reading import unfilled_model

    path = tmp_path / "partial.safetensors"
    save_file({"proj.weight": torch.randn(4, 6), "extra": torch.zeros(1)}, path)
    with pytest.raises(BadInputError, match=r"missing keys \['norm\.bias'.*unexpected keys \['extra'\]"):
        unfilled_model(spec, path, trust_pickle=False)


_TIED_AND_DERIVED = """
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as transformers' tie_weights does


def tied():
    return Tied()


class Derived(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones_like(self.proj.weight[0]), persistent=False)


def derived():
    return Derived()
"""


def test_tied_parameters_stay_one_and_a_buffer_made_from_a_parameter_is_left_to_the_whole_load(
    tmp_path: Path,
) -> None:
    from normswap.api.shard_reading import unfilled_model

    path = tmp_path / "shapes.py"
    path.write_text(_TIED_AND_DERIVED)
    model, _, _ = load_factory_without_weights(f"{path}:tied")
    assert model.head.weight is model.embed.weight and model.head.weight.is_meta
    # the mask is computed from a parameter, so on the meta device, and stored nowhere: nothing could fill
    # it after the model is given memory, so the factory is loaded whole instead
    weights = tmp_path / "derived.safetensors"
    save_file({"proj.weight": torch.randn(4, 4), "proj.bias": torch.randn(4)}, weights)
    assert load_factory_without_weights(f"{path}:derived")[0].mask.is_meta
    assert unfilled_model(f"{path}:derived", weights, trust_pickle=False) is None
