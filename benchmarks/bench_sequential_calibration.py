"""Sequential calibration of models larger than memory: peak memory and SQNR of ``convert --sequential``.

    python benchmarks/bench_sequential_calibration.py [--layers 8,16,32] [--hidden 2048] [--root DIR]
                                                      [--out benchmarks/results]

For each layer count, in one run:

1. a synthetic bf16 Llama directory is written tensor by tensor (``bench_checkpoint.write_synthetic``:
   2 GB shards, random weights, RMSNorm weights far from 1), never holding the model;
2. ``normswap convert DIR --to layernorm --calibrate calib.pt --batch-size B --sequential
   --activation-memory GB -o OUT --report R`` runs in its own process: every RMSNorm becomes a LayerNorm
   (architectural) and is calibrated block by block on the calibration token ids (the same for every
   size); wall time and peak RSS (``wait4``, this child alone) are measured;
3. its report gives the model's SQNR against the original on the calibration data before and after
   calibration, each block's, the example inputs' after, and the activations held and spilled;
4. the directory and its output are deleted before the next size.

Results: ``benchmarks/results/sequential_calibration_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import write_synthetic
from bench_convert import _normswap, _run_rss

RESULTS = Path(__file__).resolve().parent / "results"


def llama_config(layers: int, hidden: int) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875) // 64 * 64,  # Llama's 11008 / 4096, rounded to 64
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        num_hidden_layers=layers,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    return config


def bench(
    layers: int, hidden: int, root: Path, calib: Path, batch_size: int, activation_gb: float
) -> dict[str, Any]:
    source, output, report = root / f"llama-{layers}", root / f"llama-{layers}-out", root / "report.json"
    start = time.perf_counter()
    total = write_synthetic(llama_config(layers, hidden), source)
    row: dict[str, Any] = {
        "layers": layers,
        "hidden": hidden,
        "bytes": total,
        "write_s": time.perf_counter() - start,
    }
    command = _normswap(
        "convert", str(source), "--to", "layernorm", "--calibrate", str(calib), "--batch-size", str(batch_size),
        "--sequential", "--activation-memory", str(activation_gb), "-o", str(output), "--report", str(report),
    )  # fmt: skip
    seconds, peak = _run_rss(command)
    data = json.loads(report.read_text())
    fit = data["calibration"]
    row.update(
        convert_s=seconds,
        peak_rss=peak,
        changed=sum(len(p["changes"]) for p in data["passes"]),
        model_sqnr_before_db=fit["model_sqnr_before_db"],
        model_sqnr_after_db=fit["model_sqnr_after_db"],
        example_sqnr_after_db=fit["example"]["sqnr_db"],
        blocks=[{k: b[k] for k in ("block", "sqnr_before_db", "sqnr_after_db")} for b in fit["blocks"]],
        activations_peak_held=fit["activations_peak_held"],
        activations_spilled=fit["activations_spilled"],
        written_tensors=data["directory"]["written_tensors"],
        copied_tensors=data["directory"]["copied_tensors"],
    )
    print(
        f"llama {layers} layers (hidden {hidden}), {total / 1e9:.2f} GB: {seconds:.0f} s, peak RSS {peak / 1e9:.2f} GB, "
        f"{row['changed']} norms, model SQNR {fit['model_sqnr_before_db']:.2f} -> {fit['model_sqnr_after_db']:.2f} dB, "
        f"spilled {fit['activations_spilled'] / 1e6:.1f} MB",
        flush=True,
    )
    shutil.rmtree(source)
    shutil.rmtree(output)
    report.unlink()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", default="8,16,32")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=4, help="calibration batches")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--activation-memory", type=float, default=0.001, help="GB held before spilling")
    parser.add_argument("--root", type=Path, default=None, help="where the checkpoints go [a temp folder]")
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="normswap-bench-", dir=options.root))
    calib = root / "calib.pt"
    rows = options.batches * options.batch_size
    ids = torch.randint(0, 32000, (rows, options.tokens), generator=torch.Generator().manual_seed(0))
    torch.save(ids, calib)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": " ".join(sys.argv),
        "conversion": "--to layernorm (every RMSNorm), --sequential",
        "calibration": {
            "batches": options.batches,
            "batch_size": options.batch_size,
            "tokens": options.tokens,
            "activation_memory_gb": options.activation_memory,
        },
        "runs": [],
    }
    out = options.out / "sequential_calibration_cpu.json"
    try:
        for count in (int(n) for n in options.layers.split(",")):
            results["runs"].append(
                bench(count, options.hidden, root, calib, options.batch_size, options.activation_memory)
            )
            out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
