"""benchmarks/bench_norms.py on the CPU: run() with a fake timer, summarize(), plot(), main() without CUDA.

The script is meant for a CUDA machine; these tests run its whole measuring loop on CPU tensors (where
normswap's ops run their reference math) so that a first run on a GPU does not trip over the plumbing.
torch.compile is left out (too slow here) and Liger-Kernel is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_norms.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_norms_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


FAKE_MS = 0.25
ITEMSIZE = {"fp32": 4, "bf16": 2}
DOCUMENTED_BYTES_PER_ELEMENT = {"fwd": 2, "bwd": 3, "add_fwd": 4, "add_bwd": 4}


class FakeTimer:
    """Calls the timed function once (so that it really runs) and reports FAKE_MS."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fn, rep, grad_to_none=None) -> float:
        self.calls += 1
        out = fn()
        assert out is not None
        return FAKE_MS


def _args(bench, **over) -> argparse.Namespace:
    args = bench.parse_args(
        ["--providers", "eager", "normswap", "--m", "1", "8", "--n", "16", "48", "--dtypes", "fp32", "bf16"]
    )
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def fake_run(bench):
    timer = FakeTimer()
    result = bench.run(_args(bench), device="cpu", timer=timer, copy_numel=1 << 12)
    return result, timer


def test_run_on_cpu_records(bench, fake_run) -> None:
    result, timer = fake_run
    records = result["records"]
    copy_gbps = 2 * (1 << 12) * 2 / FAKE_MS / 1e6  # bf16 copy: read + write
    assert math.isclose(result["meta"]["copy_gbps"], copy_gbps)
    assert bench.OPS == ("fwd", "bwd", "add_fwd", "add_bwd")
    # 2 dtypes x 2 norms x 4 ops x 2 M x 2 N x 2 providers, every one measured
    assert len(records) == 2 * 2 * 4 * 2 * 2 * 2
    assert timer.calls == len(records) + 1  # and the copy
    fields = {"norm", "op", "dtype", "m", "n", "provider", "nbytes", "ms", "gbps", "frac_of_copy", "note"}
    seen = set()
    for r in records:
        assert set(r) == fields
        assert r["provider"] in ("eager", "normswap")
        assert r["note"] == ""
        nbytes = DOCUMENTED_BYTES_PER_ELEMENT[r["op"]] * r["m"] * r["n"] * ITEMSIZE[r["dtype"]]
        assert r["nbytes"] == nbytes
        assert r["ms"] == FAKE_MS
        assert r["gbps"] > 0 and math.isclose(r["gbps"], nbytes / FAKE_MS / 1e6)
        assert r["frac_of_copy"] > 0 and math.isclose(r["frac_of_copy"], r["gbps"] / copy_gbps)
        seen.add((r["norm"], r["op"], r["dtype"], r["m"], r["n"], r["provider"]))
    assert len(seen) == len(records)
    assert not any(r["provider"] in ("liger", "compile") for r in records)
    assert "add_bwd 4*M*N*s" in result["meta"]["bytes"]


def test_run_with_wall_clock_timer(bench) -> None:
    def wall_clock(fn, rep, grad_to_none=None):
        import time

        t0 = time.perf_counter()
        fn()
        return max(time.perf_counter() - t0, 1e-9) * 1e3

    args = _args(bench, m=[4], n=[32], dtypes=["fp32"])
    result = bench.run(args, device="cpu", timer=wall_clock, copy_numel=1 << 12)
    assert len(result["records"]) == 2 * 4 * 2
    assert all(r["gbps"] > 0 and r["frac_of_copy"] > 0 for r in result["records"])
    assert result["meta"]["timing"] == "wall_clock"


def test_backward_ops_reach_every_input(bench) -> None:
    # add_bwd: gradients for y and h given; x, residual, weight and bias all get one
    captured = {}

    def timer(fn, rep, grad_to_none=None):
        captured["grads"] = fn()
        return FAKE_MS

    for provider in ("eager", "normswap"):
        bench._bench_one(provider, "layer", "add_bwd", torch.float32, 3, 16, 1, "cpu", timer)
        dx, dr, dw, db = captured["grads"]
        assert dx.shape == dr.shape == (3, 16) and dw.shape == db.shape == (16,)
        torch.testing.assert_close(dx, dr)
        bench._bench_one(provider, "rms", "bwd", torch.float32, 3, 16, 1, "cpu", timer)
        assert [g.shape for g in captured["grads"]] == [(3, 16), (16,)]


def test_liger_add_layer_norm_not_implemented(bench) -> None:
    with pytest.raises(NotImplementedError):
        bench._liger("layer", True)


# ---------------------------------------------------------------------------------------------------
# summarize() on a hand-made result


def _rec(op, provider, gbps, *, norm="rms", dtype="bf16", m=16384, n=4096, copy=1000.0, ms=None):
    nbytes = DOCUMENTED_BYTES_PER_ELEMENT[op] * m * n * ITEMSIZE[dtype]
    ms = nbytes / gbps / 1e6 if ms is None else ms
    return {
        "norm": norm,
        "op": op,
        "dtype": dtype,
        "m": m,
        "n": n,
        "provider": provider,
        "nbytes": nbytes,
        "ms": ms,
        "gbps": gbps,
        "frac_of_copy": gbps / copy,
        "note": "",
    }


@pytest.fixture
def synthetic() -> dict:
    # copy 1000 GB/s, so gbps / 1000 is the fraction of copy; shapes (16384, 4096) and (65536, 8192)
    normswap = {"fwd": 920, "bwd": 690, "add_fwd": 870, "add_bwd": 720}  # ok, below, ok (not at 90%), ok
    recs = []
    for op, g in normswap.items():
        for m, n in ((16384, 4096), (65536, 8192)):
            recs.append(_rec(op, "normswap", g, m=m, n=n))
            recs.append(_rec(op, "eager", 500, m=m, n=n))
    # liger beats normswap's bwd on one shape, loses on the other
    recs.append(_rec("bwd", "liger", 800, m=65536, n=8192))
    recs.append(_rec("bwd", "liger", 600, m=16384, n=4096))
    # outside the goal region: must not count (fp32, N too large, M too small)
    recs.append(_rec("fwd", "normswap", 100, dtype="fp32"))
    recs.append(_rec("fwd", "normswap", 100, n=65536))
    recs.append(_rec("fwd", "normswap", 100, m=4096))
    # not measured: ignored
    recs.append(_rec("add_fwd", "liger", 1, norm="layer") | {"gbps": None, "ms": None, "frac_of_copy": None})
    # small M: normswap 10 us vs eager 30 us and compile 40 us on fwd; 50 us vs 20 us on bwd
    for n in (768, 4096):
        for m in (1, 128):
            recs.append(_rec("fwd", "normswap", 1, m=m, n=n, ms=0.010))
            recs.append(_rec("fwd", "eager", 1, m=m, n=n, ms=0.030))
            recs.append(_rec("fwd", "compile", 1, m=m, n=n, ms=0.040))
            recs.append(_rec("bwd", "normswap", 1, m=m, n=n, ms=0.050))
            recs.append(_rec("bwd", "eager", 1, m=m, n=n, ms=0.020))
    recs.append(_rec("fwd", "normswap", 1, m=4096, n=768, ms=5.0))  # M > 256: not small
    return {"meta": {"device": "fake", "copy_gbps": 1000.0}, "records": recs}


def _line(text: str, *words: str) -> str:
    """The one line of ``text`` with all of ``words``, its runs of spaces squeezed."""
    found = [" ".join(line.split()) for line in text.splitlines() if all(w in line.split() for w in words)]
    assert len(found) == 1, (words, text)
    return found[0]


def test_summarize_targets(bench, synthetic) -> None:
    text = bench.summarize(synthetic)
    expected = {
        "fwd": ("92%", "ok", "90%"),
        "bwd": ("69%", "below", "70%"),
        "add_fwd": ("87%", "ok", "85%"),
        "add_bwd": ("72%", "ok", "70%"),
    }
    for op, (median, mark, target) in expected.items():
        line = _line(text, op, "rms", "normswap", "median")
        assert f"median {median} of copy over 2 shapes ({mark} {target})" in line, line
        eager = _line(text, op, "rms", "eager", "median")
        assert f"median 50% of copy over 2 shapes (below {target})" in eager, eager
    assert not [line for line in text.splitlines() if "layer" in line.split()]  # none measured


def test_summarize_ahead(bench, synthetic) -> None:
    text = bench.summarize(synthetic)
    for op in ("fwd", "add_fwd", "add_bwd"):
        assert "normswap ahead on all 2 shapes" in _line(text, op, "rms", "ahead")
    behind = _line(text, "bwd", "rms", "not", "ahead")
    assert "not ahead on 1 of 2 shapes" in behind
    assert "bf16 M=65536 N=8192" in behind
    assert "normswap 690 GB/s vs liger 800 GB/s" in behind


def test_summarize_small_m(bench, synthetic) -> None:
    text = bench.summarize(synthetic)
    fwd = _line(text, "fwd", "small")
    assert "normswap median 10.0 us vs eager 30.0 us, compile 40.0 us over 4 shapes" in fwd
    assert fwd.endswith("on 0 (ok)")
    bwd = _line(text, "bwd", "small")
    assert "normswap median 50.0 us vs eager 20.0 us over 4 shapes" in bwd
    assert bwd.endswith("on 4 (slower)")
    assert "add_fwd small" not in text  # nothing measured at small M


def test_summarize_is_pure(bench, synthetic) -> None:
    import copy

    before = copy.deepcopy(synthetic)
    assert bench.summarize(synthetic) == bench.summarize(synthetic)
    assert synthetic == before


def test_summarize_of_cpu_run(bench, fake_run) -> None:
    # the real result's shape: small M only, so just the small-M lines
    text = bench.summarize(fake_run[0])
    assert "small M" in text


def test_plot_writes_png(bench, fake_run, tmp_path) -> None:
    path = tmp_path / "bench.png"
    assert bench.plot(fake_run[0], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_refuses_without_cuda(bench, tmp_path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_progress_leaves_every_measured_shape_on_disk(bench, tmp_path) -> None:
    # A run stopped by a time limit (as the first H100 run was) must still leave what it measured.
    path = tmp_path / "bench.json"
    seen: list[int] = []

    def progress(partial: dict) -> None:
        assert partial["meta"]["complete"] is False
        seen.append(len(partial["records"]))
        bench.write_json(partial, path)

    args = _args(bench, norms=["rms"], ops=["fwd"], dtypes=["fp32"], m=[8], n=[16, 48])
    result = bench.run(args, device="cpu", timer=FakeTimer(), copy_numel=1 << 12, on_progress=progress)
    assert seen == [2, 4]  # after each shape, both providers of it
    assert result["meta"]["complete"] is True
    on_disk = json.loads(path.read_text())
    assert on_disk["records"] == result["records"] and not list(tmp_path.glob("*.tmp"))


def test_compile_is_measured_only_where_asked(bench) -> None:
    args = _args(bench, providers=["compile"], norms=["rms"], ops=["fwd"])
    args.compile_m, args.compile_n, args.compile_dtypes = [8], [48], ["bf16"]
    assert bench._compile_measured(args, "bf16", 8, 48)
    for other in (("fp32", 8, 48), ("bf16", 1, 48), ("bf16", 8, 16)):
        assert not bench._compile_measured(args, *other)
    # A grid none of whose shapes is asked for compiles nothing and says so on every record.
    args.compile_n = [999]
    result = bench.run(args, device="cpu", timer=FakeTimer(), copy_numel=1 << 12)
    assert result["records"] and all("not measured here" in r["note"] for r in result["records"])
    assert all(r["ms"] is None for r in result["records"])
