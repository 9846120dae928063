"""The route tuner's rules from timings (benchmarks/tune_routes.py): what the built-in rules are made of."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from normswap.kernels._routes import BUILTIN_RULES, BUILTIN_RULES_FILE, NEVER, load_rules

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tune_routes.py"
RESULTS = SCRIPT.parent / "results" / "routes_h200.json"


def _tuner():
    spec = importlib.util.spec_from_file_location("tune_routes_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _t(m: int, n: int, triton_us: float, torch_us: float) -> dict:
    return {"m": m, "n": n, "triton_ms": triton_us / 1e3, "torch_ms": torch_us / 1e3}


def test_kernel_from_the_row_count_where_it_stops_losing_clearly():
    tuner = _tuner()
    timings = [
        # host-bound rows: one verdict from all lengths (kernel 3x slower at 1 row; a tie at 16)
        _t(1, 1024, 60, 20), _t(1, 4096, 61, 21),
        _t(16, 1024, 21, 20), _t(16, 4096, 40, 20),  # median ratio 1.5: torch
        # bandwidth-bound rows: per shape, a loss only when clearly slower (> 10%)
        _t(256, 1024, 105, 100), _t(256, 4096, 50, 100),
        _t(4096, 1024, 90, 100), _t(4096, 4096, 50, 100),
    ]  # fmt: skip
    rule = tuner.rule_from(timings)
    # 4096: the kernel from 256 rows; 1024: a 5% loss at 256 is a tie, so also from 256
    assert rule == [(1024, 256), (4096, 256)]


def test_a_clear_loss_at_many_rows_and_monotone_lengths():
    tuner = _tuner()
    timings = [
        _t(1, 512, 60, 20), _t(1, 2048, 60, 20), _t(1, 8192, 60, 20),
        _t(4096, 512, 150, 100), _t(4096, 2048, 100, 100), _t(4096, 8192, 40, 100),
        _t(32768, 512, 150, 100), _t(32768, 2048, 80, 100), _t(32768, 8192, 40, 100),
    ]  # fmt: skip
    rule = tuner.rule_from(timings)
    # 512 never (slower at every count); 2048 from 4096 rows; 8192 from 4096 rows
    assert rule == [(512, NEVER), (2048, 4096), (8192, 4096)]
    # where the kernel wins at every count from some length on, one entry says so for every longer
    # row (longer rows follow the last entry); where it wins everywhere, no entry at all
    timings = [_t(1, 512, 60, 20), _t(4096, 512, 150, 100)]
    timings += [_t(m, n, 10, 100) for m in (1, 4096) for n in (2048, 8192)]
    assert tuner.rule_from(timings) == [(512, NEVER), (2048, 0)]
    assert tuner.rule_from([_t(m, n, 10, 100) for m in (1, 4096) for n in (512, 8192)]) == []
    # a shorter row never takes the kernel at fewer rows than a longer one
    timings = [_t(1, 512, 60, 20), _t(4096, 512, 50, 100), _t(1, 8192, 60, 20), _t(4096, 8192, 150, 100)]
    assert tuner.rule_from(timings) == [(512, NEVER), (8192, NEVER)]


def test_builtin_rules_are_the_committed_runs_rules(tmp_path):
    """The rules normswap ships are what the tuner derives from the committed H200 timings, in the file
    the tuner's --rules writes."""
    tuner = _tuner()
    result = json.loads(RESULTS.read_text())
    keys = dict.fromkeys(t["key"] for t in result["timings"])
    derived = {k: tuple(tuner.rule_from([t for t in result["timings"] if t["key"] == k])) for k in keys}
    assert derived == dict(BUILTIN_RULES)
    assert load_rules(RESULTS) == dict(BUILTIN_RULES)
    written = tmp_path / "route_rules.json"
    tuner.write_rules(written, result)
    assert written.read_text() == BUILTIN_RULES_FILE.read_text()
