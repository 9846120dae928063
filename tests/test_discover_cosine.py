"""Discovery of cosine-normalized layers however they are written (normswap.discover.cosine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normswap.discover.cosine import find_cosine_sites
from normswap.modules.cosine import CosineConv, CosineLinear
from normswap.passes import CosineLayers


class NormalizeHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x) @ F.normalize(self.W).T


class DividedHead(NormalizeHead):
    """Norms divided after the product, a learned scalar temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor(10.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * (x @ self.W.T) / (x.norm(dim=-1, keepdim=True) * self.W.norm(dim=1))


class SimilarityHead(NormalizeHead):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cosine_similarity(x.unsqueeze(1), self.W.unsqueeze(0), dim=-1)


class CosineSubclass(nn.Linear):
    """An nn.Linear subclass with its own forward: rsqrt with eps, weight stored (out, in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-8)
        return F.linear(x, self.weight / self.weight.norm(dim=1, keepdim=True))


class LinearThenRMSNorm(nn.Module):
    """Scale-invariant in its input, but not a cosine: must not be taken."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.n = nn.Linear(8, 5, bias=False), nn.RMSNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(self.l(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.a, self.b, self.c = NormalizeHead(), DividedHead(), SimilarityHead()
        self.d, self.e, self.f = CosineSubclass(8, 5), CosineLinear(8, 5), LinearThenRMSNorm()
        self.conv, self.cc = nn.Conv2d(3, 8, 3), CosineConv(3, 4, (3, 3), (1, 1), (1, 1), (1, 1))
        self.W = nn.Parameter(torch.randn(3, 8))

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.body(x).relu()
        inline = (
            F.normalize(h, dim=-1, eps=1e-6) @ F.normalize(self.W, dim=-1).T * 4.0
        )  # in the root's forward
        heads = (self.a(h), self.b(h), self.c(h), self.d(h), self.e(h), self.f(h))
        return (*heads, inline, self.cc(img), self.conv(img))


@pytest.fixture(scope="module")
def sites() -> dict[str, object]:
    found = find_cosine_sites(Net(), (torch.randn(4, 8), torch.randn(2, 3, 6, 6)))
    return {s.path: s for s in found}


def test_every_written_form_is_found_and_nothing_else(sites):
    assert set(sites) == {"a", "b", "c", "d", "e", "cc", ""}


def test_what_each_site_says(sites):
    assert sites["a"].scale == "none" and sites["a"].source == "module"
    assert sites["b"].scale == "scalar"
    assert sites["d"].class_name == "CosineSubclass" and sites["d"].weight_name == "d.weight"
    assert sites["e"].augmented and sites["cc"].augmented and sites["cc"].conv
    assert sites[""].source == "pattern" and sites[""].weight_name == "W" and sites[""].scale == "scalar"


def test_converted_layers_are_found_with_their_fitted_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    x = torch.randn(6, 8)
    converted, report = CosineLayers()(model, (x,))
    assert [c.site for c in report.changes] == ["0"]
    assert [(s.path, s.scale, s.augmented) for s in find_cosine_sites(converted, (x,))] == [
        ("0", "per-output", True)
    ]
    assert find_cosine_sites(model, (x,)) == []


FACTORY = """
import torch
import torch.nn.functional as F
from torch import nn


class CosineClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
        self.weight = nn.Parameter(torch.randn(10, 16))
        self.temperature = nn.Parameter(torch.tensor(16.0))

    def forward(self, x):
        return self.temperature * F.normalize(self.body(x)) @ F.normalize(self.weight).T


def build():
    torch.manual_seed(0)
    return CosineClassifier(), (torch.randn(2, 8),)
"""


def test_inspect_lists_cosine_layers(tmp_path):
    import json

    from normswap_cli.app import app
    from typer.testing import CliRunner

    factory = tmp_path / "heads.py"
    factory.write_text(FACTORY)
    report = tmp_path / "sites.json"
    result = CliRunner().invoke(app, ["inspect", f"{factory}:build", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "cosine-normalized layer: <root> (CosineClassifier, pattern): 10 outputs of weight, one scale" in (
        result.output
    )
    layers = json.loads(report.read_text())["cosine_layers"]
    assert [(c["path"], c["weight_name"], c["scale"], c["out_features"]) for c in layers] == [
        ("", "weight", "scalar", 10)
    ]


def test_a_frozen_batchnorm_mobilenet_is_searched_without_crashing():
    """timm's mobilenetv3 (efficientnet alike) with its BatchNorms frozen (freeze_batch_norm_2d): a
    candidate whose 'bias' is not the conv's made the cosine reference conv raise (inspect exited 3)."""
    timm = pytest.importorskip("timm")
    from timm.layers import freeze_batch_norm_2d

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=5)
    model = freeze_batch_norm_2d(model).eval()
    assert find_cosine_sites(model, (torch.randn(1, 3, 32, 32),)) == []
