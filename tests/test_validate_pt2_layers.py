"""validate on a .pt2 never compares layer outputs of different shapes (issue 29, item 17): a Conv1d
subclass whose forward reshapes comes back from the .pt2 as a plain Conv1d, hooked before the reshape;
its outputs are listed as not compared, with the reason, never as a divergence with "SQNR nan"."""

from __future__ import annotations

from pathlib import Path

import torch
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

from normswap.load import save_model
from normswap.load.model_file import load_model
from normswap.verify.layerwise import validate_models

HERE = str(Path(__file__))


class ToeplitzLinear(nn.Conv1d):
    """A linear map with a Toeplitz matrix, as a 1-channel conv1d over the features (pesto-pitch's)."""

    def __init__(self, features: int, out_features: int) -> None:
        super().__init__(1, 1, kernel_size=features + out_features - 1, padding=out_features - 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.unsqueeze(-2)).squeeze(-2)


class Pitch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.fc = ToeplitzLinear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)).softmax(-1)


def pitch_factory() -> tuple[nn.Module, tuple]:
    return Pitch().eval(), (torch.randn(4, 16, generator=torch.Generator().manual_seed(0)),)


def test_an_unchanged_model_saved_as_pt2_validates_with_no_divergent_layer(tmp_path):
    model, args = pitch_factory()
    save_model(model, tmp_path / "p.pt2", args, {})
    loaded = load_model(str(tmp_path / "p.pt2")).model
    assert type(loaded.get_submodule("fc")) is nn.Conv1d  # the subclass comes back plain
    report = validate_models(model, loaded, [(args, {})], exact=True, norm_paths=["norm"])
    assert report.passed and report.first_divergent is None
    assert [layer.path for layer in report.layers] == ["norm"]
    assert report.skipped_layers == [
        {
            "path": "fc",
            "reason": "its outputs differ in shape (4x12 in the original, 4x1x12 in the converted Conv1d): "
            "the final outputs are compared, not this layer",
        }
    ]


def test_cli_validate_of_a_pt2_lists_no_false_divergence(tmp_path):
    out = tmp_path / "p.pt2"
    model, args = pitch_factory()
    save_model(model, out, args, {})
    result = CliRunner().invoke(app, ["validate", f"{HERE}:pitch_factory", str(out), "--exact"])
    assert result.exit_code == 0, result.output
    assert "none diverges past the exact tolerance" in result.output
    assert "first divergent" not in result.output and "nan" not in result.output.lower()
    assert "not compared: fc: its outputs differ in shape" in result.output
    assert "verdict (exact tolerance): PASS" in result.output
