"""Bandwidth of normswap's fused norms against torch eager, torch.compile and Liger-Kernel (CUDA only).

For each norm (rms, layer), op, dtype and [M, N] shape, every provider (torch eager, torch.compile,
Liger-Kernel when installed, normswap) is timed as the median of repeats with the L2 cache flushed
before each one (``triton.testing.do_bench``), and reported as effective bandwidth over the bytes the
op must move, s being the element size:

    fwd:     2 * M * N * s   (read x, write y)
    bwd:     3 * M * N * s   (read x and dy, write dx)
    add_fwd: 4 * M * N * s   (h = x + residual, y = norm(h): read x and residual, write y and h)
    add_bwd: 4 * M * N * s   (read h, dy and dh, write dx; d(residual) is d(x), the same tensor,
                              so it is written once, and x and residual need not be read again)

The backwards are the backward through autograd (what training pays) from gradients given for every
output (dy, and dh for add_bwd), to x (and residual), weight and bias; the parameter gradients' O(N)
bytes are not counted. Liger-Kernel has no fused add + LayerNorm, so its add_* LayerNorm columns are
empty, with the reason in the record's note.

A device-to-device copy measured in the same run gives the roofline each figure is divided by.
The summary checks DESIGN.md's goals on bf16, M >= 16K rows, N in 2K..32K: median fraction of copy
forward >= 90%, backward >= 70%, fused add + norm forward >= 85% and backward >= 70%; whether normswap
is ahead of every other provider on each of those shapes; and, for small M (<= 256), normswap's median
time against eager's and compile's (no host-overhead floor). Results go to benchmarks/results/ as JSON
and, when matplotlib is installed, a PNG.

    python benchmarks/bench_norms.py --quick
    python benchmarks/bench_norms.py --norms rms --ops fwd bwd --dtypes bf16 --m 16384 --n 4096 8192

``run`` takes the device and the timing function as parameters, so the tests exercise it on the CPU
with a fake timer; ``main`` refuses without CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

M_ALL = (1, 128, 4096, 16384, 65536)
N_ALL = (768, 1024, 2048, 4096, 5120, 8192, 16384, 32768, 65536)
M_QUICK = (4096, 16384)
N_QUICK = (2048, 4096, 8192, 32768)
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
OPS = ("fwd", "bwd", "add_fwd", "add_bwd")
NORMS = ("rms", "layer")
PROVIDERS = ("eager", "compile", "liger", "normswap")
# One color per provider in every panel (a panel without some provider must not shift the others).
PROVIDER_COLORS = {"eager": "C0", "compile": "C1", "liger": "C2", "normswap": "C3"}
BYTES_PER_ELEMENT_MOVED = {"fwd": 2, "bwd": 3, "add_fwd": 4, "add_bwd": 4}
EPS = 1e-6
RESULTS = Path(__file__).resolve().parent / "results"

# DESIGN.md's goals: median fraction of copy bandwidth over the goal region, per op.
TARGETS = {"fwd": 0.9, "bwd": 0.7, "add_fwd": 0.85, "add_bwd": 0.7}
GOAL_DTYPE = "bf16"
GOAL_M_MIN = 16384
GOAL_N = (2048, 32768)
SMALL_M = 256  # "small M": rows where host overhead, not bandwidth, bounds the time

# Timing functions: (fn, rep, grad_to_none=None) -> median milliseconds of one call of fn.
Timer = Callable[..., float]


@dataclass
class Record:
    norm: str
    op: str
    dtype: str
    m: int
    n: int
    provider: str
    nbytes: int
    ms: float | None = None
    gbps: float | None = None
    frac_of_copy: float | None = None
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help=f"bf16 only, M in {M_QUICK}, N in {N_QUICK}")
    p.add_argument("--norms", nargs="+", choices=NORMS, default=list(NORMS))
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None, help="default: bf16 fp32")
    p.add_argument("--m", nargs="+", type=int, default=None, help=f"rows (default {M_ALL})")
    p.add_argument("--n", nargs="+", type=int, default=None, help=f"hidden sizes (default {N_ALL})")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument(
        "--compile-m", nargs="+", type=int, default=None, help="measure torch.compile only at these M"
    )
    p.add_argument(
        "--compile-n", nargs="+", type=int, default=None, help="measure torch.compile only at these N"
    )
    p.add_argument(
        "--compile-dtypes", nargs="+", choices=list(DTYPES), default=None, help="... and these dtypes"
    )
    p.add_argument("--rep", type=int, default=100, help="target time per measurement, ms (do_bench rep)")
    p.add_argument("--mem-fraction", type=float, default=0.6, help="skip shapes needing more of free memory")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    args = p.parse_args(argv)
    if args.dtypes is None:
        args.dtypes = ["bf16"] if args.quick else ["bf16", "fp32"]
    if args.m is None:
        args.m = list(M_QUICK if args.quick else M_ALL)
    if args.n is None:
        args.n = list(N_QUICK if args.quick else N_ALL)
    return args


# ---------------------------------------------------------------------------------------------------
# Providers: each returns a function of (x, residual, weight, bias) -> y (or (y, h) with the residual
# add), or raises NotImplementedError with the reason it does not apply.


def _eager(norm: str, add: bool) -> Callable:
    import torch.nn.functional as F

    def fn(x, r, w, b):
        h = x + r if add else x
        y = (
            F.rms_norm(h, (h.shape[-1],), w, EPS)
            if norm == "rms"
            else F.layer_norm(h, (h.shape[-1],), w, b, EPS)
        )
        return (y, h) if add else y

    return fn


def _compiled(norm: str, add: bool) -> Callable:
    import torch

    # A fresh compiled function per shape (dynamic=False): the fastest inductor can do for that shape.
    # Every shape recompiles the same code object; without the reset, dynamo's recompile limits
    # (8 per code object, 256 accumulated) would make later shapes fall back to eager silently.
    torch._dynamo.reset()
    return torch.compile(_eager(norm, add), dynamic=False)


def _normswap(norm: str, add: bool) -> Callable:
    from normswap.kernels import add_layer_norm, add_rms_norm, layer_norm, rms_norm

    if add:
        f = add_rms_norm if norm == "rms" else add_layer_norm
        return lambda x, r, w, b: f(x, r, w, b, EPS)
    f = rms_norm if norm == "rms" else layer_norm
    return lambda x, r, w, b: f(x, w, b, EPS)


def _liger(norm: str, add: bool) -> Callable:
    try:
        if norm == "rms" and not add:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, r, w, b: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "none")
        if norm == "layer" and not add:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, r, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
        if norm == "rms" and add:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

            # returns (y, h); its backward takes (dy, dh) and gives d(x) = d(residual)
            return lambda x, r, w, b: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "none")
    except ImportError as e:
        raise NotImplementedError(f"liger-kernel not importable: {e}") from e
    raise NotImplementedError("liger-kernel has no fused add + LayerNorm")


MAKERS = {"eager": _eager, "compile": _compiled, "liger": _liger, "normswap": _normswap}


# ---------------------------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], object], rep: int, grad_to_none=None) -> float:
    """CUDA timing: do_bench flushes L2 (writes a 256 MB buffer) before every repeat; the median."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def measure_copy_gbps(
    rep: int, device: str = "cuda", timer: Timer = _median_ms, numel: int = 1 << 29
) -> float:
    """Device-to-device copy bandwidth (read + write), 1 GiB by default: the memory-bound roofline."""
    import torch

    src = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), rep)
    return 2 * numel * src.element_size() / ms / 1e6


def _bench_one(
    provider: str,
    norm: str,
    op: str,
    dtype,
    m: int,
    n: int,
    rep: int,
    device: str = "cuda",
    timer: Timer = _median_ms,
) -> float:
    import torch

    add = op.startswith("add_")
    fn = MAKERS[provider](norm, add)
    x = torch.randn(m, n, device=device, dtype=dtype)
    r = torch.randn_like(x) if add else None
    w = torch.randn(n, device=device, dtype=dtype)
    b = torch.randn(n, device=device, dtype=dtype) if norm == "layer" else None
    if op in ("fwd", "add_fwd"):
        with torch.no_grad():
            fn(x, r, w, b)  # compile / autotune outside the timing
            return timer(lambda: fn(x, r, w, b), rep)
    # bwd / add_bwd: the backward through autograd, from a gradient for every output.
    inputs = [t for t in (x, r, w, b) if t is not None]
    for t in inputs:
        t.requires_grad_()
    out = fn(x, r, w, b)
    outputs = tuple(out) if add else (out,)  # add: (y, h)
    grads = tuple(torch.randn_like(t) for t in outputs)  # dy (, dh)

    def backward():
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=True)

    backward()  # compile / autotune outside the timing
    return timer(backward, rep)


def _compile_measured(args: argparse.Namespace, dtype_name: str, m: int, n: int) -> bool:
    def allows(values, value) -> bool:
        return values is None or value in values

    return (
        allows(getattr(args, "compile_m", None), m)
        and allows(getattr(args, "compile_n", None), n)
        and allows(getattr(args, "compile_dtypes", None), dtype_name)
    )


def _needed_bytes(op: str, m: int, n: int, itemsize: int) -> int:
    # Inputs, outputs, saved tensors and fp32 temporaries of the hungriest provider, roughly.
    live = {"fwd": 3, "bwd": 6, "add_fwd": 5, "add_bwd": 8}[op]
    return live * m * n * max(itemsize, 4)


def run(
    args: argparse.Namespace,
    device: str = "cuda",
    timer: Timer = _median_ms,
    *,
    copy_numel: int = 1 << 29,
    on_progress: Callable[[dict], None] | None = None,
) -> dict:
    """Measure every (dtype, norm, op, M, N, provider) of ``args``; returns {"meta", "records"}.

    ``device`` and ``timer`` (``(fn, rep, grad_to_none=None) -> ms``) are what the tests replace to
    run it on the CPU; the copy is measured with them too, on ``copy_numel`` bf16 elements.
    ``on_progress`` gets the result so far (``meta["complete"]`` False) after every shape, so a run
    stopped by a time limit still leaves what it measured.
    """
    import torch

    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and "compile" in args.providers:
        torch._dynamo.config.cache_size_limit = 1024
    copy_gbps = measure_copy_gbps(args.rep, device, timer, copy_numel)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    meta = _meta(device, on_cuda, copy_gbps, timer)
    records: list[Record] = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, DTYPES[dtype_name])
        itemsize = torch.empty((), dtype=dtype).element_size()
        for norm in args.norms:
            for op in args.ops:
                for m in args.m:
                    for n in args.n:
                        nbytes = BYTES_PER_ELEMENT_MOVED[op] * m * n * itemsize
                        too_big = False
                        if on_cuda:
                            free, _ = torch.cuda.mem_get_info()
                            too_big = _needed_bytes(op, m, n, itemsize) > args.mem_fraction * free
                        for provider in args.providers:
                            rec = Record(norm, op, dtype_name, m, n, provider, nbytes)
                            if too_big:
                                rec.note = "skipped: does not fit in memory"
                            elif provider == "compile" and not _compile_measured(args, dtype_name, m, n):
                                # Each shape is a fresh compile of a few seconds: a full grid takes longer
                                # than a GPU lease, so a run may measure compile on a subset only.
                                rec.note = "not measured here (--compile-m/--compile-n/--compile-dtypes)"
                            else:
                                try:
                                    rec.ms = _bench_one(
                                        provider, norm, op, dtype, m, n, args.rep, device, timer
                                    )
                                    rec.gbps = nbytes / rec.ms / 1e6
                                    rec.frac_of_copy = rec.gbps / copy_gbps
                                except NotImplementedError as e:
                                    rec.note = str(e)
                                except torch.OutOfMemoryError:
                                    rec.note = "out of memory"
                                finally:
                                    if on_cuda:
                                        torch.cuda.empty_cache()
                            records.append(rec)
                            shown = (
                                f"{rec.gbps:7.0f} GB/s ({rec.frac_of_copy:4.0%})" if rec.gbps else rec.note
                            )
                            print(f"{norm:5} {op:7} {dtype_name:4} M={m:<6} N={n:<6} {provider:9} {shown}")
                        if on_progress is not None:
                            on_progress(
                                {"meta": {**meta, "complete": False}, "records": [asdict(r) for r in records]}
                            )
    return {"meta": {**meta, "complete": True}, "records": [asdict(r) for r in records]}


def _meta(device: str, on_cuda: bool, copy_gbps: float, timer: Timer) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name(device) if on_cuda else f"{device} ({platform.machine()})",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "copy_gbps": copy_gbps,
        "bytes": ", ".join(f"{op} {k}*M*N*s" for op, k in BYTES_PER_ELEMENT_MOVED.items()),
        "timing": (
            "triton.testing.do_bench median, L2 flushed before each repeat"
            if timer is _median_ms
            else getattr(timer, "__name__", type(timer).__name__)
        ),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        # normswap's eager route per shape (normswap.kernels._routes): built-in rules or a tuner's file
        "route_rules": os.environ.get("NORMSWAP_ROUTE_RULES", "built-in"),
        "forced_route": os.environ.get("NORMSWAP_KERNEL_ROUTE", "none"),
    }


def write_json(result: dict, path: Path) -> None:
    """Write ``result`` to ``path`` whole or not at all (normswap's own atomic write)."""
    from normswap.load.save import atomic_write

    atomic_write(path, lambda temp: temp.write_text(json.dumps(result, indent=1)))


# ---------------------------------------------------------------------------------------------------
# Summary: a pure function of run()'s result.


def _in_goal_region(r: dict) -> bool:
    return r["dtype"] == GOAL_DTYPE and r["m"] >= GOAL_M_MIN and GOAL_N[0] <= r["n"] <= GOAL_N[1]


def _shape(r: dict) -> str:
    return f"{r['dtype']} M={r['m']} N={r['n']}"


def summarize(result: dict) -> str:
    """DESIGN.md's goals against the measured records.

    Per op and norm, over the goal region (bf16, M >= 16K, N in 2K..32K): each provider's median
    fraction of copy against the op's target ("ok" / "below"), and on how many of those shapes normswap
    is not ahead of every other provider measured on it (with the worst one). Per op, for M <= 256: the
    median time of normswap against eager and compile over the shapes all of them measured.
    """
    measured = [r for r in result["records"] if r.get("gbps") is not None and r.get("ms") is not None]
    lines = [
        f"goal region: {GOAL_DTYPE}, M >= {GOAL_M_MIN}, N in {GOAL_N[0]}..{GOAL_N[1]}; "
        "median fraction of the copy bandwidth"
    ]
    for op in OPS:
        target = TARGETS[op]
        for norm in NORMS:
            goal = [r for r in measured if r["op"] == op and r["norm"] == norm and _in_goal_region(r)]
            for provider in PROVIDERS:
                fr = [r["frac_of_copy"] for r in goal if r["provider"] == provider]
                if fr:
                    med = statistics.median(fr)
                    mark = "ok" if med >= target else "below"
                    lines.append(
                        f"{op:7} {norm:5} {provider:9} median {med:5.0%} of copy over {len(fr)} shapes "
                        f"({mark} {target:.0%})"
                    )
            by_shape: dict[tuple, dict[str, dict]] = {}
            for r in goal:
                by_shape.setdefault((r["dtype"], r["m"], r["n"]), {})[r["provider"]] = r
            compared = [v for v in by_shape.values() if "normswap" in v and len(v) > 1]
            if not compared:
                continue
            behind = []  # (normswap / best other, normswap record, best other record)
            for v in compared:
                ours = v["normswap"]
                best = max((r for p, r in v.items() if p != "normswap"), key=lambda r: r["gbps"])
                if ours["gbps"] <= best["gbps"]:
                    behind.append((ours["gbps"] / best["gbps"], ours, best))
            if behind:
                _, ours, best = min(behind, key=lambda t: t[0])
                lines.append(
                    f"{op:7} {norm:5} normswap not ahead on {len(behind)} of {len(compared)} shapes; "
                    f"worst {_shape(ours)}: normswap {ours['gbps']:.0f} GB/s vs "
                    f"{best['provider']} {best['gbps']:.0f} GB/s"
                )
            else:
                lines.append(f"{op:7} {norm:5} normswap ahead on all {len(compared)} shapes")
    for op in OPS:
        by_shape = {}
        for r in measured:
            if r["op"] == op and r["m"] <= SMALL_M:
                by_shape.setdefault((r["norm"], r["dtype"], r["m"], r["n"]), {})[r["provider"]] = r["ms"]
        others = [p for p in ("eager", "compile") if any(p in v for v in by_shape.values())]
        shapes = [v for v in by_shape.values() if "normswap" in v and all(p in v for p in others)]
        if not others or not shapes:
            continue
        us = {p: statistics.median(v[p] for v in shapes) * 1e3 for p in ("normswap", *others)}
        slower = sum(v["normswap"] > min(v[p] for p in others) for v in shapes)
        mark = "ok" if us["normswap"] <= min(us[p] for p in others) else "slower"
        vs = ", ".join(f"{p} {us[p]:.1f} us" for p in others)
        lines.append(
            f"{op:7} small M (<= {SMALL_M}): normswap median {us['normswap']:.1f} us vs {vs} over "
            f"{len(shapes)} shapes; slower than the fastest of them on {slower} ({mark})"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = result["records"]
    panels = sorted({(r["norm"], r["op"], r["dtype"]) for r in recs})
    m_plot = max((r["m"] for r in recs), key=lambda m: (m <= 16384, m))  # 16384 rows when measured
    cols = len(OPS)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (norm, op, dtype) in zip(axes.flat, panels, strict=False):
        for provider in PROVIDERS:
            pts = sorted(
                (r["n"], r["gbps"])
                for r in recs
                if (r["norm"], r["op"], r["dtype"], r["provider"], r["m"])
                == (norm, op, dtype, provider, m_plot)
                and r["gbps"]
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=provider, color=PROVIDER_COLORS[provider])
        ax.axhline(result["meta"]["copy_gbps"], color="gray", linestyle="--", label="d2d copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{norm} {op} {dtype}, M={m_plot}")
        ax.set_xlabel("N")
        ax.set_ylabel("GB/s")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize="small")
    fig.suptitle(result["meta"]["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_norms needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_norms needs a CUDA device (none found); nothing was measured.", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_norms needs triton (for the kernels and for do_bench)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_norms" + (f"_{args.tag}" if args.tag else "")
    # What is measured so far goes to a file of its own (a run stopped by a time limit leaves it), never
    # over the results of an earlier complete run.
    partial_path = args.out / f"{stem}.partial.json"
    command = " ".join(["python benchmarks/bench_norms.py", *(sys.argv[1:] if argv is None else argv)])

    def save_partial(partial: dict) -> None:
        partial["meta"]["command"] = command
        write_json(partial, partial_path)

    result = run(args, on_progress=save_partial)
    result["meta"]["command"] = command
    write_json(result, args.out / f"{stem}.json")
    partial_path.unlink(missing_ok=True)
    print(summarize(result))
    print(f"wrote {args.out / (stem + '.json')}")
    if plot(result, args.out / f"{stem}.png"):
        print(f"wrote {args.out / (stem + '.png')}")
    else:
        print("matplotlib not installed: no PNG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
