"""One exact rule for convert and validate (issue 29, item 16): ``normswap.verify.exact.judge_exact``.

The model here is ill-conditioned on purpose (its first output is the small difference of two nearly
equal linear maps), so fp32's own rounding is far beyond the table's 1e-5 x max|output| and the rule's
second half decides: the rewrite's error norm from the fp64 run against the original's own. A LayerNorm
swapped for normswap's fused one computes the same function with other roundings; on single rows its
largest error is sometimes more than twice the original's (the old per-input "max error" rule then
refused a correct rewrite, by the luck of the row), over the batch the two are the same.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

from normswap.passes import FoldBatchNorm, FuseNorm, Pipeline
from normswap.verify.layerwise import validate_models

HERE = str(Path(__file__))
ROWS, WIDTH = 300, 64


class IllConditioned(nn.Module):
    """LayerNorm, then (a(h) - b(h), a(h)) with b = a + 1e-5 noise: the first output cancels."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ln = nn.LayerNorm(WIDTH)
        self.a = nn.Linear(WIDTH, 8, bias=False)
        self.b = nn.Linear(WIDTH, 8, bias=False)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)
            self.b.weight.copy_(self.a.weight + 1e-5 * torch.randn_like(self.a.weight))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln(x)
        return self.a(h) - self.b(h), self.a(h)


def _rows(seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed)) * 3 + 1


def ill_factory() -> tuple[nn.Module, tuple]:
    return IllConditioned().eval(), (_rows(),)


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def _old_rule_on_one_row(model: nn.Module, converted: nn.Module, row: torch.Tensor) -> bool:
    """The rule convert used before: on one input, the rewrite's largest error from fp64 at most twice
    the original's (a max over one row's values)."""
    wide = IllConditioned().double()
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref = wide(row.double())[0]
        before, after = model(row)[0].double(), converted(row)[0].double()
    scale = float(ref.abs().max())
    return float((after - ref).abs().max()) / scale <= 2 * float((before - ref).abs().max()) / scale


def test_a_fused_layernorm_as_accurate_as_torch_passes_convert_and_validate_on_every_seed():
    old_rule_refused = []
    for seed in range(6):
        model, x = IllConditioned(seed).eval(), _rows(seed)
        converted, report = Pipeline([FuseNorm()])(model, (x,), {})
        assert type(converted.ln).__name__ == "FusedLayerNorm"
        validation = report.passes[0].validation
        # the table cannot decide (fp32's own rounding is far beyond it) ...
        assert not validation["within_tolerance"]
        # ... the rounding rule, over every row of every input, does: as accurate as the original
        assert report.ok, (seed, report.exact_failures)
        rounding = validation["rounding"]
        assert (
            rounding["dtype"] == "fp64"
            and 0.8 < rounding["rewritten_rel_error"] / rounding["original_rel_error"] < 1.25
        )
        # validate --exact applies the same rule and agrees
        checked = validate_models(model, converted, [((x,), {})], exact=True)
        assert checked.passed, (seed, checked.failure)
        old_rule_refused += [seed for row in x[:20] if not _old_rule_on_one_row(model, converted, row[None])]
    # the old rule, decided on one row (the batch-1 variant), refused this correct rewrite by chance
    assert old_rule_refused


def test_convert_and_validate_agree_on_the_command_line(tmp_path):
    out = tmp_path / "fused.pt2"
    result = _run("convert", f"{HERE}:ill_factory", "--to", "fused", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "judged against the model in fp64" in result.output
    result = _run("validate", f"{HERE}:ill_factory", str(out), "--exact")
    assert result.exit_code == 0, result.output
    assert "verdict (exact tolerance): PASS" in result.output


# the same failure sentence, from either command
WRONG = re.compile(
    r"^(fold_batchnorm: )?output moved by \S+ \(\S+ x max\|ref\|, tolerance 1e-05\) on .*; against the model "
    r"in fp64, its error norm over \d+ inputs? is \S+x the original's own \(allowed: 2x\)$"
)


def test_a_rewrite_with_a_weight_moved_by_1e_3_fails_convert_and_validate_with_the_same_reason(monkeypatch):
    fold = importlib.import_module("normswap.passes.batchnorm.group")
    real = fold.fold_bn_into_conv_weights

    def wrong(weight, bias, scale, shift, out_channel_dim=0):
        w, b = real(weight, bias, scale, shift, out_channel_dim)
        return w * (1 + 1e-3), b

    monkeypatch.setattr(fold, "fold_bn_into_conv_weights", wrong)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 12, 12)
    converted, report = Pipeline([FoldBatchNorm()])(model, (x,), {})
    assert not report.ok and WRONG.search(report.exact_failures[0]), report.exact_failures
    checked = validate_models(model, converted, [((x,), {})], exact=True)
    assert not checked.passed and WRONG.search(checked.failure), checked.failure
