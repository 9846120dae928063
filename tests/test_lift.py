"""A loaded .pt2 becomes editable modules without changing its function."""

from __future__ import annotations

import model_zoo
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
    from normswap.passes import fuse_norm

    model, args, kwargs = model_zoo.convnext_tiny()
    fused, _ = fuse_norm(model, args, kwargs)
    gm = lift_exported_module(_exported_module(fused, args, kwargs, tmp_path))
    stem = gm.get_submodule("stem.1")
    # movedim -> fused op -> movedim back is one module again, over the same dim as before
    assert isinstance(stem, FusedChannelLayerNorm) and stem.channel_dim == -3
    assert not any("movedim" in str(n.target) for n in gm.graph.nodes)
    assert set(gm.state_dict()) == set(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), fused(*args), rtol=0, atol=0)
