"""Peak memory per process of `normswap distill` under torchrun with a model directory as the teacher:
loaded whole in every process (`--no-shard-teacher`) against read straight into its shards
(`--shard-teacher`, normswap.calibrate.parallel_load).

    python benchmarks/bench_teacher_load.py [--hidden 1024] [--layers 8] [--processes 2] [--out benchmarks/results]

A Llama directory (fp32, random weights) is written, its DyT conversion saved as the student (.pt), and
`torchrun --standalone --nproc-per-node N -m normswap_cli distill` runs 2 steps with each teacher
setting in its own process tree. Peak RSS is the largest of torchrun's processes (``wait4``'s figure
for torchrun, which includes the workers it waited for), so the worst worker. Results:
``benchmarks/results/teacher_load_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import _run_rss
from bench_distill_memory import write_models

RESULTS = Path(__file__).resolve().parent / "results"


def _run(root: Path, directory: Path, student: Path, data: Path, processes: int, flag: str) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "normswap_cli", "distill", str(directory), str(student), "--trust-pickle", "--data", str(data),
        "--batch-size", "4", "--steps", "2", flag, "-o", str(root / f"out{flag}.pt"),
    ]  # fmt: skip
    # wait4's figure for torchrun covers the workers it waited for: the largest process of the tree
    seconds, peak = _run_rss(command, {"OMP_NUM_THREADS": "1"})
    return {"seconds": seconds, "peak_rss_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        directory, student, data, parameters = write_models(
            root, args.hidden, args.layers, ("--to", "dyt"), "student.pt"
        )
        weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        runs = {}
        for flag in ("--no-shard-teacher", "--shard-teacher"):
            runs[flag] = _run(root, directory, student, data, args.processes, flag)
            print(f"{flag}: peak RSS of the largest process {runs[flag]['peak_rss_bytes'] / 1e9:.2f} GB, "
                  f"{runs[flag]['seconds']:.1f} s", flush=True)  # fmt: skip
    result = {
        "command": "python benchmarks/bench_teacher_load.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": {
            "kind": "LlamaForCausalLM, fp32",
            "hidden": args.hidden,
            "layers": args.layers,
            "parameters": parameters,
            "teacher_bytes": weights,
        },
        "processes": args.processes,
        "runs": runs,
        "peak_rss_saved_bytes": runs["--no-shard-teacher"]["peak_rss_bytes"]
        - runs["--shard-teacher"]["peak_rss_bytes"],
        "ru_maxrss_note": "wait4's maxrss of torchrun: the largest single process of its tree",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "teacher_load_cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"teacher {weights / 1e9:.2f} GB; saved {result['peak_rss_saved_bytes'] / 1e9:.2f} GB of peak RSS per process"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
