"""Which route an eager fused-norm call takes: the Triton kernel, or torch's own operators, per shape.

A fused norm replaces what the original model ran: ``F.layer_norm`` / ``F.rms_norm`` (one native kernel
each) or a handful of elementwise ops (HF Llama's cast-before-weight RMSNorm, Gemma's ``(1 + w)``). At
many rows the Triton kernel wins by moving each byte once. At a few rows the GPU work is a few
microseconds and the call costs what the host spends on it; at short rows a native kernel can also be
the faster one. A converted model must never be slower than its original, so each eager call takes the
faster route for its shape, from rules measured on a GPU (``benchmarks/tune_routes.py``, as
``_tiling.py``'s launch rules are): the kernel where it wins, torch's own ops where they do. Under
torch.compile, export and the transforms the ops stay whole (Inductor compiles their kernels into its
own code and CUDA graphs remove the launches), so only eager calls are routed.

A rule is keyed by what changes the answer: the norm, whether the residual add is fused, whether torch
has one native kernel for the function (``native``: plain casting, no weight offset, parameters in the
input's dtype, no bias on an RMSNorm) or composes it from several ops, the element size, and whether
autograd records the call (``train``: forward and backward are one decision). For each key it lists
``(n_max, min_rows)``: rows of length up to ``n_max`` take the kernel from ``min_rows`` rows on; rows
longer than the last ``n_max`` follow the last pair (a length nobody measured keeps the verdict of the
longest one measured: the H200's grid showed the kernel's backward 4x slower than torch's at a few rows
of 32K, where an earlier reading, "always the kernel", had sent them).

``NORMSWAP_ROUTE_RULES=rules.json`` replaces the built-in rules by a tuner's output (another GPU);
``NORMSWAP_KERNEL_ROUTE=triton|torch`` (or :func:`kernel_route`) forces one route, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from normswap.kernels.reference import REFERENCES, KernelNormKind

Route = Literal["triton", "torch"]
ROUTES: tuple[str, ...] = ("triton", "torch")

# Rows of length <= n_max take the kernel from min_rows rows on.
RouteRule = Sequence[tuple[int, int]]

# min_rows for "never the kernel at this length": torch's route at every row count.
NEVER = 1 << 62

# Measured on an NVIDIA H200 with torch 2.11 and triton 3.6: the rules of benchmarks/results/routes_h200.json,
# shipped as route_rules.json (`python benchmarks/tune_routes.py --out routes.json --rules
# normswap/kernels/route_rules.json` writes both). Keys: see route_key. An empty rule: the kernel at every
# measured shape. Read after load_rules below.
BUILTIN_RULES_FILE = Path(__file__).with_name("route_rules.json")


def route_key(kind: str, residual: bool, native: bool, itemsize: int, train: bool) -> str:
    """The rules' key for a call: ``rms+add:native:half:train`` and the like."""
    return (
        f"{kind}{'+add' if residual else ''}:{'native' if native else 'composed'}:"
        f"{'half' if itemsize == 2 else 'fp32'}:{'train' if train else 'infer'}"
    )


_forced: Route | None = None
_rules_override: Mapping[str, RouteRule] | None = None
# The environment is read when normswap.kernels is imported (a call must not pay for os.environ);
# reload_environment() reads it again.
_env_route: str | None = None
_env_rules_path: str | None = None
# What a cached route decision depends on besides the call (the forced route, the environment's route
# and rules file, the rules in force), as raw values: kept up to date by whatever changes them, so a
# call reads one module attribute instead of computing it (in a model each microsecond of a norm's
# host time is the model's), and equal states find the same cached decisions again.
current_state: tuple[object, ...] = ()
# Counts the rule tables put in force (route_rules(), and reload_environment(), which reads a rules file
# again): not their id, since a freed table's id can come back
_rules_generation = 0


def _update_state() -> None:
    global current_state
    current_state = (_forced, _env_route, _env_rules_path, _rules_generation)


def reload_environment() -> None:
    """Read ``NORMSWAP_KERNEL_ROUTE`` and ``NORMSWAP_ROUTE_RULES`` again (they are read at import),
    the rules file itself too, even at the same path."""
    global _env_route, _env_rules_path, _rules_generation
    _env_route = os.environ.get("NORMSWAP_KERNEL_ROUTE")
    _env_rules_path = os.environ.get("NORMSWAP_ROUTE_RULES") or None
    _environment_rules.cache_clear()
    _rules_generation += 1
    _min_rows.cache_clear()
    _update_state()


def forced_route() -> Route | None:
    """The route forced by :func:`kernel_route` or ``NORMSWAP_KERNEL_ROUTE``, else None."""
    if _forced is not None:
        return _forced
    env = _env_route
    if env in (None, "", "auto"):
        return None
    if env not in ROUTES:
        raise ValueError(f"NORMSWAP_KERNEL_ROUTE must be one of triton, torch, auto; got {env!r}")
    return env  # type: ignore[return-value]


@contextlib.contextmanager
def kernel_route(route: Route | None) -> Iterator[None]:
    """Force every eager fused-norm call in the block onto ``route`` (None: the measured choice)."""
    global _forced
    if route is not None and route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES} or None, got {route!r}")
    saved, _forced = _forced, route
    _update_state()
    try:
        yield
    finally:
        _forced = saved
        _update_state()


def load_rules(path: str | Path) -> dict[str, RouteRule]:
    """The ``rules`` of a tuner's JSON output, checked: key -> ascending ``(n_max, min_rows)`` pairs."""
    data = json.loads(Path(path).read_text())
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, dict):
        raise ValueError(f"{path}: no 'rules' table (expected the output of benchmarks/tune_routes.py)")
    checked: dict[str, RouteRule] = {}
    for key, pairs in rules.items():
        try:
            rule = tuple((int(n_max), int(min_rows)) for n_max, min_rows in pairs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: rule {key!r} is not a list of [n_max, min_rows] pairs") from e
        if [n for n, _ in rule] != sorted({n for n, _ in rule}):
            raise ValueError(f"{path}: rule {key!r} must list n_max in ascending order, once each")
        checked[str(key)] = _measured_to_the_end(str(key), rule, data.get("meta"))
    return checked


def _measured_to_the_end(key: str, rule: RouteRule, meta: object) -> RouteRule:
    """``rule`` with the kernel's verdict at the lengths its tuner measured past the last entry.

    The tuner before 2026-11-27 left out the trailing lengths where the kernel won at every row count,
    since rows past the last entry then took the kernel; they now follow the last entry. So a rule ending
    with rows to wait for, short of the longest length its run measured (``meta["lengths"]``,
    ``meta["fp32_lengths"]`` for fp32 keys where the run kept them apart), gets that length with no rows
    to wait for, as measured. Today's tuner writes that entry itself; a file without ``meta`` is taken
    as it is."""
    if not isinstance(meta, dict) or not rule or rule[-1][1] == 0:
        return rule
    lengths = meta.get("fp32_lengths") if ":fp32:" in key and "fp32_lengths" in meta else meta.get("lengths")
    if not isinstance(lengths, list) or not lengths:
        return rule
    longest = max(int(n) for n in lengths)
    return (*rule, (longest, 0)) if rule[-1][0] < longest else rule


BUILTIN_RULES: dict[str, RouteRule] = load_rules(BUILTIN_RULES_FILE)


@contextlib.contextmanager
def route_rules(rules: Mapping[str, RouteRule] | None) -> Iterator[None]:
    """Use ``rules`` instead of the built-in (or environment's) rules inside the block."""
    global _rules_override, _rules_generation
    saved, _rules_override = _rules_override, rules
    _rules_generation += 1
    _min_rows.cache_clear()
    _update_state()
    try:
        yield
    finally:
        _rules_override = saved
        _rules_generation += 1
        _min_rows.cache_clear()
        _update_state()


@functools.cache
def _environment_rules(path: str) -> Mapping[str, RouteRule]:
    return load_rules(path)


def _active_rules() -> Mapping[str, RouteRule]:
    if _rules_override is not None:
        return _rules_override
    return _environment_rules(_env_rules_path) if _env_rules_path else BUILTIN_RULES


@functools.lru_cache(maxsize=4096)  # host time counts at a few rows, and shapes repeat
def _min_rows(key: str, n: int, rules_id: int) -> int:
    rule = _active_rules().get(key, ())
    for n_max, min_rows in rule:
        if n <= n_max:
            return min_rows
    return rule[-1][1] if rule else 0  # beyond the longest measured length: its verdict


def choose_route(
    kind: str, residual: bool, native: bool, dtype: torch.dtype, train: bool, rows: int, n: int
) -> Route:
    """The route for an eager call on a CUDA tensor of ``rows`` rows of length ``n``."""
    forced = forced_route()
    if forced is not None:
        return forced
    key = route_key(kind, residual, native, dtype.itemsize, train)
    return "torch" if rows < _min_rows(key, n, id(_active_rules())) else "triton"


def native_kernel(
    kind: KernelNormKind,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    casting: str,
    weight_offset: float,
) -> bool:
    """Whether torch has one native kernel for this norm: ``F.layer_norm`` / ``F.rms_norm`` compute
    plain casting (fp32 statistics, the affine in fp32, one rounding) with parameters in x's dtype."""
    if casting != "none" or weight_offset != 0.0 or (kind == "rms" and bias is not None):
        return False
    return (weight is None or weight.dtype == x.dtype) and (bias is None or bias.dtype == x.dtype)


def torch_route(
    kind: KernelNormKind,
    native: bool,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
    normalized_ndim: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The norm by torch's own ops, differentiated by autograd: what the original model ran
    (``native``: :func:`native_kernel`'s answer for these arguments)."""
    h = x + residual if residual is not None else None
    src = h if h is not None else x
    if native:
        shape = src.shape[src.ndim - normalized_ndim :]
        if kind == "layer":
            return F.layer_norm(src, shape, weight, bias, eps), h
        return F.rms_norm(src, shape, weight, eps), h
    return REFERENCES[kind](src, normalized_ndim, weight, bias, eps, casting, weight_offset), h


__all__ = [
    "BUILTIN_RULES",
    "BUILTIN_RULES_FILE",
    "NEVER",
    "ROUTES",
    "Route",
    "RouteRule",
    "choose_route",
    "current_state",
    "forced_route",
    "kernel_route",
    "load_rules",
    "native_kernel",
    "reload_environment",
    "route_key",
    "route_rules",
    "torch_route",
]

reload_environment()
