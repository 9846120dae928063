"""Calibrate swapped norms back towards the original: closed-form per-feature affine fits, layer by layer.

After an architectural swap, site k's new norm sees inputs ``x`` (from the converted model, with the
sites before it already calibrated, so their remaining error is compensated downstream) and should
produce what the original norm produced on the same batch, ``y``. With the new norm's normalization
``n = norm(x)`` (its affine set to identity), each feature c gets the least-squares fit

    a_c = cov(n_c, y_c) / var(n_c),    b_c = mean(y_c) - a_c * mean(n_c)

over every element of that feature in every batch, and the norm's weight and bias become ``a`` and
``b``. A BatchNorm target first takes its running statistics from the same inputs (population mean and
variance over the batches); a DyT or Derf target also fits its scalars (``alpha``; and Derf's ``shift``) to
the residual of that fit: the best of a grid, refined by L-BFGS with the affine solved in closed form.
Everything is fp64 inside and cast back to the parameter dtype.

A fit over activations that hold a NaN or Inf (they would make every fitted weight NaN) is refused, saying
where, and so is a fit that produces a non-finite parameter; every site fitted so far is then put back
(:func:`fit_sites_in_order`, shared by the affine and the cosine fits).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from normswap.calibrate.data import ModelInputs, as_model_inputs
from normswap.calibrate.feeding import fed, run_batch
from normswap.errors import CheckFailedError
from normswap.util.finite import first_nonfinite
from normswap.util.modes import modes_restored
from normswap.verify.metrics import PooledSqnr, flatten_outputs, sqnr_db

# DyT's alpha candidates: log-spaced over the range trained models end up in (Zhu et al. 2025).
DYT_ALPHAS = tuple(float(a) for a in torch.logspace(-2, 1, 31))


@dataclass
class SiteFit:
    site: str
    module_class: str
    sqnr_before_db: float
    sqnr_after_db: float
    statistics: bool = False  # running statistics re-estimated (BatchNorm targets)
    alpha: float | None = None  # DyT, Derf
    shift: float | None = None  # Derf
    note: str = ""


@dataclass
class AffineCalibrationReport:
    batches: int
    sites: list[SiteFit] = field(default_factory=list)
    model_sqnr_before_db: float | None = None
    model_sqnr_after_db: float | None = None
    # how the batches were fed, where it differs from the data (a key a model does not take, use_cache)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _feature_dim(module: nn.Module) -> int:
    dim = getattr(module, "dim", None)
    if isinstance(dim, int):
        return dim
    if isinstance(module, (_BatchNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)):
        return 1
    return -1


def _per_feature(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(C, everything else) view of ``t`` with features at ``dim``, in fp64."""
    return t.detach().double().movedim(dim, 0).reshape(t.shape[dim], -1)


def _run(model: nn.Module, batch: ModelInputs) -> Any:
    with torch.no_grad():
        return model(*batch.args, **batch.kwargs)


@contextlib.contextmanager
def recording(model: nn.Module, paths: list[str], what: str) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the first input (``what="input"``) or the output of the modules at ``paths``, per call."""
    seen: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    handles = []
    for path in paths:
        module = model.get_submodule(path)
        if what == "input":

            def pre(_m: nn.Module, args: tuple, path: str = path) -> None:
                seen[path].append(args[0].detach().clone())  # later in-place ops must not reach it

            handles.append(module.register_forward_pre_hook(pre))
        else:

            def post(_m: nn.Module, _a: tuple, out: Any, path: str = path) -> None:
                seen[path].append(out.detach().clone())  # e.g. ResNet adds the shortcut in place

            handles.append(module.register_forward_hook(post))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def call_order(model: nn.Module, paths: list[str]) -> Iterator[list[str]]:
    """The paths in the order their modules first run while the context is open."""
    order: list[str] = []
    handles = [
        model.get_submodule(p).register_forward_pre_hook(
            lambda _m, _a, p=p: order.append(p) if p not in order else None
        )
        for p in paths
    ]
    try:
        yield order
    finally:
        for h in handles:
            h.remove()


def _execution_order(model: nn.Module, paths: list[str], batch: ModelInputs) -> list[str]:
    with call_order(model, paths) as order:
        _run(model, batch)
    return order + [p for p in paths if p not in order]


def _set_statistics(bn: _BatchNorm, inputs: list[torch.Tensor], dim: int) -> None:
    """Population mean and (biased) variance of each feature over every batch."""
    count, total, total_sq = 0, 0.0, 0.0
    for x in inputs:
        f = _per_feature(x, dim)
        count += f.shape[1]
        total = total + f.sum(1)
        total_sq = total_sq + (f * f).sum(1)
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0)
    with torch.no_grad():
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)


@contextlib.contextmanager
def _identity_affine(module: nn.Module) -> Iterator[None]:
    """Run ``module`` with weight 1 and bias 0 (its normalization alone), restoring them afterwards."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    saved = [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in (weight, bias)]
    offset = float(getattr(module, "weight_offset", 0.0))
    try:
        with torch.no_grad():
            if isinstance(weight, torch.Tensor):
                weight.fill_(1.0 - offset)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
        yield
    finally:
        with torch.no_grad():
            for t, s in zip((weight, bias), saved, strict=True):
                if isinstance(t, torch.Tensor) and s is not None:
                    t.copy_(s)


def _solve(
    n: torch.Tensor, y: torch.Tensor, with_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-feature least squares ``y ~ a n + b`` on (C, N) fp64 tensors: a, b and the residual as tensors,
    differentiable in ``n`` (the S-curve scalars are fitted through it).

    Without a bias (a norm that has none, e.g. a LayerNorm swapped in for an RMSNorm), ``y ~ a n``.
    """
    if not with_bias:
        energy = (n * n).sum(1)
        a = torch.where(energy > 1e-20, (n * y).sum(1) / energy.clamp_min(1e-20), torch.ones_like(energy))
        return a, torch.zeros_like(a), ((a[:, None] * n - y) ** 2).sum()
    mn, my = n.mean(1, keepdim=True), y.mean(1, keepdim=True)
    dn, dy = n - mn, y - my
    var = (dn * dn).mean(1)
    a = torch.where(var > 1e-20, (dn * dy).mean(1) / var.clamp_min(1e-20), torch.ones_like(var))
    b = my.squeeze(1) - a * mn.squeeze(1)
    return a, b, ((a[:, None] * n + b[:, None] - y) ** 2).sum()


def _fit(
    n: torch.Tensor, y: torch.Tensor, with_bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """:func:`_solve` with the residual as a float."""
    a, b, residual = _solve(n, y, with_bias)
    return a, b, float(residual)


def _fit_scalars(module: nn.Module, x: torch.Tensor, y: torch.Tensor, with_bias: bool) -> dict[str, float]:
    """The scalars of an S-curve norm (DyT's ``alpha``; Derf's ``alpha`` and ``shift``) that minimize the
    residual of the per-feature affine fit (:func:`_solve`): the best of a grid, then refined by L-BFGS on the residual
    with the affine solved in closed form for every value (variable projection), kept only where it
    lowers the residual. ``x``: the norm's (C, N) inputs in fp64; ``y``: the targets."""
    names: tuple[str, ...] = module.scalars  # type: ignore[assignment]
    shifts = (-1.0, -0.5, 0.0, 0.5, 1.0) if "shift" in names else (0.0,)
    current = {name: float(getattr(module, name).detach()) for name in names}
    candidates = [
        {"alpha": alpha, **({"shift": shift} if "shift" in names else {})}
        for alpha in DYT_ALPHAS
        for shift in shifts
    ] + [current]

    def residual(values: dict[str, Any]) -> torch.Tensor:
        as_tensors = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in values.items()}
        return _solve(module.curve(x, **as_tensors), y, with_bias)[2]  # type: ignore[operator]

    with torch.no_grad():
        best = min(candidates, key=lambda c: float(residual(c)))
    start = float(residual(best))
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in best.items()}
    optimizer = torch.optim.LBFGS(list(params.values()), max_iter=50, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = residual(params)
        loss.backward()
        return loss

    try:
        optimizer.step(closure)
    except RuntimeError:  # a line search that fails leaves the grid's best
        return best
    refined = {k: float(v.detach()) for k, v in params.items()}
    with torch.no_grad():
        end = float(residual(refined))
    return refined if math.isfinite(end) and end < start else best


def _normalized(module: nn.Module, inputs: list[torch.Tensor], dim: int) -> torch.Tensor:
    with _identity_affine(module), torch.no_grad():
        return torch.cat([_per_feature(module(x), dim) for x in inputs], dim=1)


def fit_site(module: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> SiteFit | str:
    dim = _feature_dim(module)
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not isinstance(weight, torch.Tensor):
        return "the new norm has no weight to fit"
    if not inputs:
        return "never ran on the calibration data (a branch the inputs do not take)"
    has_bias = isinstance(bias, torch.Tensor)
    y = torch.cat([_per_feature(t, dim) for t in targets], dim=1)
    with torch.no_grad():
        before = torch.cat([_per_feature(module(x), dim) for x in inputs], dim=1)
    statistics = isinstance(module, _BatchNorm) and module.running_mean is not None
    if statistics:
        _set_statistics(module, inputs, dim)  # type: ignore[arg-type]
    scalars: dict[str, float] = {}
    if getattr(module, "scalars", None):
        scalars = _fit_scalars(module, torch.cat([_per_feature(x, dim) for x in inputs], dim=1), y, has_bias)
        with torch.no_grad():
            for name, value in scalars.items():
                getattr(module, name).fill_(value)
        # reported as stored (the parameter's dtype rounds the fit)
        scalars = {name: float(getattr(module, name).detach()) for name in scalars}
    a, b, _ = _fit(_normalized(module, inputs, dim), y, has_bias)
    offset = float(getattr(module, "weight_offset", 0.0))
    with torch.no_grad():
        weight.copy_((a - offset).reshape(weight.shape).to(weight.dtype))
        if has_bias:
            bias.copy_(b.reshape(bias.shape).to(bias.dtype))
        after = torch.cat([_per_feature(module(x), dim) for x in inputs], dim=1)
    return SiteFit(
        site="",
        module_class=type(module).__name__,
        sqnr_before_db=sqnr_db(y, before),
        sqnr_after_db=sqnr_db(y, after),
        statistics=statistics,
        alpha=scalars.get("alpha"),
        shift=scalars.get("shift"),
    )


def _model_sqnr(reference: list[Any], model: nn.Module, batches: list[ModelInputs]) -> float:
    """The whole model's SQNR on the calibration data: per output, over all batches together (as
    validate computes it), the worst output's."""
    pooled: dict[str, PooledSqnr] = {}
    for ref, batch in zip(reference, batches, strict=True):
        for (name, r), (_, o) in zip(flatten_outputs(ref), flatten_outputs(_run(model, batch)), strict=True):
            pooled.setdefault(name, PooledSqnr()).add(r, o)
    return min((p.db for p in pooled.values()), default=math.inf)


# Fits one site from its inputs in the converted model and the original's outputs there, each a list
# over the batches; a SiteFit (its ``site`` is filled in by the caller), or the reason it was not fitted.
SiteFitter = Callable[[nn.Module, list[torch.Tensor], list[torch.Tensor]], "SiteFit | str"]


def fit_sites_in_order(
    original: nn.Module,
    converted: nn.Module,
    sites: list[str],
    batches: Iterable[Any],
    fit: SiteFitter,
    on_site: Callable[[str], None] | None = None,
) -> AffineCalibrationReport:
    """The layer-by-layer calibration both affine norms and cosine layers use: the original's outputs at
    ``sites`` recorded once, then each site, in execution order, fitted by ``fit`` on its inputs in the
    converted model as calibrated so far; the whole model's SQNR before and after."""
    # both models run on the same inputs, as both take them (feeding's one rule)
    notes: list[str] = []
    data = [fed(original, as_model_inputs(b), notes, compared_with=(converted,)) for b in batches]
    report = AffineCalibrationReport(batches=len(data), notes=notes)
    if not data or not sites:
        return report
    with modes_restored(original, converted, inference=True), torch.no_grad():
        reference = [
            copy.deepcopy(run_batch(original, b, f"calibration batch {i}")) for i, b in enumerate(data)
        ]
        report.model_sqnr_before_db = _model_sqnr(reference, converted, data)
        with recording(original, sites, "output") as outputs:
            for batch in data:
                _run(original, batch)
        saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # each fitted site's tensors before
        for site in _execution_order(converted, sites, data[0]):
            if on_site is not None:
                on_site(site)
            with recording(converted, [site], "input") as inputs:
                for batch in data:
                    _run(converted, batch)
            module = converted.get_submodule(site)
            saved.append(_state(module))
            try:
                _refuse_nonfinite(site, module, inputs[site], outputs[site], fitted=False)
                result = fit(module, inputs[site], outputs[site])
                _refuse_nonfinite(site, module, [], [], fitted=True)
            except BaseException:
                for kept in saved:  # nothing of a refused calibration stays in the model
                    _restore(kept)
                raise
            if isinstance(result, str):
                report.sites.append(SiteFit(site, type(module).__name__, math.nan, math.nan, note=result))
                continue
            result.site = site
            report.sites.append(result)
        report.model_sqnr_after_db = _model_sqnr(reference, converted, data)
    return report


def _state(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t, t.detach().clone()) for t in (*module.parameters(), *module.buffers())]


def _restore(state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for tensor, before in state:
            tensor.copy_(before)


def _refuse_nonfinite(
    site: str,
    module: nn.Module,
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    *,
    fitted: bool,
) -> None:
    """The one check every calibration fit goes through (CheckFailedError, naming where): before the fit
    (``fitted=False``), the activations it is fitted on hold a NaN or Inf (a fit over them compares
    nothing there, whatever it produces); after it, a fitted parameter or statistic is not finite."""
    for what, tensors in (("inputs", inputs), ("target outputs of the original", targets)):
        found = next(((i, f) for i, t in enumerate(tensors) if (f := first_nonfinite(t)) is not None), None)
        if found is not None:
            i, (count, at, value) = found
            raise CheckFailedError(
                f"calibration of {site} ({type(module).__name__}): its {what} on the calibration data hold "
                f"{value} at {at} in batch {i + 1} ({count} non-finite value{'s' if count != 1 else ''}): "
                "check the calibration data for NaN/Inf; nothing written"
            )
    if not fitted:
        return
    named = [*module.named_parameters(), *module.named_buffers()]
    bad = next(((n, f) for n, t in named if (f := first_nonfinite(t)) is not None), None)
    if bad is not None:
        name, (_, index, kind) = bad
        raise CheckFailedError(
            f"calibration of {site} ({type(module).__name__}) produced a non-finite {name} ({kind} at "
            f"{index}) from finite data; nothing written"
        )


def calibrate_swapped_norms(
    original: nn.Module,
    converted: nn.Module,
    sites: list[str],
    batches: Iterable[Any],
    *,
    on_site: Callable[[str], None] | None = None,
) -> AffineCalibrationReport:
    """Fit the norms at ``sites`` of ``converted`` (in place) to the original norms' outputs.

    ``original`` and ``converted`` share module paths (the swap replaced modules in place). ``batches``
    are model inputs (tensors, tuples or dicts). Both models are run in eval mode; their modes are
    restored. ``on_site`` is called with each site path as it is fitted (for a progress bar).
    """
    return fit_sites_in_order(original, converted, sites, batches, fit_site, on_site)
