"""Peak memory per process of `normswap distill` with models whose weights dominate memory: one process
against torchrun, the student a model directory and a .pt2.

    python benchmarks/bench_distill_memory.py [--hidden 1536] [--layers 11] [--processes 2] [--lr 1e-5]
        [--variant "--activation-checkpointing" ...] [--out benchmarks/results]

A Llama directory (fp32, random weights, 1.54 GB at the defaults) is the teacher and its LayerNorm
conversion the student, once as a directory and once as a .pt2. `normswap distill` runs 2 steps (every
parameter trained, AdamW) in one process, then under `torchrun --standalone --nproc-per-node N` with the
teacher sharded: there the student is read straight into its FSDP2 shards (the .pt2 from its archive's
members, unflattened so that its blocks are units), the teacher too; the directory student is written
shard by shard, the .pt2 student as a .dcp (a .pt2 output is one file, gathered to process 0 by design).
Peak RSS is ``wait4``'s figure for the command (for torchrun, its largest process). The trained students
of one and of N processes are loaded afterwards and their logits compared on one batch (Adam turns a
gradient that differs in its last bits into an update that differs by up to ``lr``, so the difference
grows with ``lr``). Each ``--variant`` (extra distill options) runs under torchrun with the directory
student. Results: ``benchmarks/results/distill_memory_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import _run_rss

RESULTS = Path(__file__).resolve().parent / "results"


def write_models(
    root: Path,
    hidden: int,
    layers: int,
    student: tuple[str, ...] = ("--to", "layernorm"),
    name: str = "student",
) -> tuple[Path, Path, Path, int]:
    """A fp32 Llama directory with random weights (the teacher), ``normswap convert TEACHER *student -o
    ROOT/name`` (the student), 12 x 64 token ids (the data), and the parameter count."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    teacher = root / "teacher"
    model.save_pretrained(teacher)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    converted = root / name
    subprocess.run(
        [sys.executable, "-m", "normswap_cli", "convert", str(teacher), *student, "-o", str(converted)],
        check=True, capture_output=True,
    )  # fmt: skip
    data = root / "data.pt"
    torch.save(torch.randint(0, 32000, (12, 64), generator=torch.Generator().manual_seed(1)), data)
    return teacher, converted, data, parameters


def _distill(
    root: Path,
    teacher: Path,
    student: Path,
    data: Path,
    processes: int,
    lr: float,
    extra: list[str],
    name: str,
    output_suffix: str = "",
) -> dict:
    output = root / f"out-{name}{output_suffix}"
    common = [
        "distill", str(teacher), str(student), "--trust-pickle", "--data", str(data), "--batch-size", "4",
        "--steps", "2", "--lr", str(lr), "-o", str(output), *extra,
    ]  # fmt: skip
    if processes == 1:
        command = [sys.executable, "-m", "normswap_cli", *common]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "normswap_cli", *common, "--shard-teacher",
        ]  # fmt: skip
    seconds, peak = _run_rss(command, {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))})
    return {"seconds": seconds, "peak_rss_bytes": peak, "output": output}


def _logits(trained: Path, student: Path) -> torch.Tensor:
    """The logits of a trained student: a model directory, or a .dcp folder read into ``student``."""
    from normswap.load import load_model

    ids = torch.randint(0, 32000, (2, 32), generator=torch.Generator().manual_seed(3))
    if trained.suffix == ".dcp":
        import torch.distributed.checkpoint as dcp

        model = load_model(str(student)).model
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(trained), no_dist=True)
        model.load_state_dict(state)
    else:
        model = load_model(str(trained)).model
    with torch.no_grad():
        return model(input_ids=ids).logits


def _relative(first: torch.Tensor, second: torch.Tensor) -> float:
    return ((first - second).abs().max() / first.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--variant", action="append", default=[], help="extra distill options, one run each")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    n = args.processes
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        teacher, student, data, parameters = write_models(root, args.hidden, args.layers)
        program = root / "student.pt2"
        subprocess.run(
            [sys.executable, "-m", "normswap_cli", "convert", str(teacher), "--to", "layernorm", "-o", str(program)],
            check=True, capture_output=True,
        )  # fmt: skip
        weights = sum(f.stat().st_size for f in teacher.glob("*.safetensors"))
        # (processes, student, extra options, output suffix): the .pt2 student is written as .dcp (a .pt2
        # output is one file, gathered whole to process 0 by design)
        plans = {"1": (1, student, [], ""), str(n): (n, student, [], "")}
        plans.update({f"{n} {v}": (n, student, v.split(), "") for v in args.variant})
        plans.update({"pt2 1": (1, program, [], ".dcp"), f"pt2 {n}": (n, program, [], ".dcp")})
        runs = {}
        for name, (processes, model, extra, suffix) in plans.items():
            runs[name] = _distill(
                root, teacher, model, data, processes, args.lr, extra, name.replace(" ", ""), suffix
            )
            print(f"{name}: peak RSS of the largest process {runs[name]['peak_rss_bytes'] / 1e9:.2f} GB, "
                  f"{runs[name]['seconds']:.1f} s", flush=True)  # fmt: skip
        difference = _relative(
            _logits(runs["1"]["output"], student), _logits(runs[str(n)]["output"], student)
        )
        program_difference = _relative(
            _logits(runs["pt2 1"]["output"], program), _logits(runs[f"pt2 {n}"]["output"], program)
        )
    one, many = runs["1"]["peak_rss_bytes"], runs[str(n)]["peak_rss_bytes"]
    program_ratio = runs[f"pt2 {n}"]["peak_rss_bytes"] / runs["pt2 1"]["peak_rss_bytes"]
    result = {
        "command": "python benchmarks/bench_distill_memory.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": {
            "kind": "LlamaForCausalLM fp32 teacher directory; its --to layernorm student as a directory "
            "(runs '1', 'N', variants) and as a .pt2 (runs 'pt2 ...', written as .dcp)",
            "hidden": args.hidden,
            "layers": args.layers,
            "parameters": parameters,
            "teacher_bytes": weights,
        },
        "lr": args.lr,
        "runs": {
            name: {
                "seconds": r["seconds"],
                "peak_rss_bytes": r["peak_rss_bytes"],
                "ratio_to_one_process": r["peak_rss_bytes"]
                / runs["pt2 1" if name.startswith("pt2") else "1"]["peak_rss_bytes"],
            }
            for name, r in runs.items()
        },
        "peak_per_process_ratio": many / one,
        "pt2_peak_per_process_ratio": program_ratio,
        "goal_ratio": 0.6,
        "trained_logits_max_abs_over_max": difference,
        "pt2_trained_logits_max_abs_over_max": program_difference,
        "ru_maxrss_note": "wait4's maxrss: for torchrun, the largest single process of its tree",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "distill_memory_cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"weights {weights / 1e9:.2f} GB; per process {many / one:.2f}x of one process (directory student), "
        f"{program_ratio:.2f}x (.pt2 student); logits {difference:.2e}, {program_difference:.2e}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
