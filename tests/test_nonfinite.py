"""One NaN/Inf rule for every comparison (issue 29, items 2 and 3): a NaN or Inf anywhere in a
comparison fails it and says where (which output, which index), on every route: the figures of
``compare_tensors``, convert's verification, the block-by-block verification, the input variants,
the per-layer figures and ``validate``; and a calibration fit that produces a non-finite parameter
refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

from normswap.errors import BadInputError, CheckFailedError
from normswap.verify.metrics import compare_tensors, nonfinite_where, sqnr_db

HERE = str(Path(__file__))


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


class _OneNaN(nn.Module):
    """A linear layer whose output holds one NaN at ``at`` (or is all NaN with ``at=None`` and ``all_nan``)."""

    def __init__(self, shift: float = 0.0, at: tuple[int, int] | None = None, all_nan: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc.weight += shift
        self.at, self.all_nan = at, all_nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.all_nan:
            return y * math.nan
        if self.at is not None:
            y = y.clone()
            y[self.at] = math.nan
        return y


def _x() -> tuple[torch.Tensor]:
    return (torch.randn(3, 8, generator=torch.Generator().manual_seed(1)),)


def good_factory() -> tuple[nn.Module, tuple]:
    return _OneNaN().eval(), _x()


def wrong_with_one_nan_factory() -> tuple[nn.Module, tuple]:
    # wrong everywhere (every weight moved by 1), plus one NaN
    return _OneNaN(shift=1.0, at=(2, 1)).eval(), _x()


class _ConvBN(nn.Module):
    def __init__(self, all_nan: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.all_nan = all_nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return y * math.nan if self.all_nan else y


def nan_logits_factory() -> tuple[nn.Module, tuple]:
    return _ConvBN(all_nan=True).eval(), (
        torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)),
    )


# ---------------------------------------------------------------------------------------------------
# The one function, and the figures


def test_one_nan_in_an_output_wrong_everywhere_fails_and_says_where():
    ref = torch.randn(3, 4)
    out = ref + 1.0
    out[2, 1] = math.nan
    c = compare_tensors("output.logits", ref, out)
    assert not c.within_tolerance
    assert c.nonfinite == "the converted model's output.logits holds NaN at [2, 1] (1 non-finite value)"
    # no figure pretends to measure what was not compared
    assert math.isnan(c.sqnr_db) and math.isnan(c.max_abs) and math.isnan(c.cosine)


def test_a_nan_in_both_at_the_same_place_is_the_reference_broken():
    ref = torch.randn(2, 3)
    ref[1, 2] = math.inf
    out = ref.clone()
    c = compare_tensors("output.logits", ref, out)
    assert not c.within_tolerance
    assert c.nonfinite == (
        "the original's output.logits holds Inf at [1, 2] (1 non-finite value): nothing was compared there"
    )
    where = nonfinite_where(
        "x", torch.full((2, 2), math.nan), torch.zeros(2, 2), reference_label="the teacher's"
    )
    assert where == "the teacher's x holds NaN at [0, 0] (4 non-finite values): nothing was compared there"
    assert nonfinite_where("x", torch.ones(2), torch.ones(2)) is None
    assert math.isnan(sqnr_db(torch.ones(3), torch.tensor([1.0, math.inf, 1.0])))


def test_figures_of_a_slice_with_a_nan_are_not_dropped():
    # the NaN sits in the second slice of rows: it used to vanish in max(0.0, nan) == 0.0
    ref = torch.zeros(4, 1 << 19)
    out = ref.clone()
    out[3, 7] = -math.inf
    c = compare_tensors("h", ref, out)
    assert not c.within_tolerance and c.nonfinite.startswith("the converted model's h holds -Inf at [3, 7]")


# ---------------------------------------------------------------------------------------------------
# validate and convert (CLI)


def test_validate_exact_fails_a_model_wrong_everywhere_plus_one_nan():
    result = _run("validate", f"{HERE}:good_factory", f"{HERE}:wrong_with_one_nan_factory", "--exact")
    assert result.exit_code == 1, result.output
    assert "the converted model's output holds NaN at [2, 1]" in result.output
    assert "PASS" not in result.output and "SQNR nan" not in result.output
    # without --exact or --min-sqnr, a comparison that holds NaN still fails
    result = _run("validate", f"{HERE}:good_factory", f"{HERE}:wrong_with_one_nan_factory")
    assert result.exit_code == 1 and "holds NaN at [2, 1]" in result.output


def test_convert_refuses_an_original_whose_outputs_are_all_nan(tmp_path):
    """A broken original is bad input (exit 2, the one rule of normswap.util.finite), not a failed check."""
    out = tmp_path / "m.pt2"
    result = _run("convert", f"{HERE}:nan_logits_factory", "--fold-bn", "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "the model is broken: its output holds NaN at [0, 0, 0, 0]" in result.output
    assert "on the example inputs 2x3x8x8" in result.output
    assert "PASS" not in result.output and not out.exists()


# ---------------------------------------------------------------------------------------------------
# the other routes: layers, blocks, variants


def test_a_layer_holding_nan_is_the_first_divergent_with_where():
    from normswap.verify.layerwise import validate_models

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    broken = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken[0].bias[3] = math.inf
    report = validate_models(model, broken, [((torch.randn(2, 4),), {})], exact=True)
    assert not report.passed
    assert report.first_divergent == "0"
    first = report.layers[0]
    assert first.note == "the converted model's 0 holds Inf at [0, 3] (2 non-finite values)"
    assert report.failure == "the converted model's output holds Inf at [0, 0] (4 non-finite values)"


def test_blockwise_names_the_block_and_index_of_a_nan():
    from normswap.verify.blockwise import verify_blockwise_models

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model, broken = Net().eval(), Net().eval()
    with torch.no_grad():
        broken.layers[1].bias[2] = math.nan
    (report,) = verify_blockwise_models(model, broken, [((torch.randn(1, 4),), {})])
    assert not report.ok and report.first_divergent == "block 1"
    assert report.failure == "block 1: the converted model's block 1 holds NaN at [0, 2] (1 non-finite value)"


def test_a_variant_the_original_returns_nan_on_is_dropped_saying_where():
    from normswap.verify.variants import InputVariant, accepted_variants

    class NaNOnBatch3(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.log() if x.shape[0] == 3 else x

    x = -torch.ones(3, 2)
    probe = accepted_variants(NaNOnBatch3(), [InputVariant("batch 3", (x,))])
    assert not probe.accepted
    assert probe.rejected[0]["reason"] == (
        "the original's output holds NaN at [0, 0] (6 non-finite values): nothing was compared there"
    )


# ---------------------------------------------------------------------------------------------------
# calibration fits (item 3): a non-finite parameter is refused, at the library level


def test_an_affine_fit_on_activations_holding_nan_refuses():
    from normswap.calibrate.affine_fit import calibrate_swapped_norms
    from normswap.passes import Pipeline, SwapNorm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)).eval()
    x = torch.randn(4, 6)
    converted, _ = Pipeline([SwapNorm("rmsnorm")])(model, (x,), {})
    bad = torch.randn(4, 6)
    bad[1, 2] = math.nan
    before = {k: v.clone() for k, v in converted.state_dict().items()}
    with pytest.raises(
        CheckFailedError,
        match=r"calibration of 1 \(RMSNorm\): its inputs on the calibration data hold NaN at \[1, 0\] in batch 2 \(6 non-finite values\)",
    ):
        calibrate_swapped_norms(model, converted, ["1"], [x, bad])
    # nothing of the fit stays in the model
    assert all(torch.equal(before[k], v) for k, v in converted.state_dict().items())


def test_a_cosine_fit_on_activations_holding_inf_refuses():
    from normswap.calibrate.cosine_fit import calibrate_cosine_layers
    from normswap.passes.swap.cosine_layers import CosineLayers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)).eval()
    x = torch.randn(4, 6)
    converted, report = CosineLayers()(model, (x,), {})
    sites = [c.site for c in report.changes]
    assert sites
    bad = torch.randn(4, 6)
    bad[0, 0] = math.inf
    with pytest.raises(
        CheckFailedError,
        match=r"calibration of 0 \(CosineLinear\): its inputs .* hold Inf at \[0, 0\] in batch 2",
    ):
        calibrate_cosine_layers(model, converted, sites, [x, bad])


def test_batchnorm_recalibration_whose_held_out_outputs_hold_nan_is_not_ok():
    from normswap.calibrate.batchnorm import recalibrate_batchnorm

    class LogHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(x).log()  # NaN wherever the normalized value is negative

    torch.manual_seed(0)
    batches = [torch.randn(8, 3) for _ in range(3)]
    _, report = recalibrate_batchnorm(LogHead().eval(), batches)
    assert all(layer.finite for layer in report.layers)  # the statistics are finite ...
    # ... but the held-out comparison holds NaN (in the outputs before and after): it fails, saying where
    assert report.holdout.nonfinite.startswith("the original's output holds NaN at [")
    assert not report.ok


def test_a_fit_that_produces_a_nonfinite_parameter_from_finite_data_refuses_and_puts_back():
    from normswap.calibrate.affine_fit import fit_sites_in_order

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)).eval()
    converted = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)).eval()
    converted.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in converted.state_dict().items()}

    def diverging(module, inputs, targets):
        with torch.no_grad():
            module.weight[1] = math.inf
        return "fitted"

    with pytest.raises(
        CheckFailedError,
        match=r"calibration of 0 \(Linear\) produced a non-finite weight \(Inf at \[1, 0\]\) from finite data",
    ):
        fit_sites_in_order(model, converted, ["0", "2"], [torch.randn(3, 4)], diverging)
    assert all(torch.equal(before[k], v) for k, v in converted.state_dict().items())


def _tiny_convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("command", ["convert", "export", "validate", "inspect"])
def test_a_nan_in_the_example_inputs_is_the_files_not_the_models(tmp_path, command, value):
    """`--inputs` with a NaN pixel said "the model is broken" (convert, export) and "the original model is
    broken" (validate), and a +Inf pixel still did: both are held to the one rule for data, as every
    --data batch is (normswap.load.data_rules)."""
    images = torch.randn(1, 3, 8, 8)
    images[0, 1, 2, 3] = float(value)
    inputs = tmp_path / "in.pt"
    torch.save((images,), inputs)
    model = f"{HERE}:_tiny_convnet"
    argv = {
        "convert": ["convert", model, "--fold-bn", "-o", str(tmp_path / "out.pt2")],
        "export": ["export", model, "-o", str(tmp_path / "out.onnx")],
        "validate": ["validate", model, model],
        "inspect": ["inspect", model],
    }[command]
    result = _run(*argv, "--inputs", str(inputs))
    assert result.exit_code == 2, result.output
    said = (
        f"inputs file {inputs}: args[0] holds 1 NaN/Inf value(s), the first ({value}) at index [0, 1, 2, 3]"
    )
    assert said in (" ".join(result.output.split()))
    assert "broken" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def _convnet_with_an_infinite_example() -> tuple[nn.Module, tuple]:
    images = torch.randn(1, 3, 8, 8)
    images[0, 2, 1, 0] = float("inf")
    return _tiny_convnet(), (images,)


@pytest.mark.parametrize("command", ["convert", "validate", "inspect"])
def test_an_infinite_example_a_factory_carries_is_the_inputs_fault(tmp_path, command):
    """The rule held for an inputs file only: a factory's +Inf example made convert call the model
    broken, and validate the ORIGINAL; every route that resolves example inputs applies it."""
    model = f"{HERE}:_convnet_with_an_infinite_example"
    argv = {
        "convert": ["convert", model, "--fold-bn", "-o", str(tmp_path / "out.pt2")],
        "validate": ["validate", model, model],
        "inspect": ["inspect", model],
    }[command]
    result = _run(*argv)
    assert result.exit_code == 2, result.output
    said = f"the example inputs of {model}: args[0] holds 1 NaN/Inf value(s), the first (inf) at index [0, 2, 1, 0]"
    assert said in " ".join(result.output.split())
    assert "broken" not in result.output and list(tmp_path.iterdir()) == []


def test_an_infinite_example_a_python_caller_passes_is_the_inputs_fault():
    from normswap import ConvertConfig, convert

    model, (images,) = _convnet_with_an_infinite_example()
    with pytest.raises(BadInputError, match=r"^the example inputs of the model: args\[0\] holds 1 NaN/Inf"):
        convert(model, ConvertConfig(fold_bn=True), (images,))


def _transformer_encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def test_example_inputs_may_hold_an_additive_mask_of_minus_infinity(tmp_path):
    """torch's own causal mask (``generate_square_subsequent_mask``: -inf above the diagonal) is an
    example input, not broken data: only a NaN is refused in --inputs."""
    inputs = tmp_path / "in.pt"
    torch.save((torch.randn(2, 7, 16), nn.Transformer.generate_square_subsequent_mask(7)), inputs)
    result = _run("inspect", f"{HERE}:_transformer_encoder", "--inputs", str(inputs))
    assert result.exit_code == 0, result.output
    assert "4 norm sites: layer 4" in result.output
    # an additive bias with -Inf (ALiBi's negative slopes, masked): no value above 0, a mask too
    bias = -torch.arange(7.0).abs().expand(7, 7).clone()
    bias[torch.ones(7, 7, dtype=torch.bool).triu(1)] = float("-inf")
    torch.save((torch.randn(2, 7, 16), bias), inputs)
    result = _run("inspect", f"{HERE}:_transformer_encoder", "--inputs", str(inputs))
    assert result.exit_code == 0, result.output
