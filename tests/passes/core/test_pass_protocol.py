"""The one pass protocol: one driver runs every pass, and what it promises holds for all of them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from test_rewrites import config_asking_for
from torch import fx, nn

import normswap.passes as passes
from normswap import rewrites
from normswap.graph.capture import capture_graph
from normswap.passes import (
    Change,
    FoldBatchNorm,
    FuseGraphNorm,
    Needs,
    Pass,
    PassContext,
    Pipeline,
    Refusal,
    RewriteKind,
    SkipCause,
)


def _pass_classes() -> list[type[Pass]]:
    found = [obj for obj in vars(passes).values() if isinstance(obj, type) and issubclass(obj, Pass)]
    return [cls for cls in found if cls is not Pass]


def test_every_pass_is_the_protocol_and_has_one_driver():
    classes = _pass_classes()
    # every pass is one the registry's rewrites build, and every such pass is exported (no hand-kept list)
    built = {p.name for entry in rewrites.REWRITES for p in config_asking_for(entry).passes()}
    assert {cls.name for cls in classes} == built
    for cls in classes:
        assert cls.__call__ is Pass.__call__, f"{cls.__name__} has a driver of its own"
    needs = {cls.name: cls.needs for cls in classes}
    assert needs["add_weight_norm"] is needs["remove_weight_norm"] is Needs.PARAMETERS
    assert needs["fuse_add_norm"] is needs["fuse_graph_norm"] is needs["defer_rms"] is Needs.EXPORTED_GRAPH
    assert needs["compress_stream"] is Needs.EXPORTED_GRAPH
    assert sum(n is Needs.GRAPH for n in needs.values()) == 7


# --- the driver, seen through a pass written for the test ------------------------------------------


@dataclass(frozen=True)
class _Layer:
    path: str


@dataclass(frozen=True)
class _Scale:
    site: _Layer
    factor: float


@dataclass
class _Run:
    prepared: int = 0
    checked: int = 0
    captured: object = None


class _DoubleBias(Pass[_Layer, _Scale, _Run]):
    """Doubles every Linear's bias; refuses one without a bias (a reason) and one named "frozen" (a
    refusal with its cause). Counts what the driver calls, in the state it prepared."""

    name = "double_bias"
    kind = RewriteKind.ARCHITECTURAL
    runs: list[_Run]

    def __init__(self, needs: Needs = Needs.GRAPH) -> None:
        self.needs = needs  # type: ignore[misc]
        self.runs = []

    def prepare(self, ctx: PassContext) -> _Run:
        run = _Run(prepared=1, captured=ctx.captured)
        self.runs.append(run)
        return run

    def candidates(self, ctx: PassContext, state: _Run) -> list[_Layer]:
        return [_Layer(p) for p, m in ctx.modules.items() if isinstance(m, nn.Linear)]

    def check(self, site: _Layer, ctx: PassContext, state: _Run) -> _Scale | Refusal | str:
        state.checked += 1
        if site.path == "frozen":
            return Refusal("frozen on purpose", SkipCause.ARCHITECTURE)
        if ctx.model.get_submodule(site.path).bias is None:
            return "no bias"
        return _Scale(site, 2.0)

    def apply(self, plan: _Scale, ctx: PassContext, state: _Run) -> Change:
        with torch.no_grad():
            ctx.model.get_submodule(plan.site.path).bias.mul_(plan.factor)
        return Change(self.name, plan.site.path, self.kind, f"bias x {plan.factor:g}")


def _three_linears() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 4))
    model.add_module("frozen", nn.Linear(4, 4))
    model.add_module("c", nn.Linear(4, 4, bias=False))
    return model


@pytest.mark.parametrize("needs", [Needs.GRAPH, Needs.PARAMETERS])
def test_the_driver_prepares_once_checks_every_site_and_reports_each(needs):
    model = _three_linears()
    bias = model.a.bias.detach().clone()
    p = _DoubleBias(needs)
    out, report = p(model, (torch.randn(2, 4),))
    assert [(c.site, c.description) for c in report.changes] == [("a", "bias x 2")]
    assert [(s.site, s.reason, s.cause) for s in report.skips] == [
        ("frozen", "frozen on purpose", SkipCause.ARCHITECTURE),
        ("c", "no bias", None),
    ]
    assert [(r.prepared, r.checked) for r in p.runs] == [(1, 3)]
    # not in place: the input is untouched, the copy changed
    assert out is not model and torch.equal(model.a.bias, bias) and torch.equal(out.a.bias, 2 * bias)
    # a parameters pass captures nothing; a graph pass reports how it captured
    assert report.graph_method == (None if needs is Needs.PARAMETERS else "export")
    same, _ = p(model, (torch.randn(2, 4),), inplace=True)
    assert same is model and torch.equal(model.a.bias, 2 * bias)
    assert len(p.runs) == 2  # state belongs to a run: the second run prepared its own


@pytest.mark.parametrize(("needs", "reused"), [(Needs.GRAPH, True), (Needs.PARAMETERS, False)])
def test_the_pipeline_hands_a_captured_graph_to_a_first_pass_that_reuses_it(needs, reused):
    model = _three_linears()
    x = torch.randn(2, 4)
    captured = capture_graph(model, (x,))
    p = _DoubleBias(needs)
    assert p.reuses_capture is reused
    _, report = Pipeline([p])(model, (x,), captured=captured)
    assert (p.runs[0].captured is captured) is reused
    assert report.passes[0].changes[0].site == "a"


# --- passes that edit an exported graph -------------------------------------------------------------


class _InlineNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(self.proj(x), (8,), self.w)


def test_an_exported_graph_pass_without_inputs_refuses_the_whole_model():
    model = _InlineNorm()
    out, report = FuseGraphNorm()(model)
    assert out is model and report.changes == []
    assert [(s.site, s.cause) for s in report.skips] == [("<model>", SkipCause.CAPTURE)]
    assert (
        report.graph_error == "no example inputs: fusing norms inside other forwards needs a captured graph"
    )


@pytest.mark.parametrize("inplace", [False, True])
def test_an_exported_graph_pass_never_edits_the_model_it_was_given(inplace):
    torch.manual_seed(0)
    model = _InlineNorm().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
    out, report = FuseGraphNorm()(model, (x,), inplace=inplace)
    assert [c.site for c in report.changes] == ["<root>::layer_norm"]
    assert isinstance(out, fx.GraphModule) and type(model) is _InlineNorm
    assert "forward" not in vars(model)
    with torch.no_grad():
        torch.testing.assert_close(out(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(x), want, atol=0, rtol=0)
    # in place, the result shares the parameter tensors (no copy); otherwise it owns its own
    assert (out.get_parameter("proj.weight") is model.proj.weight) is inplace
    assert torch.equal(out.get_parameter("proj.weight"), model.proj.weight)


# --- state travels in the plan: nothing is worked out twice ----------------------------------------


class _ConvThenCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("rm", 0.5 * torch.randn(4))
        self.register_buffer("rv", torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.conv(x), self.rm, self.rv, None, None, False, 0.1, 1e-5)


def test_a_functional_batchnorm_owner_is_traced_once(monkeypatch):
    match = importlib.import_module("normswap.passes.batchnorm.match")
    traced = []
    real = match._owner_graph

    def counting(owner):
        traced.append(type(owner).__name__)
        return real(owner)

    monkeypatch.setattr(match, "_owner_graph", counting)
    torch.manual_seed(0)
    model = nn.Sequential(_ConvThenCall(), nn.ReLU(), _ConvThenCall()).eval()
    x = torch.randn(2, 3, 6, 6)
    model[2].conv = nn.Conv2d(4, 4, 1)
    with torch.no_grad():
        want = model(x)
    out, report = FoldBatchNorm()(model, (x,))
    assert [c.site for c in report.changes] == ["0::batch_norm", "2::batch_norm_1"]
    assert traced == ["_ConvThenCall", "_ConvThenCall"]  # one trace per call: the check's, applied as is
    with torch.no_grad():
        torch.testing.assert_close(out(x), want, atol=1e-5, rtol=1e-5)
