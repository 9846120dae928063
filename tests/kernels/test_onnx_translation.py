"""ONNX export of models with fused norms: standard ops only, and onnxruntime agrees with PyTorch.

onnxruntime 1.31 implements RMSNormalization (opset 23), so every opset is run there in fp32 and fp16. Its
CPU provider has no bf16 Add/Mul kernels, so bf16 graphs are run by onnx's reference evaluator instead.
GPT-2 is exported at 18 and 23, not 17: torch's exporter builds at 18 and onnx's version converter turns
its Split into an invalid Split-13 (with or without normswap; the tiny models cover LayerNormalization
at 17).
"""

from __future__ import annotations

import collections

import model_zoo
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import normswap
from normswap.kernels.onnx_translation import translation_table
from normswap.modules.fused import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm
from normswap.passes import FuseNorm
from normswap.util.tolerance import kernel_tolerance

# What the two RMSNorm forms leave in the graph: the standard op, or its written-out body.
RMS_BODY = {"ReduceMean", "Sqrt", "Div"}


class AllFusedNorms(nn.Module):
    """Every fused module, casting mode and parameter combination, chained."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.rms_llama = FusedRMSNorm(dim, casting="llama")
        self.ln = FusedLayerNorm(dim)
        self.add_rms_gemma = FusedAddRMSNorm(dim, casting="gemma", weight_offset=1.0, bias=True)
        self.add_ln_plain = FusedAddLayerNorm(dim, elementwise_affine=False, bias=False, casting="llama")
        self.rms_plain = FusedRMSNorm(dim, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(self.rms_llama(x))
        y, h = self.add_rms_gemma(y, x)
        y, h = self.add_ln_plain(y, h)
        return self.rms_plain(y) + h


def _export(model: nn.Module, args: tuple, kwargs: dict | None, opset: int) -> onnx.ModelProto:
    program = torch.onnx.export(
        model,
        args,
        kwargs=kwargs,
        dynamo=True,
        opset_version=opset,
        custom_translation_table=translation_table(opset),
        verbose=False,
    )
    return program.model_proto


def _run_ort(proto: onnx.ModelProto, *inputs: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)}
    return session.run(None, feeds)[0]


def _op_types(proto: onnx.ModelProto) -> collections.Counter:
    assert {d.domain for d in proto.graph.node} <= {""}, "only standard ONNX ops"
    assert [i.version for i in proto.opset_import if i.domain == ""] == [proto_opset(proto)]
    return collections.Counter(n.op_type for n in proto.graph.node)


def proto_opset(proto: onnx.ModelProto) -> int:
    return next(i.version for i in proto.opset_import if i.domain == "")


def _assert_close(got: np.ndarray, want: torch.Tensor) -> None:
    atol, rtol = kernel_tolerance(want.dtype)
    torch.testing.assert_close(torch.from_numpy(got.astype(np.float32)), want.float(), atol=atol, rtol=rtol)


def test_onnxruntime_has_rms_normalization():
    # The premise of running opset 23 below; if this fails, ORT lost the op and opset 23 cannot be run.
    assert tuple(int(p) for p in ort.__version__.split(".")[:2]) >= (1, 22)


@pytest.mark.parametrize("opset", [17, 18, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_every_fused_module_exports_to_standard_ops(opset, dtype):
    model = model_zoo.randomize_norms(AllFusedNorms()).to(dtype).eval()
    x = torch.randn(2, 5, 24).to(dtype)
    proto = _export(model, (x,), None, opset)
    assert proto_opset(proto) == opset
    types = _op_types(proto)
    assert types["LayerNormalization"] == 2
    if opset >= 23:
        assert types["RMSNormalization"] == 3 and RMS_BODY.isdisjoint(types)
    else:
        assert types["RMSNormalization"] == 0 and RMS_BODY.issubset(types)
    with torch.no_grad():
        _assert_close(_run_ort(proto, x), model(x))


@pytest.mark.parametrize("opset", [18, 23])
def test_bf16_graphs_agree_in_the_reference_evaluator(opset):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from onnx.reference import ReferenceEvaluator

    model = model_zoo.randomize_norms(AllFusedNorms()).bfloat16().eval()
    x = torch.randn(2, 5, 24).bfloat16()
    evaluator = ReferenceEvaluator(_export(model, (x,), None, opset))
    got = evaluator.run(None, {evaluator.input_names[0]: x.float().numpy().astype(ml_dtypes.bfloat16)})[0]
    with torch.no_grad():
        _assert_close(got, model(x))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "opset"), [("llama", 17), ("llama", 23), ("gpt2", 18), ("gpt2", 23)], ids=lambda v: str(v)
)
def test_converted_hf_models_in_onnxruntime(name, opset):
    model, args, kwargs = getattr(model_zoo, name)()
    converted, report = FuseNorm()(model, args, kwargs)
    assert len(report.changes) == 5
    proto = _export(converted, args, kwargs, opset)
    types = _op_types(proto)
    if name == "gpt2":
        assert types["LayerNormalization"] == 5
    elif opset >= 23:
        assert types["RMSNormalization"] == 5
    else:
        assert types["RMSNormalization"] == 0 and types["Sqrt"] >= 5
    with torch.no_grad():
        want = model(*args, **kwargs).logits
    _assert_close(_run_ort(proto, *args), want)


def test_save_writes_fused_models_as_onnx(tmp_path):
    model = model_zoo.randomize_norms(nn.Sequential(nn.Linear(16, 16), FusedRMSNorm(16, casting="llama")))
    x = torch.randn(3, 16)
    path = tmp_path / "fused.onnx"
    assert normswap.save(model.eval(), path, (x,), opset=23).format == "onnx"
    proto = onnx.load(path)
    assert _op_types(proto)["RMSNormalization"] == 1
    with torch.no_grad():
        _assert_close(_run_ort(proto, x), model(x))


def test_below_opset_17_is_refused():
    with pytest.raises(ValueError, match="from opset 17"):
        translation_table(16)
