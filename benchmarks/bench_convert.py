"""What one `normswap convert` costs beside doing the same job by hand, measured side by side.

Four figures, each against the cheapest way to do the same work without normswap:

    exports   torch.export runs per command (the command runs in-process with torch.export.export
              counted): a .pt output, a .pt2 output, --exact, --fold-bn, and an ONNX output
    gpt2      the whole `convert --to rmsnorm --exact -o out.pt2` process on 24- and 48-layer GPT-2
              configs (n_embd 256) vs a process that builds the model, exports it once and saves the
              program, static and with the batch and sequence dims dynamic as normswap saves it; and how
              the command's time grows from 24 to 48 layers
    resnet50  `--fold-bn` on torchvision resnet50: the fold call vs torch.fx's `fuse()` in one process,
              and the whole command vs a process that builds, fuses with fx, compares the outputs on the
              inputs normswap checks and saves the program
    memory    the peak RSS of an exact LayerNorm -> RMSNorm pipeline on a GPT-2 of GPT-2 small's shapes
              above what its process held once the model was built, in units of the model's weight bytes
              (the converted model is 1x; what is above it is a copy the engine did not need)

Processes alternate (command, baseline, command, ...) so that a noisy machine slows both alike; medians
are reported with their ratio.

    python benchmarks/bench_convert.py [--repeats 3] [--only exports,gpt2,resnet50,memory]
                                       [--against FOLDER] [--out benchmarks/results]

``--against FOLDER`` also times each normswap command with FOLDER first on PYTHONPATH (a folder holding
links ``normswap`` and ``normswap_cli`` into an earlier checkout), interleaved with the others.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve()


# --- models, as factories the command line loads --------------------------------------------------


def gpt2() -> Any:
    """A GPT-2 from a config (NORMSWAP_BENCH_LAYERS, NORMSWAP_BENCH_WIDTH), random weights and norms."""
    import torch
    import transformers

    torch.manual_seed(0)
    layers = int(os.environ.get("NORMSWAP_BENCH_LAYERS", "2"))
    width = int(os.environ.get("NORMSWAP_BENCH_WIDTH", "256"))
    vocab = int(os.environ.get("NORMSWAP_BENCH_VOCAB", "1024"))
    # use_cache=False: what a user exporting it passes too (a DynamicCache output does not export)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.75, 1.25)
                module.bias.uniform_(-0.5, 0.5)
    return model, (), {"input_ids": torch.randint(0, vocab, (1, 32))}


def resnet50() -> Any:
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.75, 1.25)
                module.bias.uniform_(-0.5, 0.5)
    return model, (torch.rand(1, 3, 224, 224),)


def resnet18() -> Any:
    import torch
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval(), (torch.rand(1, 3, 64, 64),)


# --- the baselines, each run as its own process ---------------------------------------------------


def _baseline_export(factory: str, out: str, dynamic: bool = False) -> None:
    """Build, export once, save the program: the least a .pt2 output can cost. ``dynamic``: with the
    batch and sequence dims free, as normswap saves a .pt2 (``Dim.AUTO`` on every dim of the token ids),
    so that both sides write a program of the same use."""
    import torch

    model, args, kwargs = (*globals()[factory](), {})[:3]
    shapes = None
    if dynamic:
        auto = torch.export.Dim.AUTO
        shapes = {name: {i: auto for i in range(value.ndim)} for name, value in kwargs.items()}
    program = torch.export.export(model, args, kwargs=kwargs, dynamic_shapes=shapes, strict=False)
    torch.export.save(program, out)


# The inputs `convert --fold-bn` checks resnet50's fold on (its report's "input_variants": the example,
# batch 2 and two other image sizes), which the hand-made process checks too: the same validation work on
# both sides.
_RESNET50_CHECKED = ((1, 3, 224, 224), (2, 3, 224, 224), (1, 3, 56, 56), (1, 3, 316, 316))


def _baseline_fx_fold(out: str) -> None:
    """Build resnet50, fold its BNs with torch.fx, compare the outputs on the inputs normswap checks,
    export and save."""
    import torch
    from torch.fx.experimental.optimization import fuse

    model, args = resnet50()
    folded = fuse(model)
    with torch.no_grad():
        for shape in _RESNET50_CHECKED:
            x = torch.rand(shape)
            want = model(x)  # within 1e-4 x max|ref|, normswap's fp32 rule for a fold's rounding
            torch.testing.assert_close(folded(x), want, rtol=0, atol=1e-4 * float(want.abs().max()))
    torch.export.save(torch.export.export(folded, args, strict=False), out)


# --- measuring ------------------------------------------------------------------------------------


def _normswap(*argv: str) -> list[str]:
    return [sys.executable, "-c", "from normswap_cli.app import main; main()", *argv]


# Linux records the peak RSS of the memory a process had before it exec'd into its ``ru_maxrss``; a child
# started by vfork (as subprocess does) had its parent's, so a benchmark that wrote gigabytes of synthetic
# weights saw its own peak in every child's. The command is started by this small launcher instead, whose
# memory is the floor of what wait4 reports.
_LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(child.pid, 0)
print(usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status))
"""


def _run_rss(command: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child, read with wait4 so that only this child counts
    (started through :data:`_LAUNCHER`, so its parent's memory does not)."""
    start = time.perf_counter()
    launcher = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *command],
        env={**os.environ, **(env or {})},
        capture_output=True,
        check=False,
    )
    seconds = time.perf_counter() - start
    err = launcher.stderr.decode(errors="replace")
    try:
        peak, returncode = (int(x) for x in launcher.stdout.decode().split()[-2:])
    except ValueError:
        raise RuntimeError(f"the launcher failed: {err[-2000:]}") from None
    if returncode != 0:
        raise RuntimeError(f"{' '.join(command[:8])} ... exited {returncode}: {err[-2000:]}")
    return seconds, peak


def _alternate(commands: dict[str, tuple[list[str], dict[str, str]]], repeats: int) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    rss: dict[str, list[int]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, (command, env) in commands.items():
            s, peak = _run_rss(command, env)
            seconds[name].append(s)
            rss[name].append(peak)
    return {
        name: {
            "median_s": statistics.median(seconds[name]),
            "runs_s": seconds[name],
            "peak_rss": max(rss[name]),
        }
        for name in commands
    }


def count_exports(case: str) -> dict[str, Any]:
    """Run one command in this process with torch.export.export counted."""
    import torch
    from normswap_cli.app import app
    from typer.testing import CliRunner

    calls: list[str] = []
    real = torch.export.export

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("dynamic" if kwargs.get("dynamic_shapes") else "static")
        return real(*args, **kwargs)

    torch.export.export = counted  # the benchmark's own process, restored below
    cases = {
        "gpt2 --to rmsnorm -o .pt": ("gpt2", ["--to", "rmsnorm"], ".pt"),
        "gpt2 --to rmsnorm -o .pt2": ("gpt2", ["--to", "rmsnorm"], ".pt2"),
        "gpt2 --to rmsnorm --exact -o .pt2": ("gpt2", ["--to", "rmsnorm", "--exact"], ".pt2"),
        "gpt2 --to fused -o .onnx": ("gpt2", ["--to", "fused"], ".onnx"),
        "resnet18 --fold-bn -o .pt": ("resnet18", ["--fold-bn"], ".pt"),
        "resnet18 --fold-bn -o .pt2": ("resnet18", ["--fold-bn"], ".pt2"),
    }
    factory, flags, suffix = cases[case]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = CliRunner().invoke(
                app, ["convert", f"{HERE}:{factory}", *flags, "-o", f"{tmp}/out{suffix}"]
            )
    finally:
        torch.export.export = real
    return {"case": case, "exit": result.exit_code, "exports": len(calls), "kinds": calls}


def bench_exports() -> list[dict[str, Any]]:
    rows = []
    for case in (
        "gpt2 --to rmsnorm -o .pt",
        "gpt2 --to rmsnorm -o .pt2",
        "gpt2 --to rmsnorm --exact -o .pt2",
        "gpt2 --to fused -o .onnx",
        "resnet18 --fold-bn -o .pt",
        "resnet18 --fold-bn -o .pt2",
    ):
        done = subprocess.run(
            [sys.executable, str(HERE), "--count-exports", case], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{case}: {done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(
            f"exports  {case:40s} {rows[-1]['exports']} ({', '.join(rows[-1]['kinds'])}), exit {rows[-1]['exit']}"
        )
    return rows


def _against(commands: dict[str, Any], against: str | None) -> dict[str, Any]:
    """Add "<name> (against)": the same normswap command with ``against`` first on PYTHONPATH (an earlier
    checkout), so that before and after are timed side by side in one run."""
    if against is None:
        return commands
    extra = {
        f"{name} (against)": (command, {**env, "PYTHONPATH": against})
        for name, (command, env) in commands.items()
        if command[:3] == _normswap()[:3]
    }
    return {**commands, **extra}


def bench_gpt2(repeats: int, tmp: str, against: str | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for layers in (24, 48):
        env = {"NORMSWAP_BENCH_LAYERS": str(layers)}
        out = f"{tmp}/g{layers}.pt2"
        baseline = [sys.executable, str(HERE), "--baseline-export", "gpt2", f"{tmp}/b.pt2"]
        commands = {
            "convert": (
                _normswap("convert", f"{HERE}:gpt2", "--to", "rmsnorm", "--exact", "-o", out, "--overwrite"),
                env,
            ),
            "build+export+save": (baseline, env),
            "build+export dynamic+save": ([*baseline, "dynamic"], env),
        }
        one = figures[layers] = _alternate(_against(commands, against), repeats)
        one["ratio"] = one["convert"]["median_s"] / one["build+export+save"]["median_s"]
        one["ratio_dynamic"] = one["convert"]["median_s"] / one["build+export dynamic+save"]["median_s"]
        print(
            f"gpt2 {layers} layers: convert {one['convert']['median_s']:.1f} s, build+export+save "
            f"{one['build+export+save']['median_s']:.1f} s (ratio {one['ratio']:.2f}x), with dynamic shapes "
            f"{one['build+export dynamic+save']['median_s']:.1f} s (ratio {one['ratio_dynamic']:.2f}x)"
            + (f"; against: {one['convert (against)']['median_s']:.1f} s" if against else "")
        )
    figures["growth_24_to_48"] = figures[48]["convert"]["median_s"] / figures[24]["convert"]["median_s"]
    print(f"gpt2 convert time 24 -> 48 layers: {figures['growth_24_to_48']:.2f}x")
    return figures


def bench_resnet50(repeats: int, tmp: str, against: str | None = None) -> dict[str, Any]:
    from torch.fx.experimental.optimization import fuse

    from normswap.passes import fold_batchnorm

    model, args = resnet50()
    ours, theirs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fold_batchnorm(model, args)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        fuse(model)
        theirs.append(time.perf_counter() - start)
    del model
    calls = {
        "fold_batchnorm_s": statistics.median(ours),
        "fx_fuse_s": statistics.median(theirs),
    }
    calls["ratio"] = calls["fold_batchnorm_s"] / calls["fx_fuse_s"]
    print(
        f"resnet50 fold call {calls['fold_batchnorm_s']:.2f} s vs fx fuse() {calls['fx_fuse_s']:.2f} s: {calls['ratio']:.2f}x"
    )
    commands = {
        "convert --fold-bn": (
            _normswap("convert", f"{HERE}:resnet50", "--fold-bn", "-o", f"{tmp}/r.pt2", "--overwrite"),
            {},
        ),
        "build+fx fuse+compare+save": (
            [sys.executable, str(HERE), "--baseline-fx-fold", f"{tmp}/rb.pt2"],
            {},
        ),
    }
    processes = _alternate(_against(commands, against), repeats)
    processes["ratio"] = (
        processes["convert --fold-bn"]["median_s"] / processes["build+fx fuse+compare+save"]["median_s"]
    )
    print(
        f"resnet50 whole process: convert {processes['convert --fold-bn']['median_s']:.1f} s vs fx "
        f"{processes['build+fx fuse+compare+save']['median_s']:.1f} s: {processes['ratio']:.2f}x"
        + (f"; against: {processes['convert --fold-bn (against)']['median_s']:.1f} s" if against else "")
    )
    return {"calls": calls, "processes": processes}


def _memory_child() -> None:
    """In this process: load everything on a small model first, build the large one, then convert it;
    prints the weight bytes and the peak RSS above what the process held once the model was built."""
    from normswap.passes import Pipeline, RecenterLayerNorm

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    layers, width, vocab = (
        os.environ.pop(k) for k in ("NORMSWAP_BENCH_LAYERS", "NORMSWAP_BENCH_WIDTH", "NORMSWAP_BENCH_VOCAB")
    )
    small, _, inputs = gpt2()
    Pipeline([RecenterLayerNorm()])(small, None, inputs)
    del small
    os.environ.update(NORMSWAP_BENCH_LAYERS=layers, NORMSWAP_BENCH_WIDTH=width, NORMSWAP_BENCH_VOCAB=vocab)
    model, _, inputs = gpt2()
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    base = rss()
    _, report = Pipeline([RecenterLayerNorm()])(model, None, inputs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert report.ok and report.passes[0].changes, "the conversion changed nothing: nothing measured"
    print(json.dumps({"weight_bytes": weight_bytes, "peak_above_model": peak - base}))


def bench_memory() -> dict[str, Any]:
    """GPT-2 small's shapes (12 layers, n_embd 768, vocabulary 50257): LayerNorm -> RMSNorm, exact."""
    env = {"NORMSWAP_BENCH_LAYERS": "12", "NORMSWAP_BENCH_WIDTH": "768", "NORMSWAP_BENCH_VOCAB": "50257"}
    done = subprocess.run(
        [sys.executable, str(HERE), "--memory-child"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory: {done.stderr[-2000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["copies_above_model"] = figures["peak_above_model"] / figures["weight_bytes"]
    print(
        f"memory: weights {figures['weight_bytes'] / 2**20:.0f} MiB; peak RSS above the built model "
        f"{figures['peak_above_model'] / 2**20:.0f} MiB = {figures['copies_above_model']:.2f}x the weight bytes "
        f"(the model itself is 1x more: {1 + figures['copies_above_model']:.2f}x in all)"
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="exports,gpt2,resnet50,memory")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--against",
        help="a folder put first on PYTHONPATH for a second run of each command (an earlier checkout)",
    )
    parser.add_argument("--count-exports", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-export", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-fx-fold", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.count_exports:
        print(json.dumps(count_exports(options.count_exports)))
        return
    if options.baseline_export:
        factory, out, *dynamic = options.baseline_export
        _baseline_export(factory, out, dynamic=dynamic == ["dynamic"])
        return
    if options.baseline_fx_fold:
        _baseline_fx_fold(options.baseline_fx_fold)
        return
    if options.memory_child:
        _memory_child()
        return
    import torch

    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "repeats": options.repeats,
    }
    wanted = options.only.split(",")
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / "convert_cpu.json"
    sections = {
        "exports": bench_exports,
        "gpt2": lambda: bench_gpt2(options.repeats, tmp, options.against),
        "resnet50": lambda: bench_resnet50(options.repeats, tmp, options.against),
        "memory": bench_memory,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in sections.items():
            if name in wanted:
                results[name] = run()
                # written after every section, so that a later one failing loses nothing measured
                path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
