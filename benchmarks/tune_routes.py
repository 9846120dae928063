"""Measure where each route of an eager fused-norm call is faster, and write the rules (CUDA only).

For every rule key of ``normswap.kernels._routes`` (norm, residual add, native or composed, element
size, inference or training) and every shape of a grid of rows x row lengths, the same call is timed
on both routes, forced with ``kernel_route``: the Triton kernel and torch's own ops. Timing: CUDA
events around a loop of back-to-back calls (no L2 flush: in a model a norm reads what the op before it
just wrote), the median of several loops, so a call bound by host time is measured as such. Training
keys time forward and backward together, one decision covering both.

A key's rule says, per row length, from how many rows the kernel takes over: the smallest measured row
count from which the kernel is not clearly slower (by more than ``CLEAR_LOSS``) at that and every larger
measured count, and never more
than a shorter row needs (noise at a few rows otherwise gives rules that zigzag over the lengths). Row
lengths beyond the grid follow the longest measured one. ``--from-json`` re-derives the rules from a run's timings. Written: every timing and the rules as JSON (``--out``); ``--rules FILE``
writes the rules alone as the file normswap ships (``normswap/kernels/route_rules.json``). Keys run in order of how often models hit them
and the JSON is rewritten after each key, so a run stopped by a time limit keeps what it measured.

    python benchmarks/tune_routes.py --out gpu_out/routes.json
    NORMSWAP_ROUTE_RULES=gpu_out/routes.json python benchmarks/bench_norms.py ...   # the rules applied
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROWS = (1, 16, 256, 4096, 32768)
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
# (kind, residual add, native, dtype, train), most used first: HF Llama's cast-before-weight RMSNorm
# (composed), GPT-2/BERT/ViT's LayerNorm (native), plain RMSNorm, their residual-add forms; inference,
# then training; bf16, then fp32; every key is measured.
KEYS = [
    (kind, add, native, dtype, train)
    for dtype, train in (("bf16", False), ("bf16", True), ("fp32", False), ("fp32", True))
    for kind, add, native in (
        ("rms", False, False),
        ("layer", False, True),
        ("rms", False, True),
        ("rms", True, False),
        ("layer", True, True),
        ("rms", True, True),
        ("layer", False, False),
        ("layer", True, False),
    )
]
NEVER = 1 << 62  # min_rows meaning "never the kernel at this length"
# The kernel gives way only where it is clearly slower: host-bound calls (a few rows) vary by 10-40%
# from one loop to the next on a GPU host, and a tie is no reason to leave the kernel.
CLEAR_LOSS = 1.10
# Row counts up to this are host-bound at every measured length (16 x 16K bf16 is 512 KB: microseconds).
HOST_BOUND_ROWS = 16


def _time_ms(fn: Callable[[], object], loops: int = 7, min_loop_ms: float = 5.0) -> float:
    # 5 ms loops, 7 of them: a host-bound training call (~0.5 ms) took only 4 calls per 2 ms loop in the
    # H200 run, and its timings varied by up to 2x between neighbouring shapes
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 1
    while True:  # grow the loop until it is long enough for the events to resolve it
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= min_loop_ms or calls >= 1 << 14:
            break
        calls *= 4
    samples = []
    for _ in range(loops):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def _call(kind: str, add: bool, native: bool, dtype, train: bool, m: int, n: int) -> Callable[[], object]:
    import torch

    from normswap.kernels import add_layer_norm, add_rms_norm, layer_norm, rms_norm

    x = torch.randn(m, n, device="cuda", dtype=dtype)
    r = torch.randn_like(x) if add else None
    w = torch.randn(n, device="cuda", dtype=dtype) * 0.2 + 1
    b = torch.randn(n, device="cuda", dtype=dtype) if kind == "layer" else None
    casting = "none" if native else "llama"
    leaves = [t for t in (x, r, w, b) if t is not None]
    if train:
        for t in leaves:
            t.requires_grad_()
    if add:
        f = add_rms_norm if kind == "rms" else add_layer_norm
        forward = lambda: f(x, r, w, b, 1e-6, casting)  # noqa: E731
    else:
        f = rms_norm if kind == "rms" else layer_norm
        forward = lambda: (f(x, w, b, 1e-6, casting),)  # noqa: E731
    if not train:

        def infer():
            with torch.no_grad():
                return forward()

        return infer
    grads = [torch.randn_like(x)] * (2 if add else 1)

    def step():
        torch.autograd.backward(forward(), grads)
        for t in leaves:
            t.grad = None

    return step


def rule_from(timings: list[dict]) -> list[tuple[int, int]]:
    """(n_max, min_rows) per measured length: the kernel from the smallest row count at which it is at
    least as fast there and at every larger count."""
    # At a few rows both routes are host-bound: the time does not depend on the length, so one verdict
    # per row count from all lengths (the median ratio) beats a verdict per noisy shape.
    pooled = {
        m: statistics.median(t["triton_ms"] / t["torch_ms"] for t in timings if t["m"] == m) > CLEAR_LOSS
        for m in {t["m"] for t in timings}
        if m <= HOST_BOUND_ROWS
    }

    def kernel_loses(t: dict) -> bool:
        if t["m"] in pooled:
            return pooled[t["m"]]
        return t["triton_ms"] > t["torch_ms"] * CLEAR_LOSS

    rule = []
    for n in sorted({t["n"] for t in timings}):
        at_n = sorted((t for t in timings if t["n"] == n), key=lambda t: t["m"], reverse=True)
        min_rows = NEVER
        for t in at_n:  # from the most rows down, while the kernel keeps winning
            if kernel_loses(t):
                break
            min_rows = t["m"]
        if min_rows == at_n[-1]["m"]:
            min_rows = 0  # the kernel at every measured count
        rule.append((n, min_rows))
    # A longer row moves more bytes per call, so the kernel's lead can only grow with the length: a
    # length never needs more rows than a longer one did. Taking the larger of the two where timings
    # say otherwise (noise at a few rows) keeps torch's route, the original's own ops, when in doubt.
    for i in range(len(rule) - 2, -1, -1):
        rule[i] = (rule[i][0], max(rule[i][1], rule[i + 1][1]))
    # Rows longer than the last entry follow it, so of the trailing lengths where the kernel wins at
    # every count one entry is kept (it says so for every longer row too); none where it always wins.
    while len(rule) > 1 and rule[-1][1] == 0 and rule[-2][1] == 0:
        rule.pop()
    return [] if len(rule) == 1 and rule[0][1] == 0 else rule


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file for the timings and rules")
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=("bf16", "fp32"),
        default=["bf16", "fp32"],
        help="keys of these dtypes only",
    )
    p.add_argument(
        "--rules",
        type=Path,
        help="write the rules alone here, as normswap/kernels/route_rules.json holds them",
    )
    p.add_argument("--from-json", type=Path, help="derive the rules from this run's timings; measure nothing")
    args = p.parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        keys = dict.fromkeys(t["key"] for t in result["timings"])
        result["rules"] = {k: rule_from([t for t in result["timings"] if t["key"] == k]) for k in keys}
        result["meta"]["rules_from"] = "tune_routes.py --from-json (monotone in the row length)"
        args.out.write_text(json.dumps(result, indent=1))
        if args.rules is not None:
            write_rules(args.rules, result)
        return 0

    import torch

    from normswap.kernels import kernel_route
    from normswap.kernels._routes import route_key

    if not torch.cuda.is_available():
        print("tune_routes needs a CUDA device; nothing was measured", file=sys.stderr)
        return 2
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    result: dict = {
        "meta": {
            "command": " ".join(
                ["python benchmarks/tune_routes.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "rows": args.rows,
            "lengths": args.lengths,
        },
        "timings": [],
        "rules": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for kind, add, native, dtype_name, train in KEYS:
        if dtype_name not in args.dtypes:
            continue
        dtype = dtypes[dtype_name]
        key = route_key(kind, add, native, dtype.itemsize, train)
        t0 = time.perf_counter()
        timings = []
        for n in args.lengths:
            for m in args.rows:
                if m * n * 4 * 8 > torch.cuda.mem_get_info()[0] * 0.5:
                    continue
                row = {"key": key, "m": m, "n": n}
                for route in ("torch", "triton"):
                    with kernel_route(route):
                        row[f"{route}_ms"] = _time_ms(_call(kind, add, native, dtype, train, m, n))
                timings.append(row)
                torch.cuda.empty_cache()
        rule = rule_from(timings)
        result["timings"].extend(timings)
        result["rules"][key] = rule
        args.out.write_text(json.dumps(result, indent=1))
        small = [t for t in timings if t["m"] <= 8]
        ratio = statistics.median(t["triton_ms"] / t["torch_ms"] for t in small) if small else float("nan")
        print(
            f"{key:32} {time.perf_counter() - t0:5.1f} s  rule {rule}  "
            f"(kernel/torch at <= 8 rows: {ratio:.2f}x; us at 1 row: "
            + ", ".join(
                f"{t['n']}: {1e3 * t['torch_ms']:.0f}/{1e3 * t['triton_ms']:.0f}"
                for t in timings
                if t["m"] == 1
            )
            + ")",
            flush=True,
        )
    if args.rules is not None:
        write_rules(args.rules, result)
    return 0


def write_rules(path: Path, result: dict) -> None:
    """The rules of ``result`` (with its run's meta) as normswap loads them
    (``normswap.kernels._routes.load_rules``): one key per line, so a re-tune diffs by key."""
    meta = result["meta"]
    lines = [
        f"  {json.dumps(key)}: {json.dumps([list(pair) for pair in rule])}"
        for key, rule in result["rules"].items()
    ]
    path.write_text(f'{{\n "meta": {json.dumps(meta)},\n "rules": {{\n' + ",\n".join(lines) + "\n }\n}\n")


if __name__ == "__main__":
    sys.exit(main())
