"""Checkpoints larger than memory: time and peak memory of streamed exact rewrites of model directories.

    python benchmarks/bench_checkpoint.py [--layers 8,16,32] [--models llama,opt] [--root DIR]
                                          [--out benchmarks/results]

For each model shape and layer count, in one run:

1. a synthetic Hugging Face directory is written tensor by tensor (config.json; bf16 safetensors shards
   of at most 2 GB with their index; random weights, norm weights and biases far from (1, 0)), so that
   writing it never holds the model either;
2. a plain copy of its shard files (``cp``) is timed: the floor for any rewrite that reads and writes
   every byte;
3. ``normswap convert DIR --fold-norm-affine -o OUT`` (Llama shape: hidden 4096, intermediate 11008,
   32 heads) or ``normswap convert DIR --to rmsnorm --exact -o OUT`` (OPT shape: hidden 4096, ffn 16384,
   a pre-LN LayerNorm model) runs in its own process: wall time and peak RSS (``wait4``), the pass's
   report, the largest edit group and the block-by-block verification, which is part of the command;
4. on the smallest size, where two full models fit in memory, the output is loaded as a user would
   (``from_pretrained`` for the fold, ``normswap.load_model`` for RMSNorm) and its logits compared with
   the original's;
5. the directory and its output are deleted before the next size.

Results: ``benchmarks/results/checkpoint_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import _normswap, _run_rss

RESULTS = Path(__file__).resolve().parent / "results"
SHARD_BYTES = 2 * 1000**3


def config_for(model: str, layers: int, small: bool = False) -> Any:
    """The benchmark's shapes, or a few-MB version of them (``small``: a smoke run of the script)."""
    import transformers

    hidden, heads = (256, 4) if small else (4096, 32)
    if model == "llama":
        config = transformers.LlamaConfig(
            hidden_size=hidden,
            intermediate_size=688 if small else 11008,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            num_hidden_layers=layers,
            vocab_size=1000 if small else 32000,
            tie_word_embeddings=False,
        )
        config.architectures = ["LlamaForCausalLM"]
    else:
        config = transformers.OPTConfig(
            hidden_size=hidden,
            ffn_dim=4 * hidden,
            num_attention_heads=heads,
            num_hidden_layers=layers,
            vocab_size=1000 if small else 50272,
            word_embed_proj_dim=hidden,
        )
        config.architectures = ["OPTForCausalLM"]
    config.dtype = "bfloat16"
    return config


def write_synthetic(config: Any, path: Path, seed: int = 0) -> int:
    """A model directory for ``config`` with random bf16 weights, written one tensor at a time; its bytes."""
    import transformers

    from normswap.load.safetensors_io import NAMES, ShardWriter
    from normswap.load.weight_files import STOCK

    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])._from_config(config, dtype=torch.bfloat16)
    seen: set[int] = set()
    tensors = []  # (name, shape) of what save_pretrained would store: tied tensors once
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors.append((name, tuple(tensor.shape)))
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 2 * int(torch.tensor(shape).prod()) if shape else 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    path.mkdir(parents=True)
    config.save_pretrained(path)
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, members in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = ShardWriter(
            path / file, [(n, NAMES[torch.bfloat16], s) for n, s in members], {"format": "pt"}
        )
        for name, shape in members:
            if "norm" in name:
                value = (1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(
                    shape, generator=generator
                )
            else:
                value = 0.02 * torch.randn(shape, generator=generator)
            writer.write(name, value.to(torch.bfloat16))
            weight_map[name] = file
            total += value.numel() * 2
        writer.close()
    (path / STOCK.index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _drop_caches() -> bool:
    """Empty the page cache (root on Linux), so that a timing reads its input from disk and not from the
    memory the previous step left it in; False where this machine does not allow it."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _copy_seconds(source: Path, target: Path) -> float:
    _drop_caches()
    start = time.perf_counter()
    target.mkdir()
    for shard in sorted(source.glob("*.safetensors")):
        shutil.copyfile(shard, target / shard.name)
    os.sync()
    return time.perf_counter() - start


def _logits_match(model: str, source: Path, output: Path) -> dict[str, Any]:
    """The output loaded as a user loads it, against the original, on 2 x 16 token ids. Both run in bf16,
    whose own rounding over a deep model exceeds the bf16 row of the table, so both are measured against
    the original computed in fp32 and the rule of the exact passes applies: the converted model may be
    at most twice as far from it as the original bf16 model is."""
    import transformers

    from normswap.load import load_model

    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))

    def logits(loaded: Any) -> torch.Tensor:
        with torch.no_grad():
            return loaded(input_ids=ids).logits.double()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    auto = transformers.AutoModelForCausalLM
    reference = logits(auto.from_pretrained(source, dtype=torch.float32))
    original = logits(auto.from_pretrained(source))
    converted_model = auto.from_pretrained(output) if model == "llama" else load_model(str(output)).model
    loader = type(converted_model).__module__
    converted = logits(converted_model)
    del converted_model
    return {
        "converted_vs_original_bf16": rel(converted, original),
        "original_bf16_vs_fp32": rel(original, reference),
        "converted_bf16_vs_fp32": rel(converted, reference),
        "within_rounding": rel(converted, reference) <= 2 * rel(original, reference),
        "loader": loader,
    }


def bench(model: str, layers: int, root: Path, check_logits: bool, small: bool = False) -> dict[str, Any]:
    config = config_for(model, layers, small)
    source, output, copy = (
        root / f"{model}-{layers}",
        root / f"{model}-{layers}-out",
        root / f"{model}-{layers}-copy",
    )
    start = time.perf_counter()
    total = write_synthetic(config, source)
    row: dict[str, Any] = {
        "model": model,
        "layers": layers,
        "bytes": total,
        "write_s": time.perf_counter() - start,
    }
    row["copy_s"] = _copy_seconds(source, copy)
    shutil.rmtree(copy)
    rewrite = ["--fold-norm-affine"] if model == "llama" else ["--to", "rmsnorm", "--exact"]
    report = root / "report.json"
    row["cold_cache"] = _drop_caches()
    seconds, peak = _run_rss(
        _normswap("convert", str(source), *rewrite, "-o", str(output), "--report", str(report))
    )
    report_json = json.loads(report.read_text())
    assert report_json["route"] == "streamed", report_json["route"]
    # convert --report: the passes' changes and skips, and what the stream wrote under "directory"
    data = {
        **report_json["directory"],
        "report": {
            "changes": [c for p in report_json["passes"] for c in p["changes"]],
            "skips": [s for p in report_json["passes"] for s in p["skips"]],
        },
    }
    row.update(
        rewrite=" ".join(rewrite),
        convert_s=seconds,
        peak_rss=peak,
        time_over_copy=seconds / row["copy_s"],
        changed=len(data["report"]["changes"]),
        skipped=len(data["report"]["skips"]),
        largest_group_bytes=data["largest_group_bytes"],
        edited_tensors=data["edited_tensors"],
        copied_tensors=data["copied_tensors"],
        verification=[
            {"ok": v["ok"], "stages": len(v["stages"]), "worst_rel": max(s["max_rel"] for s in v["stages"])}
            for v in data["verification"]
        ],
    )
    print(
        f"{model} {layers} layers, {total / 1e9:.2f} GB: convert {seconds:.0f} s ({row['time_over_copy']:.2f}x "
        f"a copy of {row['copy_s']:.0f} s), peak RSS {peak / 1e9:.2f} GB, {row['changed']} changed, "
        f"verified {[v['ok'] for v in row['verification']]}",
        flush=True,
    )
    if check_logits:
        # in a process of its own: loading three models here would raise this process's RSS, which the
        # next convert child would inherit in its peak (Linux counts a child's memory from before exec)
        code = (
            "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_checkpoint as b; "
            "from pathlib import Path; print(json.dumps(b._logits_match(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))))"
        )
        here = str(Path(__file__).resolve().parent)
        done = subprocess.run(
            [sys.executable, "-c", code, here, model, str(source), str(output)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        row["logits"] = json.loads(done.stdout.strip().splitlines()[-1])
        got = row["logits"]
        print(
            f"  loaded back ({got['loader']}): logits {got['converted_bf16_vs_fp32']:.3g} x max from the fp32 "
            f"original, the bf16 original {got['original_bf16_vs_fp32']:.3g}: within rounding "
            f"{got['within_rounding']}",
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
    parser.add_argument("--models", default="llama,opt")
    parser.add_argument("--root", type=Path, default=None, help="where the checkpoints go [a temp folder]")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--small", action="store_true", help="hidden 256: a smoke run in seconds")
    options = parser.parse_args()
    layers = [int(n) for n in options.layers.split(",")]
    root = Path(tempfile.mkdtemp(prefix="normswap-bench-", dir=options.root))
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "runs": [],
    }
    out = options.out / ("checkpoint_cpu_small.json" if options.small else "checkpoint_cpu.json")
    try:
        for model in options.models.split(","):
            for count in layers:
                check = count == min(layers)
                results["runs"].append(bench(model, count, root, check_logits=check, small=options.small))
                out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
