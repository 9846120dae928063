"""Distillation in one process and under torchrun on this machine's CPU: time per step and memory per process.

    python benchmarks/bench_distill_torchrun.py [--processes 1,2] [--steps 12] [--batch 8] [--seq 128]
                                                [--hidden 512] [--layers 4] [--out benchmarks/results]

A Llama from a config (random weights) is the teacher and its DyT conversion the student (every
parameter trained, MSE on the logits). The same global batches run with 1 process (no torchrun: the
one-process path) and then with N processes (``torch.distributed.run --standalone``, gloo, the student
sharded with FSDP2 per block; the teacher a whole copy per process). Each process reports the median of
its step times (the first two steps, warm-up, left out), its peak RSS and its RSS after training
(``/proc/self/status``: VmHWM, VmRSS); the 1-process run's final weights are compared with the N-process
run's. Results: ``benchmarks/results/distill_torchrun_cpu.json``.

The worker half of this file runs inside each process (``--worker``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _models(hidden: int, layers: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    from normswap.passes import SwapNorm

    config = transformers.LlamaConfig(
        vocab_size=8000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    teacher = transformers.LlamaForCausalLM(config).eval()
    example = torch.randint(0, 8000, (1, 16))
    student, _ = SwapNorm("dyt")(teacher, (example,), {})
    return teacher, student


def _memory() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024**2  # kB -> GB
    return {"peak_rss_gb": fields["VmHWM"], "rss_after_gb": fields["VmRSS"]}


def worker(args: argparse.Namespace) -> None:
    from normswap.calibrate.distill import distill
    from normswap.calibrate.parallel import DataParallel, full_state_dict, launched_by_torchrun

    parallel = DataParallel.from_environment() if launched_by_torchrun() else None
    teacher, student = _models(args.hidden, args.layers)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 8000, (args.batch, args.seq), generator=generator) for _ in range(4)]
    stamps: list[float] = []
    distilled, report = distill(
        teacher,
        student,
        batches,
        steps=args.steps,
        lr=1e-4,
        holdout=batches[0],
        inplace=True,
        parallel=parallel,
        on_step=lambda *_: stamps.append(time.perf_counter()),
    )
    step_times = [b - a for a, b in itertools.pairwise(stamps)][1:]
    state = full_state_dict(distilled, parallel)
    rank = parallel.rank if parallel is not None else 0
    record = {
        "rank": rank,
        "median_step_s": statistics.median(step_times),
        "step_times_s": step_times,
        "placement": report.placement,
        "losses": report.losses,
        **_memory(),
    }
    out = Path(args.worker)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(state, out / "state.pt")
    if parallel is not None:
        parallel.close()


def _run(processes: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    folder.mkdir()
    options = [
        "--worker", str(folder), "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
        "--hidden", str(args.hidden), "--layers", str(args.layers),
    ]  # fmt: skip
    if processes == 1:
        command = [sys.executable, __file__, *options]
    else:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={processes}",
        ]
        command = [*launch, __file__, *options]
    start = time.perf_counter()
    subprocess.run(
        command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, args.cores // processes))}
    )
    wall = time.perf_counter() - start
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(processes)]
    return {"processes": processes, "wall_s": wall, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in (int(p) for p in args.processes.split(",")):
            runs.append(_run(count, args, Path(tmp) / f"p{count}"))
            print(json.dumps({k: v for k, v in runs[-1].items()}, indent=1), flush=True)
        reference = torch.load(Path(tmp) / f"p{runs[0]['processes']}" / "state.pt")
        for run in runs[1:]:
            state = torch.load(Path(tmp) / f"p{run['processes']}" / "state.pt")
            run["worst_relative_difference_vs_first"] = max(
                ((reference[k] - state[k]).abs().max() / reference[k].abs().max()).item() for k in reference
            )
    teacher, student = _models(args.hidden, args.layers)
    result = {
        "command": "python benchmarks/bench_distill_torchrun.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": {
            "kind": "LlamaForCausalLM from a config, DyT student",
            "hidden": args.hidden,
            "layers": args.layers,
            "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
            "student_parameters": sum(p.numel() for p in student.parameters()),
        },
        "global_batch": [args.batch, args.seq],
        "steps": args.steps,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "distill_torchrun_cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        medians = [r["median_step_s"] for r in run["ranks"]]
        peaks = [r["peak_rss_gb"] for r in run["ranks"]]
        print(
            f"{run['processes']} processes: median step {max(medians):.3f} s, peak RSS per process "
            f"{', '.join(f'{p:.2f}' for p in peaks)} GB"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
