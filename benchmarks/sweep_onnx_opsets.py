"""Every exact rewrite x every opset the exporter offers (17-23), written as ONNX and checked in onnxruntime.

    python benchmarks/sweep_onnx_opsets.py [--opsets 17,18,19,20,21,22,23] [--out benchmarks/results]

The models and rewrites of ``tests/export/test_rewrite_formats.py`` (HF GPT-2 and Llama from small configs,
timm's ViT with LayerScale, torchvision's ResNet-18), which tests the ends of the range (17 and 23) on
every run; this sweep covers the opsets between. Per case and opset: whether the file was written and
passed the onnxruntime check, the largest relative difference from PyTorch, the seconds it took, or the
error. Results: ``benchmarks/results/onnx_opsets_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "export"))

from test_rewrite_formats import CASES, MODELS

import normswap

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opsets", default="17,18,19,20,21,22,23")
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    rows = []
    for name, rewrite in CASES:
        model, args, kwargs = MODELS[name]()
        result = normswap.convert(model, normswap.ConvertConfig(**rewrite), args, kwargs)
        assert result.ok, result.refusal
        for opset in (int(o) for o in options.opsets.split(",")):
            start = time.perf_counter()
            row = {"model": name, "rewrite": rewrite, "opset": opset}
            try:
                with tempfile.TemporaryDirectory() as folder:
                    checked = normswap.save(result, Path(folder) / "m.onnx", opset=opset).onnx
                assert checked is not None
                row.update(ok=checked.within_tolerance, max_rel=max(o.max_rel for o in checked.outputs))
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    machine = {"python": platform.python_version(), "torch": torch.__version__}
    out = options.out / "onnx_opsets_cpu.json"
    command = "python benchmarks/sweep_onnx_opsets.py"
    out.write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}; {sum(r['ok'] for r in rows)} of {len(rows)} ok")


if __name__ == "__main__":
    main()
