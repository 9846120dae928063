"""A Hugging Face Llama built from a config, with its norms on normswap's fused kernels, then in ONNX.

Run: python examples/fuse_norms.py

1. ``FuseNorm`` swaps every ``LlamaRMSNorm`` for a ``FusedRMSNorm`` with the same eps, weight and
   casting ("llama": the normalized value is rounded to the input dtype before the weight multiply). The
   model is still a ``LlamaForCausalLM`` and its checkpoint still loads.
2. ``FuseAddNorm`` moves each residual add into the norm after it (one op returns the norm and the sum);
   that model is a ``torch.fx.GraphModule``.
3. Both export to ONNX with standard ops only: ``RMSNormalization`` at opset 23, checked in onnxruntime.

On a CUDA machine the fused ops run Triton kernels; on CPU they run the reference math, so the figures
printed here measure the rewrite, not kernel speed. Also usable as a factory for the CLI:

    normswap convert examples/fuse_norms.py:build --to fused -o out/llama_fused.onnx
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

# the same tiny Llama as the norm-affine example (also this file's factory, for the CLI)
from fold_norm_affine import build

from normswap.kernels.onnx_translation import translation_table
from normswap.passes import FuseAddNorm, FuseNorm, Pipeline


def main() -> None:
    model, args, kwargs = build()
    converted, report = Pipeline([FuseNorm(), FuseAddNorm()])(model, args, kwargs)
    for result in report.passes:
        for change in result.changes:
            print(f"{result.pass_name}: {change.site}: {change.description}")
        for skip in result.skips:
            print(f"{result.pass_name}: skipped {skip.site}: {skip.reason}")
    worst = max(report.overall.outputs, key=lambda o: o.max_abs)
    print(f"logits vs original: max abs {worst.max_abs:.3g}; {'exact' if report.ok else 'NOT exact'}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama_fused.onnx"
        torch.onnx.export(
            converted,
            args,
            str(path),
            kwargs=kwargs,
            dynamo=True,
            opset_version=23,
            custom_translation_table=translation_table(23),
            verbose=False,
        )
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        ops = sorted({n.op_type for n in onnx.load(str(path)).graph.node if "Norm" in n.op_type})
        logits = session.run(None, {session.get_inputs()[0].name: args[0].numpy()})[0]
    with torch.no_grad():
        want = model(*args, **kwargs).logits.numpy()
    print(
        f"ONNX opset 23 norm ops: {', '.join(ops)}; onnxruntime vs PyTorch max abs {np.abs(logits - want).max():.3g}"
    )


if __name__ == "__main__":
    main()
