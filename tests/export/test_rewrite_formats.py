"""Every exact rewrite of the models it applies to is written in every format: ONNX at the lowest and the
highest opset the exporter offers (17: converted down from 18; 23: RMSNormalization as a standard op),
checked in onnxruntime against PyTorch; .pt2 and .pt, loaded back and run; a model directory for the
Hugging Face models, loaded back (the others are refused before the work: a directory holds a
transformers model). Models: HF GPT-2 and Llama from configs, timm's ViT (with LayerScale), torchvision's
ResNet-18. The opset-17 route was proven on unconverted models only; a converted model's norms are new
ops (an RMSNorm's ReduceMean), and onnx's converter left opset 18's ``noop_with_empty_axes`` on them.
The opsets between (18-22): ``benchmarks/sweep_onnx_opsets.py``."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import model_zoo
import pytest
import torch

import normswap
from normswap import rewrites

pytest.importorskip("onnxruntime")


def _vit_with_layerscale() -> tuple:
    return model_zoo.timm_vit(init_values=0.5)


def _resnet_with_weight_norm() -> tuple:
    """torchvision's ResNet-18 with torch's weight norm on its classifier and first conv, as a user
    trained it."""
    from torch.nn.utils.parametrizations import weight_norm

    model, args, kwargs = model_zoo.resnet18()
    weight_norm(model.fc)
    weight_norm(model.conv1)
    return model, args, kwargs


MODELS: dict[str, Callable[[], tuple]] = {
    "gpt2": model_zoo.gpt2,
    "llama": model_zoo.llama,
    "vit": _vit_with_layerscale,
    "resnet": model_zoo.resnet18,
    "resnet-wn": _resnet_with_weight_norm,
}
# (model, the rewrite as ConvertConfig fields): each exact rewrite on the models that have its sites
CASES = [
    ("gpt2", {"to": "rmsnorm", "exact": True}),
    ("gpt2", {"to": "crmsnorm", "exact": True}),
    ("gpt2", {"fold_norm_affine": True}),
    ("gpt2", {"to": "fused", "exact": True}),
    ("gpt2", {"to": "fused", "fuse_add": True, "exact": True}),
    ("llama", {"fold_norm_affine": True}),
    ("llama", {"defer_rms": True}),
    ("llama", {"to": "fused", "exact": True}),
    ("vit", {"to": "rmsnorm", "exact": True}),
    ("vit", {"fold_layerscale": True}),
    ("vit", {"to": "fused", "fuse_inline": True, "exact": True}),
    ("resnet", {"fold_bn": True}),
    ("resnet", {"add_weight_norm": ["fc", "layer1.0.conv1"]}),
    ("resnet-wn", {"remove_weight_norm": True}),
]


def _label(options: dict) -> str:
    return "-".join(k if v is True else f"{k}={v}" for k, v in options.items())


def _outputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(*args, **kwargs)
    return out["logits"] if isinstance(out, dict) else out


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{_label(o)}" for n, o in CASES])
def test_every_exact_rewrite_is_written_in_every_format(tmp_path: Path, name, options):
    model, args, kwargs = MODELS[name]()
    result = normswap.convert(
        model, normswap.ConvertConfig(**options), example_args=args, example_kwargs=kwargs
    )
    assert result.ok and result.changes > 0, result.refusal
    want = _outputs(result.model, args, kwargs)
    for opset in (17, 23):
        onnx = normswap.save(result, tmp_path / f"m{opset}.onnx", opset=opset).onnx
        assert onnx is not None and onnx.opset == opset and onnx.within_tolerance
        assert onnx.outputs and all(o.max_rel <= 1e-4 for o in onnx.outputs), [
            o.max_rel for o in onnx.outputs
        ]
    saved = normswap.save(result, tmp_path / "m.pt2")
    back = _outputs(torch.export.load(tmp_path / "m.pt2").module(), args, kwargs)
    assert ((back - want).abs().max() / want.abs().max()).item() < 1e-5
    # the program takes every batch and length the conversion was verified on (the example and its
    # variants); another image size, where export fixed it, is named in the output's messages
    assert saved.shapes is not None and len(saved.shapes.accepted) >= 2, saved.shapes
    assert not saved.shapes.rejected_free, saved.shapes.rejected
    for rejected in saved.shapes.rejected:
        assert " size " in rejected["label"] and "Guard failed" in rejected["error"], rejected
        assert any(
            rejected["shapes"] in m and "bounded or fixed the image size where the model's code ties it" in m
            for m in saved.messages
        )
    if "add_weight_norm" in options:  # torch cannot pickle a parametrized module: refused before the work
        config = normswap.ConvertConfig(output=tmp_path / "m.pt", **options)
        with pytest.raises(
            normswap.BadInputError, match=r"makes parametrized modules, which torch\.save cannot"
        ):
            normswap.convert(model, config, example_args=args, example_kwargs=kwargs)
    else:
        saved = normswap.save(result, tmp_path / "m.pt")
        back = _outputs(torch.load(tmp_path / "m.pt", weights_only=False), args, kwargs)
        assert ((back - want).abs().max() / want.abs().max()).item() < 1e-5
        if isinstance(result.model, torch.fx.GraphModule):  # a graph's .pt holds its program: checked too
            assert saved.shapes is not None and not saved.shapes.rejected_free, saved.shapes
    graph = bool(set(result.config.rewrites()) & set(rewrites.graph_options()))
    if name in ("gpt2", "llama") and not graph:
        normswap.save(result, tmp_path / "dir")
        back = _outputs(normswap.load_model(str(tmp_path / "dir")).model, args, kwargs)
        assert ((back - want).abs().max() / want.abs().max()).item() < 1e-5
    else:  # an exported graph, or not a transformers model: refused before anything is written
        reason = (
            "makes the model an exported torch.fx GraphModule, which a model directory cannot hold"
            if graph
            else "a model directory is written for a transformers model (save_pretrained)"
        )
        config = normswap.ConvertConfig(output=tmp_path / "dir", **options)
        with pytest.raises(normswap.BadInputError, match=re.escape(reason)):
            normswap.convert(model, config, example_args=args, example_kwargs=kwargs)
        assert not (tmp_path / "dir").exists()
