"""add/remove weight norm: exact round trips on real models, both torch APIs, files that reload."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from pathlib import Path

import model_zoo
import pytest
import torch
from torch import nn

from normswap.errors import BadInputError
from normswap.load import load_model, save_model
from normswap.modules.copying import copy_model
from normswap.passes import AddWeightNorm, Pipeline, RemoveWeightNorm
from normswap.passes.weightnorm.layers import weight_from_weight_norm, weight_norm_magnitude
from normswap.util.tolerance import EXACT_TOLERANCE
from normswap.verify import compare_models


def _reasons(report) -> dict[str, str]:
    return {s.site: s.reason for s in report.skips}


def _assert_exact(original: nn.Module, converted: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    cmp = compare_models(original, converted, args, kwargs)
    worst = max(cmp.outputs, key=lambda o: o.max_rel)
    assert worst.max_rel <= EXACT_TOLERANCE[torch.float32], worst


def _weight_normed(model: nn.Module) -> int:
    return sum(hasattr(m, "parametrizations") or hasattr(m, "weight_g") for m in model.modules())


class WaveNetLike(nn.Module):
    """Gated dilated Conv1d stack, ConvTranspose upsampling and a Linear head, as vocoders are built.

    With ``weight_norm=True`` it uses both torch APIs, as real checkpoints do: the deprecated hook
    (``weight_g``/``weight_v``) on the dilated convs, parametrizations elsewhere, ConvTranspose on dim 1.
    """

    def __init__(self, channels: int = 8, layers: int = 3, weight_norm: bool = True) -> None:
        super().__init__()
        self.inp = nn.Conv1d(1, channels, 1)
        self.dilated = nn.ModuleList(
            nn.Conv1d(channels, 2 * channels, 3, dilation=2**i, padding=2**i) for i in range(layers)
        )
        self.res = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(layers))
        self.up = nn.ConvTranspose1d(channels, channels, 4, stride=2, padding=1)
        self.grouped_up = nn.ConvTranspose1d(channels, channels, 4, stride=2, padding=1, groups=2)
        self.head = nn.Linear(channels, 3)
        if weight_norm:
            param = nn.utils.parametrizations.weight_norm
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
                for conv in self.dilated:
                    nn.utils.weight_norm(conv)
            for conv in self.res:
                param(conv)
            param(self.up, dim=1)
            param(self.grouped_up, dim=1)
            param(self.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for dilated, res in zip(self.dilated, self.res, strict=True):
            a, b = dilated(h).chunk(2, dim=1)
            h = h + res(torch.tanh(a) * torch.sigmoid(b))
        h = self.grouped_up(self.up(h))
        return self.head(h.transpose(1, 2))


def _wavenet() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = WaveNetLike().eval()
    with torch.no_grad():  # magnitudes far from ||v||, so a dropped g would show
        for name, p in model.named_parameters():
            if name.endswith(("weight_g", "original0")):
                p.mul_(1 + torch.rand(p.shape))
    return model, (torch.randn(2, 1, 16),)


# --- the math alone ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1, 2, -1], ids=["dim0", "dim1", "dim2", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_magnitude_and_direction_rebuild_the_weight(dim, dtype):
    weight = torch.randn(6, 5, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    g = weight_norm_magnitude(weight, dim)
    rebuilt = weight_from_weight_norm(g, weight, dim)
    assert rebuilt.dtype == dtype
    # fp64 inside, one rounding at the end: at most half an ulp off
    tol = EXACT_TOLERANCE[dtype] * weight.abs().max().item()
    torch.testing.assert_close(rebuilt, weight, rtol=0, atol=tol)


# --- adding -----------------------------------------------------------------------------------------


def test_resnet18_add_then_remove_round_trips():
    model, args, _ = model_zoo.resnet18()
    normed, added = AddWeightNorm()(model, args)
    assert len(added.changes) == 21 and added.skips == []  # 20 convs and the fc
    assert _weight_normed(normed) == 21 and _weight_normed(model) == 0  # the input is untouched
    assert "conv1.parametrizations.weight.original0" in normed.state_dict()
    assert max(c.details["weight_max_rel"] for c in added.changes) <= EXACT_TOLERANCE[torch.float32]
    _assert_exact(model, normed, args)

    plain, removed = RemoveWeightNorm()(normed, args)
    assert len(removed.changes) == 21 and removed.skips == []
    assert type(plain.conv1) is nn.Conv2d and type(plain.fc) is nn.Linear
    assert list(plain.state_dict()) == list(model.state_dict())  # same keys, same order
    _assert_exact(model, plain, args)
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-6, atol=1e-7)


def test_conv_transpose_is_normalized_per_output_channel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2), nn.Conv2d(6, 5, 3), nn.Linear(7, 2)).eval()
    args = (torch.randn(2, 4, 4, 4),)
    normed, report = AddWeightNorm()(model, args)
    assert [c.details["dim"] for c in report.changes] == [1, 0, 0]
    # one magnitude per output channel: (1, out, 1, 1) for ConvTranspose's (in, out, kh, kw) weight
    assert normed[0].parametrizations.weight.original0.shape == (1, 6, 1, 1)
    assert normed[1].parametrizations.weight.original0.shape == (5, 1, 1, 1)
    _assert_exact(model, normed, args)


def test_targets_by_path_class_and_filter():
    model, _, _ = model_zoo.resnet18()
    _, by_path = AddWeightNorm(["layer1.0.conv1", "fc"])(model)
    assert [c.site for c in by_path.changes] == ["layer1.0.conv1", "fc"]
    _, by_class = AddWeightNorm(nn.Linear)(model)
    assert [c.site for c in by_class.changes] == ["fc"]
    _, by_filter = AddWeightNorm(lambda module, path: path.startswith("layer4.1."))(model)
    assert [c.site for c in by_filter.changes] == ["layer4.1.conv1", "layer4.1.conv2"]


def test_explicit_dim_and_whole_weight():
    model = nn.Sequential(nn.Conv1d(3, 4, 3)).eval()
    normed, report = AddWeightNorm(dim=None)(model)
    assert report.changes[0].details["dim"] is None
    assert normed[0].parametrizations.weight.original0.shape == ()
    normed, report = AddWeightNorm(dim=2)(model)
    assert normed[0].parametrizations.weight.original0.shape == (1, 1, 3)
    with pytest.raises(ValueError, match="a weight dim >= 0"):
        AddWeightNorm(dim=-1)


def _zero_channel() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    with torch.no_grad():
        model[0].weight[2].zero_()  # a pruned channel
    return model


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    return model


def _spectral() -> nn.Module:
    return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)))


_ADD_REFUSALS = [
    (
        lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))),
        "0",
        "already has weight norm",
    ),
    (_spectral, "0", "weight already has parametrizations (_SpectralNorm); weight norm would stack on them"),
    (_zero_channel, "0", "1 of 4 slices along dim 0 are all zeros: v / ||v|| would divide by zero"),
    (
        _tied,
        None,
        {
            "0": "weight is tied to 1.weight: weight norm would untie them",
            "1": "weight is tied to 0.weight: weight norm would untie them",
        },
    ),
    (
        lambda: nn.Sequential(nn.ConvTranspose1d(4, 4, 3, groups=2)),
        "0",
        "grouped ConvTranspose (groups=2): weight dim 1 indexes channels within a group, so no weight dim "
        "is one output channel; pass an explicit dim",
    ),
    (
        lambda: nn.Sequential(nn.LazyLinear(3)),
        "0",
        "weight is uninitialized (lazy module): run the model once first",
    ),
]


@pytest.mark.parametrize(("build", "site", "reason"), _ADD_REFUSALS)
def test_add_refusals_say_why(build, site, reason):
    _, report = AddWeightNorm()(build())
    assert report.changes == []
    assert _reasons(report) == (reason if site is None else {site: reason})


def test_already_normalized_hook_form_is_refused():
    model, _ = _wavenet()
    _, report = AddWeightNorm(["dilated.0"])(model)
    assert _reasons(report) == {"dilated.0": "already has weight norm"}


def test_named_target_that_is_not_a_layer_is_skipped_and_a_missing_one_is_an_error():
    model, _, _ = model_zoo.resnet18()
    _, report = AddWeightNorm(["bn1", "layer1.0.conv1"])(model)
    assert _reasons(report) == {"bn1": "BatchNorm2d, not a Conv1d/2d/3d, ConvTranspose1d/2d/3d or Linear"}
    assert [c.site for c in report.changes] == ["layer1.0.conv1"]
    with pytest.raises(
        BadInputError, match=r"add_weight_norm: no module at path 'layer1.0.conv9'.*layer1.0.conv1"
    ):
        AddWeightNorm(["layer1.0.conv9"])(model)
    with pytest.raises(BadInputError, match="list of module paths, not the string"):
        AddWeightNorm("fc")(model)


def test_grouped_conv_transpose_with_explicit_dim_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose1d(4, 6, 3, groups=2)).eval()
    args = (torch.randn(2, 4, 5),)
    normed, report = AddWeightNorm(dim=1)(model)
    assert len(report.changes) == 1
    _assert_exact(model, normed, args)


# --- removing ---------------------------------------------------------------------------------------


def test_user_built_wavenet_removes_both_forms_exactly():
    model, args = _wavenet()
    plain, report = RemoveWeightNorm()(model, args)
    forms = {c.site: (c.details["form"], c.details["dim"]) for c in report.changes}
    assert forms == {
        "dilated.0": ("hook", 0),
        "dilated.1": ("hook", 0),
        "dilated.2": ("hook", 0),
        "res.0": ("parametrization", 0),
        "res.1": ("parametrization", 0),
        "res.2": ("parametrization", 0),
        "up": ("parametrization", 1),
        "grouped_up": ("parametrization", 1),
        "head": ("parametrization", 0),
    }
    assert report.skips == [] and _weight_normed(plain) == 0
    assert not any(plain.dilated[0]._forward_pre_hooks.values())
    # the input (with its hook-form layers) was copied, not changed, and still runs: torch's removal
    # edits the parametrized class, which a plain deepcopy would share with the original
    assert _weight_normed(model) == 9
    _assert_exact(model, plain, args)

    fresh = WaveNetLike(weight_norm=False).eval()
    fresh.load_state_dict(plain.state_dict(), strict=True)  # a plain class takes the state dict as is
    _assert_exact(model, fresh, args)


def test_removed_model_saves_and_reloads(tmp_path):
    model, args = _wavenet()
    plain, _ = RemoveWeightNorm()(model, args)
    state = tmp_path / "plain_state.pt"
    torch.save(plain.state_dict(), state)
    reloaded = WaveNetLike(weight_norm=False).eval()
    reloaded.load_state_dict(torch.load(state, weights_only=True), strict=True)
    _assert_exact(model, reloaded, args)

    archive = tmp_path / "plain.pt2"
    assert save_model(plain, archive, args) == "pt2"
    loaded = load_model(str(archive))
    assert loaded.format == "pt2"
    _assert_exact(model, loaded.model, args)


def _keep_keys(state_dict, prefix, *args) -> None:
    """A load_state_dict pre-hook of the user's own: removing weight norm must leave it."""


@pytest.mark.parametrize("form", ["parametrization", "hook"])
def test_removed_model_pickles_and_loads_back(form):
    """torch's parametrizations.weight_norm registers a load_state_dict pre-hook (a local function that
    maps old weight_g/weight_v keys) which its removal leaves behind: the plain model must pickle."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv1d(4, 4, 3, padding=1),
        nn.Flatten(),
        nn.Linear(32, 3),
    ).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        for i in (0, 2, 4):
            if form == "parametrization":
                nn.utils.parametrizations.weight_norm(model[i])
            else:
                nn.utils.weight_norm(model[i])
    model[2]._register_load_state_dict_pre_hook(_keep_keys)
    args = (torch.randn(2, 2, 8),)
    plain, report = RemoveWeightNorm()(model, args)
    assert [c.details["form"] for c in report.changes] == [form] * 3
    assert [h.hook for h in plain[2]._load_state_dict_pre_hooks.values()] == [_keep_keys]
    plain[2]._load_state_dict_pre_hooks.clear()  # the test's own hook would pickle by a test-module name

    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [type(m) for m in loaded] == [nn.Conv1d, nn.Tanh, nn.Conv1d, nn.Flatten, nn.Linear]
    assert all(not m._load_state_dict_pre_hooks and not m._forward_pre_hooks for m in loaded)
    torch.testing.assert_close(loaded(*args), plain(*args), rtol=0, atol=0)
    _assert_exact(model, loaded, args)


def test_copy_model_copies_the_deprecated_hook_form():
    model, args = _wavenet()
    copied = copy_model(model)
    assert copied.dilated[0].weight_g is not model.dilated[0].weight_g
    _assert_exact(model, copied, args)


def test_hf_wav2vec2_positional_conv_removes_exactly():
    from hf_dirs import wav2vec2_config
    from transformers import Wav2Vec2Model

    torch.manual_seed(0)
    config = wav2vec2_config(num_hidden_layers=1)
    model = Wav2Vec2Model(config).eval()
    args = (torch.randn(1, 400),)
    plain, report = RemoveWeightNorm()(model, args)
    # HF normalizes the grouped positional conv over dim 2 (the kernel), not the output channels
    assert [(c.site, c.details["dim"]) for c in report.changes] == [("encoder.pos_conv_embed.conv", 2)]
    assert "encoder.pos_conv_embed.conv.weight" in plain.state_dict()
    _assert_exact(model, plain, args)


def test_stacked_parametrizations_are_refused_and_named_layers_without_weight_norm_say_so():
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
    nn.utils.parametrize.register_parametrization(layer, "weight", nn.Identity())
    model = nn.Sequential(layer, nn.Linear(4, 4))
    _, report = RemoveWeightNorm(["0", "1"])(model)
    assert report.changes == []
    assert _reasons(report) == {
        "0": "weight has parametrizations _WeightNorm, Identity: removing the weight norm would bake the others in too",
        "1": "Linear has no weight norm",
    }
    with pytest.raises(BadInputError, match="remove_weight_norm: no module at path 'nope'"):
        RemoveWeightNorm(["nope"])(model)


def test_weight_norm_on_another_tensor_name():
    lstm = nn.utils.parametrizations.weight_norm(nn.LSTM(4, 5, batch_first=True), name="weight_hh_l0")
    model = nn.Sequential(lstm).eval()
    args = (torch.randn(2, 3, 4),)
    plain, report = RemoveWeightNorm()(model, args)
    assert [c.site for c in report.changes] == ["0.weight_hh_l0"]
    assert "0.weight_hh_l0" in plain.state_dict()
    _assert_exact(model, plain, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipeline_add_then_remove_is_validated_exact(dtype):
    model, args = _wavenet()
    model = RemoveWeightNorm()(model)[0].to(dtype)
    args = tuple(a.to(dtype) for a in args)
    result, report = Pipeline([AddWeightNorm(), RemoveWeightNorm()])(model, args)
    assert report.ok, report.exact_failures
    assert [len(p.changes) for p in report.passes] == [9, 9]  # the grouped ConvTranspose needs a dim
    assert _reasons(report.passes[0])["grouped_up"].startswith("grouped ConvTranspose")
    assert all(p.validation["within_tolerance"] for p in report.passes)
    assert next(result.parameters()).dtype == dtype


@pytest.mark.slow
def test_example_script_runs_and_is_exact():
    script = Path(__file__).resolve().parents[3] / "examples" / "weight_norm.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "up: g * v / ||v|| folded into a plain weight (parametrization form, dim 1)" in out
    assert "dilated.0: g * v / ||v|| folded into a plain weight (hook form, dim 0)" in out
    assert ".pt2 round trip: same outputs" in out
    assert out.rstrip().endswith("exact") and "NOT EXACT" not in out
