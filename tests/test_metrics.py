"""compare_tensors sums its figures over slices of rows: the same figures as on the whole tensor in
float64, whatever the slicing, for outputs larger than one slice."""

from __future__ import annotations

import math

import pytest
import torch

from normswap.verify.metrics import compare_tensors


def _whole(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    r, o = ref.double(), out.double()
    diff = r - o
    return {
        "max_abs": float(diff.abs().max()),
        "max_ref": float(r.abs().max()),
        "sqnr_db": float(20 * torch.log10(r.norm() / diff.norm())),
        "cosine": float((r.flatten() @ o.flatten()) / (r.norm() * o.norm())),
        "top1": float((r.argmax(-1) == o.argmax(-1)).double().mean()),
    }


@pytest.mark.parametrize(
    "shape", [(3, 700, 1601), (2, 5_000_001), (4_000_000,)], ids=["logits", "wide", "1d"]
)
def test_figures_over_slices_are_the_figures_of_the_whole(shape):
    torch.manual_seed(0)
    ref = torch.randn(shape)
    out = ref + 1e-3 * torch.randn(shape)
    out.view(-1)[12345] += 0.5  # one large error, in some slice
    got = compare_tensors("logits", ref, out)
    want = _whole(ref, out)
    assert got.max_abs == want["max_abs"] and got.max_ref == want["max_ref"]
    assert math.isclose(got.sqnr_db, want["sqnr_db"], rel_tol=1e-9)
    assert math.isclose(got.cosine, want["cosine"], rel_tol=1e-12)
    if len(shape) >= 2:
        assert math.isclose(got.top1_agreement, want["top1"], rel_tol=1e-12)
    else:
        assert got.top1_agreement is None
    assert not got.within_tolerance


def test_identical_zero_scalar_and_integer_outputs():
    same = compare_tensors("x", torch.ones(2, 3), torch.ones(2, 3))
    assert (same.max_abs, same.sqnr_db, same.cosine, same.within_tolerance) == (0.0, math.inf, 1.0, True)
    zero = compare_tensors("z", torch.zeros(4), torch.full((4,), 1e-3))
    assert zero.sqnr_db == -math.inf and zero.cosine == 0.0 and zero.max_rel == math.inf
    scalar = compare_tensors("loss", torch.tensor(2.0), torch.tensor(2.5))
    assert scalar.max_abs == 0.5 and scalar.shape == ()
    ids = compare_tensors("ids", torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]]))
    assert ids.mismatched == 1 and not ids.within_tolerance
    empty = compare_tensors("e", torch.zeros(0, 5), torch.zeros(0, 5))
    assert empty.max_abs == 0.0 and empty.within_tolerance
    with pytest.raises(ValueError, match="changed shape: \\(2, 3\\) -> \\(3, 2\\)"):
        compare_tensors("x", torch.ones(2, 3), torch.ones(3, 2))
