"""Where two models part ways: per-output figures, and per-layer divergence of the modules they share.

Two models that share module paths (a model and its converted copy: every pass edits modules in place
and keeps their paths) are run on the same batches with forward hooks on every shared module. Each
module's outputs are compared in execution order, so the first layer whose output drifts past the
threshold is where a rewrite starts to hurt; norm sites are listed on their own, in order, because
they are what normswap changes.

Outputs of a layer are compared only when they have the same shape (or a permutation of it: a .pt2 lifts
a channel norm's op without its permutes): a module whose output shape differs between the two models (a
Conv1d subclass whose forward reshapes comes back from a .pt2 as a plain Conv1d, hooked before the
reshape) is listed as not compared, with the reason, never as divergent. A NaN or Inf in a layer's or an
output's values fails that comparison and says where (:func:`normswap.verify.metrics.nonfinite_where`).
With ``exact``, the verdict is the one exact rule of convert and validate
(:func:`normswap.verify.exact.judge_exact`).
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

from normswap.util.modes import modes_restored
from normswap.util.shapes import format_shapes, input_shapes
from normswap.util.tolerance import exact_tolerance
from normswap.verify.exact import ExactRun, ExactVerdict, judge_exact, run_widened, widened_model
from normswap.verify.finite import refuse_nonfinite_outputs
from normswap.verify.metrics import TensorComparison, compare_tensors, flatten_outputs

DEFAULT_MIN_SQNR_DB = 40.0


@dataclass
class LayerDivergence:
    path: str
    original_class: str
    converted_class: str
    is_norm: bool
    calls: int
    sqnr_db: float
    max_abs: float
    max_rel: float
    cosine: float
    note: str = ""  # why the layer could not be compared (it then counts as divergent)


@dataclass
class OutputFigures:
    comparison: TensorComparison
    top5_agreement: float | None = None


@dataclass
class ValidationReport:
    batches: int
    exact: bool
    min_sqnr_db: float
    outputs: list[OutputFigures] = field(default_factory=list)
    layers: list[LayerDivergence] = field(default_factory=list)
    first_divergent: str | None = None
    shared_modules: int = 0
    # shared modules whose outputs were not compared, with the reason: {"path", "reason"}
    skipped_layers: list[dict[str, str]] = field(default_factory=list)
    exact_verdict: ExactVerdict | None = None  # with ``exact``: the one exact rule's verdict

    @property
    def norm_sites(self) -> list[LayerDivergence]:
        return [layer for layer in self.layers if layer.is_norm]

    @property
    def passed(self) -> bool:
        """Exact: the one exact rule (:func:`normswap.verify.exact.judge_exact`). Otherwise: every
        output above min SQNR. Either way, an output holding a NaN or Inf fails."""
        return self.failure is None

    @property
    def failure(self) -> str | None:
        """Why the comparison fails, in one sentence; None when it passes."""
        nonfinite = next((o.comparison.nonfinite for o in self.outputs if o.comparison.nonfinite), None)
        if nonfinite is not None:
            return nonfinite
        if self.exact:
            if self.exact_verdict is None:
                return "no output was compared"
            return None if self.exact_verdict.passed else self.exact_verdict.reason
        low = [o.comparison for o in self.outputs if not o.comparison.sqnr_db >= self.min_sqnr_db]
        if low:
            return f"{low[0].name}: SQNR {low[0].sqnr_db:.3g} dB, below {self.min_sqnr_db:g} dB"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "exact": self.exact,
            "min_sqnr_db": self.min_sqnr_db,
            "passed": self.passed,
            "failure": self.failure,
            "exact_rule": self.exact_verdict.to_dict() if self.exact_verdict is not None else None,
            "first_divergent": self.first_divergent,
            "skipped_layers": self.skipped_layers,
            "shared_modules": self.shared_modules,
            "outputs": [{**asdict(o.comparison), "top5_agreement": o.top5_agreement} for o in self.outputs],
            "layers": [asdict(layer) for layer in self.layers],
        }


def _call(model: nn.Module, what: str, args: tuple, kwargs: dict) -> Any:
    try:
        return model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except Exception as exc:  # a model fails in its own ways; the caller needs one sentence
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ValueError(f"{what} fails on these inputs: {type(exc).__name__}: {first}") from exc


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    found = flatten_outputs(value)
    return found[0][1] if found else None


@contextlib.contextmanager
def _record_outputs(
    model: nn.Module, paths: list[str]
) -> Iterator[tuple[dict[str, list[torch.Tensor]], list[str]]]:
    outputs: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    order: list[str] = []
    handles = []
    for path in paths:

        def hook(_m: nn.Module, _a: tuple, out: Any, path: str = path) -> None:
            tensor = _first_tensor(out)
            if tensor is not None:
                # clone: the caller may modify the output in place afterwards (ResNet's shortcut add)
                outputs[path].append(tensor.detach().clone())
                if path not in order:
                    order.append(path)

        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        yield outputs, order
    finally:
        for h in handles:
            h.remove()


def _topk_agreement(reference: torch.Tensor, output: torch.Tensor, k: int = 5) -> float | None:
    """Fraction of rows whose top-1 class of ``output`` is among the reference's top-k."""
    if reference.ndim < 2 or reference.shape[-1] < k or not reference.is_floating_point():
        return None
    top = reference.topk(k, dim=-1).indices
    pred = output.argmax(-1, keepdim=True)
    return float((top == pred).any(-1).double().mean())


def _shared_paths(original: nn.Module, converted: nn.Module) -> list[str]:
    theirs = dict(converted.named_modules())
    return [p for p, _ in original.named_modules() if p and p in theirs]


def validate_models(
    original: nn.Module,
    converted: nn.Module,
    batches: Iterable[tuple[tuple, dict]],
    *,
    exact: bool = False,
    min_sqnr_db: float = DEFAULT_MIN_SQNR_DB,
    norm_paths: Iterable[str] = (),
    on_batch: Callable[[int], None] | None = None,
) -> ValidationReport:
    """Compare ``converted`` with ``original`` on ``batches`` of ``(args, kwargs)``; neither is changed.

    ``norm_paths`` marks which shared modules are norm sites (from :func:`normswap.find_norms` on the
    original). The first divergent layer is the first shared module, in execution order, whose output
    leaves the exact tolerance (``exact``) or falls below ``min_sqnr_db``.
    """
    norms = set(norm_paths)
    paths = _shared_paths(original, converted)
    batches = list(batches)
    report = ValidationReport(batches=len(batches), exact=exact, min_sqnr_db=min_sqnr_db)
    report.shared_modules = len(paths)
    ref_outputs: list[Any] = []
    new_outputs: list[Any] = []
    with (
        # validation is about inference; every module's mode comes back afterwards
        modes_restored(original, converted, inference=True),
        _record_outputs(original, paths) as (ref_layers, order),
        _record_outputs(converted, paths) as (new_layers, _),
        torch.no_grad(),
    ):
        for i, (args, kwargs) in enumerate(batches):
            ref_outputs.append(_call(original, "the original model", args, kwargs))
            shapes = format_shapes(input_shapes(args, kwargs))
            where = (
                f"batch {i + 1} of {len(batches)} ({shapes})" if len(batches) > 1 else f"the inputs {shapes}"
            )
            refuse_nonfinite_outputs(ref_outputs[-1], where, "the original model")
            new_outputs.append(_call(converted, "the converted model", args, kwargs))
            if on_batch is not None:
                on_batch(i)
    report.outputs = _compare_outputs(ref_outputs, new_outputs)
    if exact:
        runs = [
            ExactRun(f"on batch {i + 1}" if len(batches) > 1 else "on the inputs", ref, new, args, kwargs)
            for i, ((args, kwargs), ref, new) in enumerate(
                zip(batches, ref_outputs, new_outputs, strict=True)
            )
        ]
        with modes_restored(original, inference=True):
            report.exact_verdict = judge_exact(runs, lambda: run_widened(widened_model(original), batches))
    originals, convs = dict(original.named_modules()), dict(converted.named_modules())
    for path in order:
        if not new_layers[path] and type(convs[path]) is nn.Module:
            # a plain container of a .pt2's module: the flat graph never calls it, so there is nothing
            # to compare (its contents are compared one by one)
            report.shared_modules -= 1
            continue
        layer = _compare_layer(
            path, ref_layers[path], new_layers[path], originals[path], convs[path], path in norms
        )
        if isinstance(layer, str):  # outputs of different shapes: nothing to compare, said why
            report.shared_modules -= 1
            report.skipped_layers.append({"path": path, "reason": layer})
            continue
        report.layers.append(layer)
        if report.first_divergent is None and _diverges(layer, exact, min_sqnr_db, ref_layers[path]):
            report.first_divergent = path
    return report


def _compare_outputs(ref_outputs: list[Any], new_outputs: list[Any]) -> list[OutputFigures]:
    """Per named output, over all batches concatenated along a new leading dim."""
    by_name: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for ref, new in zip(ref_outputs, new_outputs, strict=True):
        ref_flat, new_flat = flatten_outputs(ref), flatten_outputs(new)
        if [n for n, _ in ref_flat] != [n for n, _ in new_flat]:
            raise ValueError(
                f"the two models return different outputs: {[n for n, _ in ref_flat]} vs {[n for n, _ in new_flat]}"
            )
        for (name, r), (_, o) in zip(ref_flat, new_flat, strict=True):
            by_name.setdefault(name, ([], []))
            by_name[name][0].append(r.reshape(-1, *r.shape[-1:]) if r.ndim else r.reshape(1))
            by_name[name][1].append(o.reshape(-1, *o.shape[-1:]) if o.ndim else o.reshape(1))
    figures = []
    for name, (refs, news) in by_name.items():
        ref, new = torch.cat(refs), torch.cat(news)
        figures.append(OutputFigures(compare_tensors(name, ref, new), _topk_agreement(ref, new)))
    return figures


def _compare_layer(
    path: str,
    refs: list[torch.Tensor],
    news: list[torch.Tensor],
    old: nn.Module,
    new: nn.Module,
    is_norm: bool,
) -> LayerDivergence | str:
    """The figures of one shared module's outputs over every call; or why they cannot be compared."""
    common = dict(
        path=path,
        original_class=type(old).__name__,
        converted_class=type(new).__name__,
        is_norm=is_norm,
        calls=len(refs),
    )
    if len(refs) != len(news):
        return f"called {len(refs)} times in the original, {len(news)} in the converted model"
    bad = next(((r, n) for r, n in zip(refs, news, strict=True) if r.shape != n.shape), None)
    if bad is not None:
        # never compare outputs of different shapes (a .pt2 hooks a Conv1d subclass before its reshape)
        return (
            f"its outputs differ in shape ({_shape(bad[0])} in the original, {_shape(bad[1])} in the "
            f"converted {type(new).__name__}): the final outputs are compared, not this layer"
        )
    ref = torch.cat([r.reshape(-1) for r in refs]) if refs else torch.zeros(0)
    out = torch.cat([n.reshape(-1) for n in news]) if news else torch.zeros(0)
    c = compare_tensors(path, ref, out) if ref.numel() else None
    if c is not None and c.nonfinite:
        # where in the layer's own output (the flat index across calls says nothing): first such call
        where = next(
            w for r, n in zip(refs, news, strict=True) if (w := compare_tensors(path, r, n).nonfinite)
        )
        nan = math.nan
        return LayerDivergence(**common, sqnr_db=nan, max_abs=nan, max_rel=nan, cosine=nan, note=where)
    if c is None:
        return LayerDivergence(**common, sqnr_db=math.inf, max_abs=0.0, max_rel=0.0, cosine=1.0)
    return LayerDivergence(**common, sqnr_db=c.sqnr_db, max_abs=c.max_abs, max_rel=c.max_rel, cosine=c.cosine)


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(d) for d in t.shape) or "scalar"


def _diverges(layer: LayerDivergence, exact: bool, min_sqnr_db: float, refs: list[torch.Tensor]) -> bool:
    if layer.note:
        return True
    if exact:
        return layer.max_rel > exact_tolerance(refs[0].dtype)
    return layer.sqnr_db < min_sqnr_db


def plot_norm_sites(report: ValidationReport, path: str, title: str = "") -> None:
    """PNG of the SQNR of every shared layer in execution order, norm sites marked (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    finite = [(i, layer) for i, layer in enumerate(report.layers) if math.isfinite(layer.sqnr_db)]
    cap = max([layer.sqnr_db for _, layer in finite] + [report.min_sqnr_db + 20])
    fig, ax = plt.subplots(figsize=(max(6.0, len(report.layers) * 0.12), 4.0))
    xs = list(range(len(report.layers)))
    ys = [layer.sqnr_db if math.isfinite(layer.sqnr_db) else cap for layer in report.layers]
    ax.plot(xs, ys, color="0.75", linewidth=1, label="every shared layer")
    norm_points = [
        (i, y) for i, (layer, y) in enumerate(zip(report.layers, ys, strict=True)) if layer.is_norm
    ]
    if norm_points:
        ax.scatter(*zip(*norm_points, strict=True), color="tab:red", s=14, zorder=3, label="norm sites")
    if not report.exact:
        ax.axhline(report.min_sqnr_db, color="tab:orange", linestyle="--", linewidth=1, label="threshold")
    if report.first_divergent is not None:
        index = next(i for i, layer in enumerate(report.layers) if layer.path == report.first_divergent)
        ax.axvline(
            index,
            color="tab:blue",
            linestyle=":",
            linewidth=1,
            label=f"first divergent: {report.first_divergent}",
        )
    ax.set_xlabel("layer, in execution order")
    ax.set_ylabel("SQNR vs original (dB)")  # identical layers (inf) are drawn at the top
    ax.set_title(title or "Divergence of the converted model by layer")
    ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
