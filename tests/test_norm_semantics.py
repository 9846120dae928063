"""One record of each norm's semantics: computed once by discovery, read by every pass.

nn.RMSNorm(eps=None) records the eps torch really adds for the dtype it runs in; FuseNorm and SwapNorm
build from that record (the fused model matches torch within the kernel tolerance table; the swapped
LayerNorm carries the same eps); HF Llama and Gemma norms record their eps, casting and (1 + w) offset;
a hand-written norm with its own parameter names is fused from the record, with no second capture; and
one vocabulary of kinds runs from the command line's spellings to the JSON.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from normswap.discover import NormKind, NormSemantics, find_norms
from normswap.kernels.reference import rms_norm_reference
from normswap.modules import LayerNorm
from normswap.modules.fused import FusedLayerNorm, FusedRMSNorm
from normswap.modules.semantics import (
    CONVERT_TARGETS,
    SWAP_TARGETS,
    declared_semantics,
    default_rms_eps,
    parse_target,
)
from normswap.passes import FuseNorm, SwapNorm, swap_norm
from normswap.util.tolerance import kernel_tolerance

HALF = [torch.bfloat16, torch.float16]
WIDTH = 16


def _small_rows(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows whose mean square (~1e-8 .. 1e-3) is of the order of the candidate eps values, so that a
    wrong eps moves the output far beyond any tolerance (and normal numbers in fp16)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, -1.5, 8, dtype=torch.float64)[:, None]
    return (torch.randn(8, WIDTH, generator=g, dtype=torch.float64) * scale).to(dtype)


def _rms_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.RMSNorm(WIDTH, eps=None))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def _other_candidates(eps: float, dtype: torch.dtype) -> list[float]:
    values = {torch.finfo(dtype).eps, torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps}
    return sorted(values - {eps})


@pytest.mark.parametrize("dtype", [*HALF, torch.float32, torch.float64], ids=str)
def test_rmsnorm_without_eps_records_the_eps_torch_applies(dtype):
    model, x = _rms_model(dtype), _small_rows(dtype)
    site = find_norms(model, (x,)).by_path("1")
    assert site.kind is NormKind.RMS and site.source == "module"
    assert site.dtype == str(dtype).removeprefix("torch.")
    assert site.eps == default_rms_eps(dtype)
    # fp64 runs in fp64: its own machine epsilon, not fp32's (which discovery used to report)
    if dtype == torch.float64:
        assert site.eps == torch.finfo(torch.float64).eps == 2.220446049250313e-16
    # the recorded eps reproduces torch's output; every other candidate eps does not
    with torch.no_grad():
        want = model(x).double()
        weight = model[1].weight

        def error(eps: float) -> float:
            return float((rms_norm_reference(x, 1, weight, None, eps).double() - want).abs().max())

        atol, _ = kernel_tolerance(dtype)
        assert error(site.eps) <= atol / 10
        for other in _other_candidates(site.eps, dtype):
            assert error(other) > 10 * atol, other


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_fuse_norm_takes_a_half_precision_rmsnorm_without_eps(dtype):
    model, x = _rms_model(dtype), _small_rows(dtype)
    eps = find_norms(model, (x,)).by_path("1").eps
    converted, report = FuseNorm()(model, (x,))
    assert report.skips == [] and [c.site for c in report.changes] == ["1"]
    fused = converted[1]
    assert type(fused) is FusedRMSNorm and fused.eps == eps == default_rms_eps(dtype)
    assert report.changes[0].details["eps"] == eps
    atol, rtol = kernel_tolerance(dtype)
    with torch.no_grad():
        got, want = converted(x), model(x)
        for fresh in (_small_rows(dtype, seed=1), torch.randn(5, WIDTH).to(dtype)):
            torch.testing.assert_close(converted(fresh), model(fresh), atol=atol, rtol=rtol)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert report.changes[0].details["max_abs_diff"] <= atol
    converted.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("dtype", [*HALF, torch.float64], ids=str)
def test_swap_to_layernorm_keeps_the_applied_eps(dtype):
    model, x = _rms_model(dtype), _small_rows(dtype)
    eps = find_norms(model, (x,)).by_path("1").eps
    swapped, report = swap_norm(model, "layernorm", (x,))
    new = swapped[1]
    assert report.skips == [] and isinstance(new, LayerNorm)
    assert new.eps == eps == default_rms_eps(dtype) and new.bias is None
    assert new.weight.dtype == dtype
    # on centered rows a LayerNorm is the RMSNorm: same numbers when, and only when, eps is the same
    xc = (x.double() - x.double().mean(-1, keepdim=True)).to(dtype)
    atol, rtol = kernel_tolerance(dtype)
    with torch.no_grad():
        torch.testing.assert_close(new(xc), model(xc), atol=atol / 10, rtol=rtol)


def _llama(eps: float) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
        rms_norm_eps=eps,
    )
    return LlamaForCausalLM(config).eval()


def _gemma(eps: float) -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    config = GemmaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
        max_position_embeddings=32,
        rms_norm_eps=eps,
    )
    return GemmaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("build", "eps", "casting", "offset"),
    [(_llama, 3e-5, "llama", 0.0), (_gemma, 2e-6, "gemma", 1.0)],
    ids=["llama", "gemma"],
)
def test_hf_rmsnorm_records(build, eps, casting, offset):
    model = build(eps)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    inventory = find_norms(model, (ids,), {"use_cache": False})
    sites = [s for s in inventory if s.is_module]
    assert [s.path for s in sites] == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.norm",
    ]
    for site in sites:
        want = NormSemantics(
            kind=NormKind.RMS,
            normalized_shape=(32,),
            normalized_dims=(-1,),
            eps=eps,
            dtype="float32",
            affine=True,
            weight_name="weight",
            casting=casting,
            weight_offset=offset,
        )
        assert site.semantics == want, site.path
        assert site.source == "structural"
        assert json.loads(json.dumps(site.to_dict()))["kind"] == "rms"


class GainShiftLayerNorm(nn.Module):
    """A LayerNorm written out by hand, keeping its affine under names no library uses."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(1 + 0.3 * torch.randn(dim))
        self.shift = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(-1, keepdim=True)
        return centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-3) * self.gain + self.shift


def test_hand_written_names_come_from_the_record_without_a_second_capture(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), GainShiftLayerNorm(WIDTH), nn.Linear(WIDTH, 4)).eval()
    x = torch.randn(3, WIDTH)
    captured = []
    export = torch.export.export

    def counting_export(module, *args, **kwargs):
        captured.append(module)
        return export(module, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting_export)
    converted, report = FuseNorm()(model, (x,))
    # one capture, of (a copy of) the whole model, by discovery: the norm's module is not captured again
    assert [type(m) for m in captured] == [nn.Sequential]
    assert [c.site for c in report.changes] == ["1"] and report.skips == []
    fused = converted[1]
    assert type(fused) is FusedLayerNorm and fused.eps == 1e-3
    assert [n for n, _ in fused.named_parameters()] == ["gain", "shift"]
    assert fused.weight is fused.gain and fused.bias is fused.shift
    torch.testing.assert_close(fused.gain, model[1].gain, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), model(x), atol=1e-5, rtol=1e-5)
    converted.load_state_dict(model.state_dict(), strict=True)


def test_fused_modules_are_built_from_the_record_alone():
    """A record naming other parameters than the module's: the fused module follows the record."""
    torch.manual_seed(0)
    module = GainShiftLayerNorm(8)
    record = NormSemantics(
        kind="layer",
        normalized_shape=(8,),
        normalized_dims=(-1,),
        eps=0.25,
        affine=True,
        bias=True,
        weight_name="gain",
        bias_name="shift",
    )
    fused = FusedLayerNorm.from_module(module, record)
    assert (fused.eps, list(fused.state_dict())) == (0.25, ["gain", "shift"])
    with pytest.raises(TypeError, match="cannot build a fused RMSNorm from a GainShiftLayerNorm"):
        FusedRMSNorm.from_module(module, record)


def test_declared_semantics_reads_torch_and_normswap_classes():
    assert declared_semantics(nn.RMSNorm(8, eps=None).double()).eps == torch.finfo(torch.float64).eps
    ln = declared_semantics(nn.LayerNorm(8, eps=1e-3, bias=False))
    assert (ln.kind, ln.eps, ln.affine, ln.bias, ln.weight_name, ln.bias_name) == (
        NormKind.LAYER,
        1e-3,
        True,
        False,
        "weight",
        None,
    )
    gn = declared_semantics(nn.GroupNorm(2, 8))
    assert (gn.kind, gn.num_groups, gn.normalized_shape, gn.eps) == (NormKind.GROUP, 2, (8,), 1e-5)
    gemma_like = declared_semantics(LayerNorm(8, casting="gemma", weight_offset=1.0))
    assert (gemma_like.casting, gemma_like.weight_offset) == ("gemma", 1.0)
    assert declared_semantics(nn.Linear(8, 8)) is None


def test_one_vocabulary_of_kinds():
    assert [NormKind.parse(t) for t in ("rms", "rmsnorm", "RMSNorm", "rms_norm")] == [NormKind.RMS] * 4
    assert NormKind.parse("layernorm") is NormKind.LAYER and NormKind.parse("batch") is NormKind.BATCH
    with pytest.raises(ValueError, match="unknown norm kind 'conv'"):
        NormKind.parse("conv")
    assert SWAP_TARGETS["rmsnorm"] == "rms" and SWAP_TARGETS["layernorm"] == "layer"
    assert list(SWAP_TARGETS) == [
        "rmsnorm",
        "layernorm",
        "batchnorm",
        "groupnorm",
        "instancenorm",
        "dyt",
        "derf",
        "identity",
    ]
    # after the swaps: fused, then the targets that are not norm swaps (crmsnorm, cosine)
    assert CONVERT_TARGETS[len(SWAP_TARGETS)] == "fused" and "cosine" in CONVERT_TARGETS
    assert (parse_target("rms"), parse_target("layernorm"), parse_target("fused")) == (
        "rmsnorm",
        "layernorm",
        "fused",
    )
    with pytest.raises(ValueError, match="unknown norm target 'rmsnorm2'"):
        parse_target("rmsnorm2")
    # the JSON carries the plain value; f-strings and str() read the same
    assert json.dumps({"kind": NormKind.RMS}) == '{"kind": "rms"}'
    assert f"{NormKind.LAYER} norm" == "layer norm" == f"{NormKind.LAYER!s} norm"
    # SwapNorm takes either spelling, and kinds for --from in either spelling
    swap = SwapNorm("rms", from_kinds=("layernorm",))
    assert (swap.to, swap.target_kind, swap.from_kinds) == ("rmsnorm", NormKind.RMS, (NormKind.LAYER,))
    with pytest.raises(ValueError, match="unknown norm target 'fused'"):
        SwapNorm("fused")
