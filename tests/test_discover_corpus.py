"""Discovery on a corpus of hand-written norms (tests/norm_corpus.py): found whatever the written form,
with the right kind, dims, eps and affine; fused and swapped exactly; the non-norms left alone.

Each positive entry is checked three ways: ``find_norms`` reports exactly the declared norm under the
entry's module; the fuse pass for its kind of site (``FuseNorm`` for a module of its own, ``FuseGraphNorm``
for a norm inside a larger forward) replaces it and the model's output stays within 1e-5 x max|output|
on a fresh input; ``SwapNorm`` to the other kind builds exactly the other norm with the parameters the
entry declares (or refuses a norm that is no module, with the reason).
"""

from __future__ import annotations

import dataclasses
import math

import norm_corpus
import pytest
import torch
from norm_corpus import NEGATIVE, POSITIVE, Entry
from torch import nn

from normswap.discover import NormSite, find_norms
from normswap.graph import patterns
from normswap.graph.analysis import GraphView
from normswap.graph.capture import capture_graph
from normswap.kernels.reference import layer_norm_reference, rms_norm_reference
from normswap.passes import FuseGraphNorm, FuseNorm, SwapNorm
from normswap.util.tolerance import kernel_tolerance

EXACT = 1e-5  # fp32: max abs error <= EXACT x max|reference output| (DESIGN.md)
OTHER_KIND = {"layer": ("rmsnorm", "rms"), "rms": ("layernorm", "layer")}


def _sites(inventory) -> list[NormSite]:
    """The sites found in the entry's module (path "1"): the module itself or a norm inside it."""
    return [s for s in inventory if s.path == "1" or s.path.startswith(("1.", "1::"))]


def _fields(site: NormSite) -> dict:
    return {
        "kind": site.kind,
        "dims": site.normalized_dims,
        "eps": site.eps,
        # the record names the tensors (torch's classes: "weight" and "bias"); None when there is none
        "weight": site.weight_name,
        "bias": site.bias_name,
        "offset": site.weight_offset,
        "casting": site.casting,
        "source": "structural" if site.is_module else "pattern",
    }


def _expected(entry: Entry) -> dict:
    return {
        "kind": entry.kind,
        "dims": entry.dims,
        "eps": entry.eps,
        "weight": entry.weight,
        "bias": entry.bias,
        "offset": entry.offset,
        "casting": entry.casting,
        "source": entry.source,
    }


def _same(got: dict, want: dict) -> bool:
    eps_ok = (got["eps"] is None) == (want["eps"] is None) and (
        got["eps"] is None or math.isclose(got["eps"], want["eps"], rel_tol=1e-9, abs_tol=0.0)
    )
    rest = {k: v for k, v in got.items() if k != "eps"} == {k: v for k, v in want.items() if k != "eps"}
    return eps_ok and rest


def found_problem(entry: Entry) -> str | None:
    """None when discovery reports exactly the entry's declared norm (or, for a negative, nothing)."""
    model, args = entry.model(), entry.inputs()
    sites = _sites(find_norms(model, args))
    got = [_fields(s) for s in sites]
    if entry.kind is None:
        return None if not got else f"found {got}"
    if len(got) == 1 and _same(got[0], _expected(entry)):
        return None
    return f"found {got}, want {_expected(entry)}"


def _close(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The error relative to max|want|, or None when the shapes differ."""
    if got.shape != want.shape:
        return None
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def fused_problem(entry: Entry) -> str | None:
    """None when the entry's norm is fused and the model's output is unchanged within EXACT."""
    model, args = entry.model(), entry.inputs()
    if entry.source == "pattern":
        converted, report = FuseGraphNorm()(model, args)
    else:
        converted, report = FuseNorm()(model, args)
    changed = [c for c in report.changes if c.site == "1" or c.site.startswith(("1.", "1::"))]
    if len(changed) != 1:
        return f"{len(changed)} changes; skips: {[(s.site, s.reason) for s in report.skips]}"
    x = entry.inputs(seed=7)  # another input than the one the pass measured on
    with torch.no_grad():
        error = _close(converted(*x), model(*x))
    if error is None or error > EXACT:
        return f"output moved by {error} x max|output|"
    return None


def _reference(kind: str, entry: Entry, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``kind`` norm of ``h`` over the entry's dims with the entry's own eps, weight, bias and offset."""
    weight = getattr(module, entry.weight) + entry.offset if entry.weight else None
    bias = getattr(module, entry.bias) if entry.bias else None
    assert entry.eps is not None and len(entry.dims) == 1
    moved = h.movedim(entry.dims[0], -1)
    norm = rms_norm_reference if kind == "rms" else layer_norm_reference
    return norm(moved, 1, weight, bias, entry.eps).movedim(-1, entry.dims[0])


@pytest.mark.parametrize("entry", POSITIVE, ids=lambda e: e.name)
def test_found_with_its_kind_dims_eps_and_affine(entry):
    assert found_problem(entry) is None, found_problem(entry)


@pytest.mark.parametrize("entry", POSITIVE, ids=lambda e: e.name)
def test_fused_exactly(entry):
    problem = fused_problem(entry)
    assert problem is None, problem


@pytest.mark.parametrize("entry", POSITIVE, ids=lambda e: e.name)
def test_swapped_to_the_other_kind_with_its_own_parameters(entry):
    model, args = entry.model(), entry.inputs()
    target, kind = OTHER_KIND[entry.kind]
    swapped, report = SwapNorm(target)(model, args)
    if entry.source == "pattern":
        assert report.changes == []
        assert [s.reason for s in report.skips] == [
            "pattern norm computed inside a forward, not a module: swapping it needs a graph rewrite"
        ]
        return
    assert [c.site for c in report.changes] == ["1"], report.skips
    with torch.no_grad():
        h = model[0](*entry.inputs(seed=7))
        error = _close(swapped[1](h), _reference(kind, entry, model[1], h))
    assert error is not None and error <= EXACT, error


@pytest.mark.parametrize("entry", NEGATIVE, ids=lambda e: e.name)
def test_not_a_norm(entry):
    model, args = entry.model(), entry.inputs()
    assert found_problem(entry) is None, f"{entry.why}: {found_problem(entry)}"
    converted, report = FuseGraphNorm()(model, args)
    assert report.changes == [] and converted is model


def test_a_computed_modulation_is_not_the_norms_affine():
    """AdaLN: the parameter-free LayerNorm is fused; the scale and shift computed from the input stay."""
    entry = next(e for e in POSITIVE if e.name == "adaptive_layernorm_core")
    model, args = entry.model(), entry.inputs()
    converted, report = FuseGraphNorm()(model, args)
    (change,) = report.changes
    assert (change.details["kind"], change.details["eps"]) == ("layer", 1e-6)
    graph = converted.graph
    fused = next(n for n in graph.nodes if "fused_norm" in str(n.target))
    assert fused.args[1:] == (None, None)  # no weight, no bias: the modulation is applied after it


def test_a_misread_eps_is_refused_by_running_the_norm():
    """The confirmation compares with the eps read off the graph, on rows whose mean square is near it."""
    entry = next(e for e in POSITIVE if e.name == "pow_minus_half")
    model, args = entry.model(), entry.inputs()
    view = GraphView(capture_graph(model, args))
    (match,) = patterns.find_norm_patterns(view, model)
    values = patterns.TensorValues(view, model)
    assert patterns.confirm_norm(view, values, match, match.nodes, centered=False, clamped=False)
    for eps in (2 * entry.eps, entry.eps / 2, 0.0):
        misread = dataclasses.replace(match, eps=eps)
        assert (
            patterns.confirm_norm(view, values, misread, match.nodes, centered=False, clamped=False) is False
        )
    # read as a LayerNorm it is refused too: the input's mean is not removed
    assert patterns.confirm_norm(view, values, match, match.nodes, centered=True, clamped=False) is False


# Casting modes are only visible in half precision: there the casts round.
BF16_CASTING = {
    "llama_casts": "llama",
    "t5_fp32_variance": "llama",  # T5 casts to the (half) weight dtype before the weight multiply
    "gemma_one_plus_w": "gemma",
    "olmo_nonparametric_rmsnorm": "none",
}


@pytest.mark.parametrize("name", list(BF16_CASTING))
def test_casting_modes_in_bfloat16(name):
    entry = next(e for e in POSITIVE if e.name == name)
    model = entry.model().to(torch.bfloat16)
    args = tuple(a.to(torch.bfloat16) for a in entry.inputs())
    (site,) = _sites(find_norms(model, args))
    assert (site.casting, site.dtype) == (BF16_CASTING[name], "bfloat16")
    converted, report = FuseNorm()(model, args)
    assert [c.site for c in report.changes] == ["1"], report.skips
    x = tuple(a.to(torch.bfloat16) for a in entry.inputs(seed=7))
    with torch.no_grad():
        want, got = model(*x), converted(*x)
    atol, rtol = kernel_tolerance(torch.bfloat16)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_the_corpus_is_broad_enough():
    assert len(POSITIVE) >= 20 and len(NEGATIVE) >= 8
    assert len({e.name for e in POSITIVE + NEGATIVE}) == len(POSITIVE + NEGATIVE)
    assert norm_corpus.WIDTH != norm_corpus.CHANNELS  # a norm over the wrong dim would not fit
