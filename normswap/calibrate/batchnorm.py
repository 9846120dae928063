"""Re-estimate BatchNorm running statistics from data (data-driven: DESIGN.md's third kind of rewrite).

Why: a BatchNorm in eval mode normalizes with the ``running_mean``/``running_var`` it saw in training. Any
change upstream of it (pruned or quantized weights, a fine-tuned backbone, a norm swapped earlier in the
network) moves the true statistics of its input, and the stale ones then shift and scale every channel.

Math: each BatchNorm is put in training mode with ``momentum=None`` after ``reset_running_stats()``
(mean 0, var 1, count 0); PyTorch then keeps a cumulative moving average. For batch k = 1..n, with
``m_k`` the per-channel mean over every dim but dim 1 and ``v_k`` the unbiased per-channel variance
(sum of squared deviations / (count - 1)), it updates

    running_mean <- running_mean + (m_k - running_mean) / k
    running_var  <- running_var  + (v_k - running_var)  / k

so after n batches ``running_mean = (1/n) sum_k m_k`` and ``running_var = (1/n) sum_k v_k``. Every batch
weighs the same whatever its size: with equal batch sizes ``running_mean`` is exactly the mean over all
samples and ``running_var`` the pooled within-batch unbiased variance, PyTorch's own convention for
``running_var``. A smaller last batch counts as much as a full one (by default it is the held-out batch).

Legality, per layer (a skip with its reason otherwise):
- a ``torch.nn`` ``_BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, timm's BatchNormAct2d and other
  subclasses that keep torch's update rule); SyncBatchNorm outside an initialized process group falls
  back to plain batch norm, so it calibrates on one process like BatchNorm;
- ``track_running_stats=True``: without running statistics there is nothing to re-estimate;
- called at least once by the model's forward on the calibration data (an unused BatchNorm keeps its
  statistics); one called at several sites gets the average over all its calls, as training would give;
- frozen batch norms (torchvision/timm FrozenBatchNorm2d) and InstanceNorm with running statistics are
  left alone: they have no training-mode update, or are not BatchNorm;
- in a loaded ``.pt2``, batch-norm ops that could not be lifted into modules keep their statistics.

During calibration every module but the calibrated BatchNorms is in eval mode (dropout off, other norms
untouched; a BatchNorm's own children such as timm's activation stay in eval too), gradients are off, and
afterwards every module's mode and every BatchNorm's momentum are restored, also when a batch fails. A
failure also puts the statistics back, so an ``inplace=True`` call that raises leaves the model as it was.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from normswap.calibrate.data import ModelInputs, as_model_inputs
from normswap.calibrate.feeding import fed, run_batch
from normswap.errors import BadInputError
from normswap.passes.core.base import RewriteKind, Skip
from normswap.util.finite import first_nonfinite, holds
from normswap.verify import ModelComparison, compare_outputs
from normswap.verify.metrics import flatten_outputs

PASS_NAME = "recalibrate_batchnorm"

# Called after each calibration batch with (batches done, batches expected or None when unknown).
ProgressCallback = Callable[[int, int | None], None]


@dataclass
class LayerRecalibration:
    """How far one BatchNorm's statistics moved. Ratios compare new to old; shifts are channel maxima."""

    path: str
    class_name: str
    num_features: int
    calls: int  # forward calls that updated it: batches x call sites per batch
    mean_shift: float  # max over channels of |new mean - old mean| / sqrt(old var + eps): in old std units
    mean_max_abs_change: float  # max over channels of |new mean - old mean|
    var_ratio_min: float  # min over channels of new var / old var
    var_ratio_max: float
    finite: bool  # every new statistic is a finite number


@dataclass
class RecalibrationReport:
    """What :func:`recalibrate_batchnorm` did. ``holdout`` compares the outputs after vs before."""

    batches: int = 0
    samples: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    layers: list[LayerRecalibration] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    holdout: ModelComparison | None = None
    # where the held-out outputs with the new statistics hold NaN/Inf (None: finite); the old ones may
    # hold them: broken statistics are what a recalibration repairs
    holdout_after_nonfinite: str | None = None
    holdout_samples: int = 0
    holdout_source: str = ""
    notes: list[str] = field(default_factory=list)
    pass_name: str = PASS_NAME
    kind: RewriteKind = RewriteKind.DATA_DRIVEN

    @property
    def ok(self) -> bool:
        """False when a statistic or a held-out output of the recalibrated model is not finite: the model
        must not be shipped."""
        return all(layer.finite for layer in self.layers) and self.holdout_after_nonfinite is None

    @property
    def non_finite_layers(self) -> list[str]:
        return [layer.path for layer in self.layers if not layer.finite]

    def to_dict(self) -> dict[str, Any]:
        return {
            "pass_name": self.pass_name,
            "kind": self.kind.value,
            "ok": self.ok,
            "batches": self.batches,
            "samples": self.samples,
            "batch_sizes": list(self.batch_sizes),
            "layers": [asdict(layer) for layer in self.layers],
            "skips": [asdict(skip) for skip in self.skips],
            "holdout": self.holdout.to_dict() if self.holdout is not None else None,
            "holdout_samples": self.holdout_samples,
            "holdout_source": self.holdout_source,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------------
# Which layers


def _skip(site: str, reason: str) -> Skip:
    return Skip(PASS_NAME, site, reason)


def _is_lazy_uninitialized(module: nn.Module) -> bool:
    has = getattr(module, "has_uninitialized_params", None)
    return callable(has) and bool(has())


def find_batchnorms(model: nn.Module) -> tuple[list[tuple[str, _BatchNorm]], list[Skip]]:
    """The BatchNorm layers recalibration can re-estimate, and every other statistics holder with why not."""
    found: list[tuple[str, _BatchNorm]] = []
    skips: list[Skip] = []
    for path, module in model.named_modules():
        site = path or "(root)"
        name = type(module).__name__
        if isinstance(module, _BatchNorm):
            if not module.track_running_stats or module.running_mean is None or module.running_var is None:
                skips.append(
                    _skip(
                        site,
                        f"{name} has track_running_stats=False: it always normalizes with the statistics of "
                        "the batch at hand, so there are no running statistics to recalibrate",
                    )
                )
            elif _is_lazy_uninitialized(module):
                skips.append(_skip(site, f"{name} is a lazy module that has never run: no statistics yet"))
            else:
                found.append((path, module))
        elif isinstance(getattr(module, "running_var", None), torch.Tensor) and isinstance(
            getattr(module, "running_mean", None), torch.Tensor
        ):
            if "instancenorm" in name.lower():
                reason = f"{name} is not a BatchNorm: its running statistics are left as they are"
            else:
                reason = (
                    f"{name} keeps frozen statistics (no training-mode update re-estimates them); "
                    "left as it is"
                )
            skips.append(_skip(site, reason))
    skips += _unlifted_graph_batchnorms(model)
    return found, skips


def _unlifted_graph_batchnorms(model: nn.Module) -> list[Skip]:
    """Batch-norm ops left in a loaded .pt2's graph: their statistics are operands, not a module's state."""
    from normswap.graph.ops import op_name

    skips = []
    for path, module in model.named_modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and op_name(node) == "batch_norm":
                where = f"{path}.{node.name}" if path else node.name
                skips.append(
                    _skip(
                        where,
                        "batch_norm op in the exported graph was not lifted into a BatchNorm module (its "
                        "parameters are not held by one module alone), so its statistics cannot be updated",
                    )
                )
    return skips


# ---------------------------------------------------------------------------------------------------
# Modes and state


@dataclass
class _Stats:
    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor | None

    @classmethod
    def of(cls, bn: _BatchNorm) -> _Stats:
        count = bn.num_batches_tracked
        return cls(
            bn.running_mean.detach().clone(),  # type: ignore[union-attr]
            bn.running_var.detach().clone(),  # type: ignore[union-attr]
            count.detach().clone() if count is not None else None,
        )

    def load_into(self, bn: _BatchNorm) -> None:
        with torch.no_grad():
            bn.running_mean.copy_(self.mean)  # type: ignore[union-attr]
            bn.running_var.copy_(self.var)  # type: ignore[union-attr]
            if self.count is not None and bn.num_batches_tracked is not None:
                bn.num_batches_tracked.copy_(self.count)


class ModelModes:
    """Every module's training flag, saved to be put back exactly (``.train()`` would recurse)."""

    def __init__(self, model: nn.Module) -> None:
        self._flags = [(m, m.training) for m in model.modules()]

    def all_eval(self) -> None:
        # Set flags directly: a torch.export module's .eval() raises, and .train() on a BatchNorm would
        # also switch its children (timm's BatchNormAct2d holds dropout and activation modules).
        for module, _ in self._flags:
            module.training = False

    def restore(self) -> None:
        for module, flag in self._flags:
            module.training = flag


# ---------------------------------------------------------------------------------------------------
# Recalibration


def _expected_batches(batches: Iterable[Any], max_batches: int | None, holdout_given: bool) -> int | None:
    try:
        available = len(batches)  # type: ignore[arg-type]
    except TypeError:
        return max_batches
    usable = available if holdout_given else max(available - 1, 0)
    return min(usable, max_batches) if max_batches is not None else usable


# Roles of the batches read from the data: calibrate on it, or hold it out as the last batch or as the
# batch following the first N (``max_batches=N``).
_CALIBRATE, _LAST, _AFTER_N = "calibrate", "last", "after_n"


def _split_holdout(
    batches: Iterable[Any], max_batches: int | None, holdout_given: bool
) -> Iterator[tuple[Any, str]]:
    """Yield (batch, role). Without an explicit holdout, the batch after the last calibration one is held
    out; streamed with one batch of lookahead, and never reading more than it uses."""
    iterator = iter(batches)
    if holdout_given:
        for batch in itertools.islice(iterator, max_batches):
            yield batch, _CALIBRATE
        return
    done = 0
    sentinel = object()
    pending = next(iterator, sentinel)
    while pending is not sentinel:
        if max_batches is not None and done >= max_batches:
            yield pending, _AFTER_N
            return
        following = next(iterator, sentinel)
        if following is sentinel:
            yield pending, _LAST
            return
        yield pending, _CALIBRATE
        done += 1
        pending = following


def _layer_change(path: str, bn: _BatchNorm, before: _Stats, after: _Stats) -> LayerRecalibration:
    old_mean, old_var = before.mean.double(), before.var.double()
    new_mean, new_var = after.mean.double(), after.var.double()
    delta = (new_mean - old_mean).abs()
    ratio = new_var / old_var  # an old var of 0 gives inf, which is what happened
    finite = bool(torch.isfinite(new_mean).all() and torch.isfinite(new_var).all())
    calls = int(after.count) if after.count is not None else 0
    return LayerRecalibration(
        path=path,
        class_name=type(bn).__name__,
        num_features=int(new_mean.numel()),
        calls=calls,
        mean_shift=float((delta / (old_var + bn.eps).sqrt()).max()),
        mean_max_abs_change=float(delta.max()),
        var_ratio_min=float(ratio.min()),
        var_ratio_max=float(ratio.max()),
        finite=finite,
    )


def recalibrate_batchnorm(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    holdout: Any | None = None,
    max_batches: int | None = None,
    inplace: bool = False,
    on_batch: ProgressCallback | None = None,
) -> tuple[nn.Module, RecalibrationReport]:
    """Re-estimate every BatchNorm's running statistics as the average over calibration batches.

    ``batches`` yields tensors, tuples/lists of positional inputs, dicts of keyword inputs or
    :class:`ModelInputs`. The model's outputs after vs before are compared on ``holdout`` (one batch) or,
    when it is None, on the last batch of ``batches``, which is then not used for calibration (with
    ``max_batches=N``: the first N batches calibrate and batch N+1 is held out). Returns the recalibrated
    model (a copy unless ``inplace``) and the report. Raises BadInputError when the model has no BatchNorm
    to recalibrate, when there are no calibration batches, or when a batch does not fit the model.
    """
    if max_batches is not None and max_batches < 1:
        raise BadInputError(f"--batches must be at least 1, got {max_batches}")
    target = model if inplace else copy.deepcopy(model)
    layers, skips = find_batchnorms(target)
    if not layers:
        if not skips:
            raise BadInputError("nothing to recalibrate: the model has no BatchNorm layers")
        reasons = "; ".join(f"{s.site}: {s.reason}" for s in skips[:3])
        more = f" (+{len(skips) - 3} more)" if len(skips) > 3 else ""
        raise BadInputError(f"nothing to recalibrate: no BatchNorm can be recalibrated ({reasons}{more})")

    report = RecalibrationReport(skips=list(skips))
    before = {path: _Stats.of(bn) for path, bn in layers}
    momenta = [(bn, bn.momentum) for _, bn in layers]
    modes = ModelModes(target)
    total = _expected_batches(batches, max_batches, holdout is not None)
    held_out: ModelInputs | None = None
    report.holdout_source = "separate held-out batch" if holdout is not None else ""
    failed = True
    try:
        modes.all_eval()
        for _, bn in layers:
            bn.training = True
            bn.momentum = None  # cumulative average instead of the training EMA
            bn.reset_running_stats()
        with torch.no_grad():
            for batch, role in _split_holdout(batches, max_batches, holdout is not None):
                inputs = as_model_inputs(batch)
                if role != _CALIBRATE:
                    held_out = inputs
                    report.holdout_source = (
                        "last batch of the data"
                        if role == _LAST
                        else f"the batch after the first {report.batches} of the data"
                    )
                    break
                run_batch(target, fed(target, inputs, report.notes), f"calibration batch {report.batches}")
                report.batches += 1
                report.batch_sizes.append(inputs.num_samples)
                if on_batch is not None:
                    on_batch(report.batches, total)
        if report.batches == 0:
            if held_out is not None:
                detail = "a single batch, which is held out to compare outputs; give more data or a holdout"
            else:
                detail = "no batches"
            raise BadInputError(f"nothing to calibrate on: the data yields {detail}")
        if max_batches is not None and report.batches < max_batches:
            besides = " besides the held-out one" if held_out is not None and holdout is None else ""
            report.notes.append(
                f"{max_batches} calibration batches were asked for (--batches); the data holds "
                f"{report.batches}{besides}, and all of them were used"
            )
        failed = False
    finally:
        if failed:
            for path, bn in layers:
                before[path].load_into(bn)
        for bn, momentum in momenta:
            bn.momentum = momentum
        modes.restore()

    report.samples = sum(report.batch_sizes)
    after: dict[str, _Stats] = {}
    for path, bn in layers:
        stats = _Stats.of(bn)
        calls = int(stats.count) if stats.count is not None else report.batches
        if calls == 0:
            # Never reached: reset_running_stats() left mean 0 / var 1; put the real ones back.
            before[path].load_into(bn)
            report.skips.append(
                _skip(
                    path, f"{type(bn).__name__} was not called by the model's forward on the calibration data"
                )
            )
            continue
        after[path] = stats
        report.layers.append(_layer_change(path, bn, before[path], stats))
        if calls != report.batches:
            report.notes.append(
                f"{path} ran {calls} times in {report.batches} calibration batches: its statistics average "
                "all its calls"
            )
    if len(set(report.batch_sizes)) > 1:
        report.notes.append(
            f"batch sizes differ ({min(report.batch_sizes)} to {max(report.batch_sizes)}): each batch "
            "weighs the same in the average, whatever its size"
        )

    if holdout is not None:
        held_out = as_model_inputs(holdout)
    if held_out is not None:
        report.holdout_samples = held_out.num_samples
        try:
            report.holdout, report.holdout_after_nonfinite = _compare_on_holdout(
                target, layers, before, after, fed(target, held_out, report.notes)
            )
            if report.holdout.nonfinite is not None and report.holdout_after_nonfinite is None:
                report.notes.append(
                    f"before recalibration {report.holdout.nonfinite}: the old statistics computed it, "
                    "the new ones compute finite outputs"
                )
        except BaseException:
            for path, bn in layers:
                before[path].load_into(bn)
            raise
    return target, report


def _compare_on_holdout(
    model: nn.Module,
    layers: list[tuple[str, _BatchNorm]],
    before: dict[str, _Stats],
    after: dict[str, _Stats],
    inputs: ModelInputs,
) -> tuple[ModelComparison, str | None]:
    """Eval-mode outputs with the new statistics against those with the old, on the same batch, and
    where the new ones hold NaN/Inf (None: finite)."""
    modes = ModelModes(model)
    try:
        modes.all_eval()
        with torch.no_grad():
            new = run_batch(model, copy.deepcopy(inputs), "held-out batch")
            for path, bn in layers:
                before[path].load_into(bn)
            try:
                old = run_batch(model, copy.deepcopy(inputs), "held-out batch")
            finally:
                for path, bn in layers:
                    after.get(path, before[path]).load_into(bn)
    finally:
        modes.restore()
    after_nonfinite = next(
        (f"{name} holds {holds(found)}" for name, t in flatten_outputs(new) if (found := first_nonfinite(t))),
        None,
    )
    return compare_outputs(old, new), after_nonfinite
