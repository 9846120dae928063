"""Every exact rewrite of the models it applies to is written as ONNX at the lowest and the highest opset
the exporter offers (17: converted down from 18; 23: RMSNormalization as a standard op) and checked in
onnxruntime against PyTorch: HF GPT-2 and Llama from configs, timm's ViT (with LayerScale), torchvision's
ResNet-18. The opset-17 route was proven on unconverted models only; a converted model's norms are new
ops (an RMSNorm's ReduceMean), and onnx's converter left opset 18's ``noop_with_empty_axes`` on them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import model_zoo
import pytest

import normswap

pytest.importorskip("onnxruntime")


def _vit_with_layerscale() -> tuple:
    return model_zoo.timm_vit(init_values=0.5)


MODELS: dict[str, Callable[[], tuple]] = {
    "gpt2": model_zoo.gpt2,
    "llama": model_zoo.llama,
    "vit": _vit_with_layerscale,
    "resnet": model_zoo.resnet18,
}
# (model, the rewrite as ConvertConfig fields): each exact rewrite on the models that have its sites
CASES = [
    ("gpt2", {"to": "rmsnorm", "exact": True}),
    ("gpt2", {"to": "crmsnorm", "exact": True}),
    ("gpt2", {"fold_norm_affine": True}),
    ("gpt2", {"to": "fused", "fuse_add": True, "exact": True}),
    ("llama", {"fold_norm_affine": True}),
    ("llama", {"defer_rms": True}),
    ("llama", {"to": "fused", "exact": True}),
    ("vit", {"to": "rmsnorm", "exact": True}),
    ("vit", {"fold_layerscale": True}),
    ("vit", {"to": "fused", "fuse_inline": True, "exact": True}),
    ("resnet", {"fold_bn": True}),
    ("resnet", {"add_weight_norm": ["fc", "layer1.0.conv1"]}),
]


@pytest.mark.parametrize("opset", [17, 23])
@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{'-'.join(o)}" for n, o in CASES])
def test_every_exact_rewrite_writes_onnx_that_onnxruntime_runs_as_pytorch(
    tmp_path: Path, name, options, opset
):
    model, args, kwargs = MODELS[name]()
    config = normswap.ConvertConfig(output=tmp_path / "m.onnx", **options)
    result = normswap.convert(model, config, example_args=args, example_kwargs=kwargs)
    assert result.ok and result.changes > 0, result.refusal
    onnx = normswap.save(result, opset=opset).onnx
    assert onnx is not None and onnx.opset == opset
    assert onnx.within_tolerance, [(o.name, o.max_rel) for o in onnx.outputs]
    assert onnx.outputs and all(o.max_rel <= 1e-4 for o in onnx.outputs)
