"""A loaded .pt2 becomes editable modules without changing its function."""

from __future__ import annotations

import model_zoo
import pytest
import torch
from torch import nn

from normswap.graph.lift import lift_exported_module
from normswap.passes import FoldBatchNorm, SwapNorm


def _exported_module(model: nn.Module, args: tuple, kwargs: dict, tmp_path) -> nn.Module:
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, args, kwargs, strict=False), path)
    return torch.export.load(path).module()


def test_resnet18_pt2_lifts_to_modules_and_folds(tmp_path):
    model, args, _ = model_zoo.resnet18(size=32)
    gm = lift_exported_module(_exported_module(model, args, {}, tmp_path))
    assert isinstance(gm.bn1, nn.BatchNorm2d) and isinstance(gm.get_submodule("layer1.0.conv1"), nn.Conv2d)
    assert isinstance(gm.fc, nn.Linear)
    assert set(gm.state_dict()) == set(model.state_dict())
    torch.testing.assert_close(gm(*args), model(*args), rtol=0, atol=0)
    folded, report = FoldBatchNorm()(gm, args)
    assert len(report.changes) == 20
    torch.testing.assert_close(
        folded(*args), model(*args), rtol=0, atol=1e-5 * model(*args).abs().max().item()
    )
    reexported = torch.export.export(folded, args, strict=False)
    assert not [n for n in reexported.graph.nodes if "batch_norm" in str(n.target)]


def test_gpt2_pt2_layernorms_become_swappable(tmp_path):
    model, args, kwargs = model_zoo.gpt2()
    gm = lift_exported_module(_exported_module(model, args, kwargs, tmp_path))
    assert isinstance(gm.get_submodule("transformer.h.0.ln_1"), nn.LayerNorm)
    torch.testing.assert_close(gm(*args, **kwargs)[0], model(*args, **kwargs).logits, rtol=0, atol=0)
    _, report = SwapNorm("rmsnorm")(gm, args, kwargs)
    assert len(report.changes) == 5


def test_fused_channel_norms_lift_back_to_channel_modules(tmp_path):
    from normswap.modules.fused import FusedChannelLayerNorm
    from normswap.passes import FuseNorm

    model, args, kwargs = model_zoo.convnext_tiny()
    fused, _ = FuseNorm()(model, args, kwargs)
    gm = lift_exported_module(_exported_module(fused, args, kwargs, tmp_path))
    stem = gm.get_submodule("stem.1")
    # movedim -> fused op -> movedim back is one module again, over the same dim as before
    assert isinstance(stem, FusedChannelLayerNorm) and stem.channel_dim == -3
    assert not any("movedim" in str(n.target) for n in gm.graph.nodes)
    assert set(gm.state_dict()) == set(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), fused(*args), rtol=0, atol=0)


class _WeightNormed(nn.Module):
    """Weight norm three ways, as real code writes it: the parametrization over a conv, the deprecated
    hook over another, and one magnitude for a whole Linear weight (dim=None); a BatchNorm after the
    first conv, with statistics of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1, groups=2))
        self.bn = nn.BatchNorm1d(8)
        with torch.no_grad(), pytest.warns(FutureWarning):  # torch's deprecation of the hook form
            self.c2 = nn.utils.weight_norm(nn.Conv1d(8, 8, 3))
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(8, 3), dim=None)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.c2(torch.relu(self.bn(self.c1(x))))).mean(-1))


def test_weight_normed_layers_lift_as_torchs_own_with_their_weight_norm(tmp_path):
    """A .pt2 computes a weight-normed layer's weight as ``_weight_norm(v, g, dim)`` on bare holders: it
    is lifted to the torch.nn layer with the same weight norm over the same Parameters (bit for bit), so
    the passes decide on it as on the eager model: --remove-weight-norm crashed there ('Module' object is
    not iterable), --fold-bn turned the BatchNorm into a ChannelAffine, --add-weight-norm saw nothing."""
    from normswap.passes import AddWeightNorm, RemoveWeightNorm

    torch.manual_seed(0)
    model, x = _WeightNormed().eval(), torch.randn(2, 4, 12)
    gm = lift_exported_module(_exported_module(model, (x,), {}, tmp_path))
    assert nn.utils.parametrize.is_parametrized(gm.c1, "weight") and gm.c1.groups == 2
    assert (
        gm.c1.parametrizations.weight.original1
        is gm.state_dict(keep_vars=True)["c1.parametrizations.weight.original1"]
    )
    assert isinstance(gm.c2, nn.Conv1d) and {"weight_g", "weight_v"} <= set(dict(gm.c2.named_parameters()))
    assert gm.head.parametrizations.weight[0].dim == -1
    assert list(gm.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    for rewrite in (RemoveWeightNorm(), AddWeightNorm(), FoldBatchNorm()):
        _, eager = rewrite(model, (x,))
        _, report = rewrite(gm, (x,))
        assert [(c.site, c.description) for c in report.changes] == [
            (c.site, c.description) for c in eager.changes
        ]
        assert [(s.site, s.reason) for s in report.skips] == [(s.site, s.reason) for s in eager.skips]
    assert len(eager.skips) == 1 and "computed by a parametrization" in eager.skips[0].reason  # the fold
    removed, report = RemoveWeightNorm()(gm, (x,))
    assert len(report.changes) == 3
    torch.testing.assert_close(removed(x), model(x), rtol=0, atol=1e-6 * model(x).abs().max().item())


def test_a_weight_norm_the_lift_leaves_as_ops_is_skipped_with_its_reason(tmp_path):
    """A weight-normed ConvTranspose is not lifted (no ConvTranspose is): --remove-weight-norm crashed on
    its bare holder ('Module' object is not iterable, exit 3); it is skipped, saying why. A lifted hook
    form copies (its computed weight is a leaf: the Python API deep-copies models)."""
    import copy

    from normswap.passes import RemoveWeightNorm

    torch.manual_seed(0)
    with pytest.warns(FutureWarning):
        hook = nn.utils.weight_norm(nn.Conv1d(4, 4, 3))
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.ConvTranspose1d(4, 4, 3)), hook).eval()
    x = torch.randn(2, 4, 9)
    gm = lift_exported_module(_exported_module(model, (x,), {}, tmp_path))
    torch.testing.assert_close(copy.deepcopy(gm)(x), model(x), rtol=0, atol=0)
    removed, report = RemoveWeightNorm()(gm, (x,))
    assert [c.site for c in report.changes] == ["1"]
    assert [(s.site, s.reason.split(":")[0]) for s in report.skips] == [
        ("0", "the program computes this weight norm with ops normswap does not lift back into a layer "
              "(a ConvTranspose, a layer called twice, a decomposed program)")
    ]  # fmt: skip
    torch.testing.assert_close(removed(x), model(x), rtol=0, atol=1e-6 * model(x).abs().max().item())


@pytest.mark.parametrize("width", [8, 16])  # 16: as wide as the 16 channels, where no shape error warns
def test_a_channels_first_layernorm_pt2_swaps_as_its_module_does(tmp_path, width):
    """timm's LayerNorm2d exports as permute -> layer_norm -> permute: the three lift into one channel
    LayerNorm, bit for bit, and each swap of the .pt2 computes what the same swap of the module computes
    (the layer_norm alone was lifted: swaps crashed, or at width == channels normalized the wrong dim)."""
    from timm.layers import LayerNorm2d

    from normswap.modules.norms import ChannelLayerNorm
    from normswap.passes import FuseNorm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), LayerNorm2d(16), nn.Conv2d(16, 4, 1)).eval()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.normal_(0, 0.1)
    args = (torch.randn(2, 3, width, width),)
    program = _exported_module(model, args, {}, tmp_path)
    with torch.no_grad():
        expected = program(*args)
    lifted = lift_exported_module(program)
    assert (
        isinstance(lifted.get_submodule("1"), ChannelLayerNorm)
        and lifted.get_submodule("1").channel_dim == -3
    )
    with torch.no_grad():
        torch.testing.assert_close(lifted(*args), expected, rtol=0, atol=0)
    for rewrite in (SwapNorm("rmsnorm"), SwapNorm("batchnorm"), SwapNorm("groupnorm", groups=4), FuseNorm()):
        from_module, module_report = rewrite(model, args)
        from_pt2, pt2_report = rewrite(lifted, args)
        assert len(module_report.changes) == len(pt2_report.changes) == 1, (rewrite, pt2_report.skips)
        with torch.no_grad():
            expected = from_module(*args)
            torch.testing.assert_close(from_pt2(*args), expected, rtol=0, atol=1e-5 * expected.abs().max())


class _MovedNorm(nn.Module):
    """A norm moved to last and back, as research code writes it: over ``shape``, of dim ``dim``."""

    def __init__(self, shape: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.norm, self.dim = nn.LayerNorm(shape), dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.movedim(self.dim, -1)).movedim(-1, self.dim)


@pytest.mark.parametrize(
    ("shape", "dim", "example"),
    [((6, 8), 1, (2, 8, 5, 6)), ((4,), 2, (2, 5, 4, 3, 3))],  # over two dims; a 5-D tensor's dim 2
    ids=["two-dims", "5d"],
)
def test_only_an_nchw_channel_norm_lifts_as_one(tmp_path, shape, dim, example):
    """The swaps read a channel norm as NCHW's dim 1: any other moved norm stays torch's LayerNorm with
    the moves around it in the program, and computes as before."""
    from normswap.modules.norms import ChannelLayerNorm

    model = nn.Sequential(_MovedNorm(shape, dim)).eval()
    args = (torch.randn(example),)
    program = _exported_module(model, args, {}, tmp_path)
    lifted = lift_exported_module(program)
    assert not any(isinstance(m, ChannelLayerNorm) for m in lifted.modules())
    assert isinstance(lifted.get_submodule("0.norm"), nn.LayerNorm)
    with torch.no_grad():
        torch.testing.assert_close(lifted(*args), program(*args), rtol=0, atol=0)
