"""The ``normswap`` command: parses options, calls the library, prints. No logic of its own.

Start-up stays light: torch and normswap are imported inside the commands, so ``normswap --help``
imports neither triton nor onnx (nor torch).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    name="normswap",
    help="Find, rewrite and verify the normalization layers of a trained PyTorch model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (logs, CI, tests) gets 120 columns instead of rich's 80, so tables stay readable.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, highlight=False)


def _flag(*names: str, help: str) -> Any:
    """An on/off option. typer's rich help prints the type of every option, flags included
    ("--exact <bool>"), unless it has a metavar: an empty one shows a flag as the bare flag it is."""
    return typer.Option(*names, help=help, metavar="")


def _print_version(value: bool) -> None:
    if not value:
        return
    # the installed distribution's metadata: no import of normswap (nor torch) to read a version
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("normswap")
    except PackageNotFoundError:  # run from a source tree that was never installed
        number = "unknown (not installed)"
    out.print(f"normswap {number}")
    raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print normswap's version and exit.",
            callback=_print_version,
            is_eager=True,
            metavar="",
        ),
    ] = False,
) -> None:
    """Find, rewrite and verify the normalization layers of a trained PyTorch model."""


MODEL_HELP = (
    "A .pt2 archive (torch.export), a factory 'package.module:callable' or 'file.py:callable' returning "
    "the model or (model, example_inputs), or a pickled module (.pt) with --trust-pickle. A factory is "
    "Python code that normswap imports and runs, as you asked; installed packages win over same-named "
    "modules in the working directory. A .pt2 runs nothing of its own."
)
ModelArg = Annotated[str, typer.Argument(help=MODEL_HELP, show_default=False)]
WeightsOpt = Annotated[
    Path | None, typer.Option("--weights", help="Weights for a factory model: safetensors or a state dict.")
]
TrustPickleOpt = Annotated[
    bool,
    _flag(
        "--trust-pickle",
        help="Allow unpickling: a pickled module (.pt), and pickled members of a .pt2 that torch's "
        "weights-only loader refuses. Unpickling runs whatever code the file names: only for files you "
        "trust. (Factories, package.module:callable, always run: they are code you chose.)",
    ),
]
InputsOpt = Annotated[
    Path | None,
    typer.Option("--inputs", help="Example inputs: a tuple or dict of tensors saved with torch.save."),
]
InputShapeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--input-shape",
        help="Example input shape, e.g. 1,3,224,224 or int64:1,16 for token ids. Repeat for several inputs.",
    ),
]
OpsetOpt = Annotated[
    int | None,
    typer.Option(
        "--opset", min=7, help="ONNX opset of a .onnx output (RMSNormalization needs 23) [exporter default]."
    ),
]
ReportOpt = Annotated[
    Path | None, typer.Option("--report", help="Also write the report as JSON to this file.")
]

DATA_SHORT_HELP = (
    "DATA: a folder of images, a .pt file of tensors or batches, or a factory returning an iterable of "
    "batches (see recalibrate --help)."
)

F = TypeVar("F", bound=Callable[..., Any])


def _handles_errors(fn: F) -> F:
    """Turn normswap's own errors into one line on stderr and their exit code (2 bad input, 1 check)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from rich.markup import escape

        from normswap.errors import NormswapError

        try:
            return fn(*args, **kwargs)
        except NormswapError as exc:
            # escaped: a path or an input like data[1].pt is text, not rich markup
            err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def _jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become the strings 'inf', '-inf', 'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _write_json(path: Path, data: Any) -> None:
    from normswap.load import atomic_write

    text = json.dumps(_jsonable(data), indent=2, allow_nan=False)
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))


def _load(model: str, weights: Path | None, trust_pickle: bool):
    from normswap.load import load_model
    from normswap.load.mode import set_inference_mode

    loaded = load_model(model, weights=weights, trust_pickle=trust_pickle)
    # Conversion and validation are about inference: BatchNorm must use its running statistics.
    set_inference_mode(loaded.model)
    return loaded


def _check_paths(reads: dict[str, Any], writes: dict[str, Any]) -> None:
    """Refuse, before any work, an output that is an input or another output (keys name the options).

    A key in capitals (MODEL, ORIGINAL, CONVERTED) or a data option (--data, --calibrate, --holdout) holds a
    spec: the file or folder it names, or the source file of its factory, is what it reads.
    """
    from normswap.load.paths import check_paths, source_paths

    spec_labels = {"MODEL", "ORIGINAL", "CONVERTED", "--data", "--calibrate", "--holdout"}
    paths: dict[str, Any] = {}
    for label, value in reads.items():
        if label in spec_labels:
            paths.update(source_paths(label, value))
        else:
            paths[label] = value
    check_paths(paths, writes)


def _check_inputs_fit(model: Any, args: Any, kwargs: Any, what: str = "the model") -> None:
    """One run of the user's model on the example inputs, so inputs that do not fit fail in one line."""
    from normswap.load.inputs import check_inputs_fit

    check_inputs_fit(model, args, kwargs, what=what)


def _fmt_float(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def _progress(disable: bool = False) -> Any:
    """A progress bar on stderr, shown only on a terminal, so piped output and logs stay clean."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=err, transient=True, disable=disable or not err.is_terminal)


@contextlib.contextmanager
def _status(text: str, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr saying what is being done, for phases that take long (a capture, a pass, a
    validation, an export); yields a function that changes the text. Shown only on a terminal and not in
    ``quiet`` (--report) runs, so pipes, logs and scripted runs stay clean; it leaves no line behind."""
    if quiet or not err.is_terminal:
        yield lambda _text: None
        return
    from rich.live import Live
    from rich.spinner import Spinner

    spinner = Spinner("dots", text=text, style="status.spinner")
    with Live(spinner, console=err, transient=True, refresh_per_second=12.5) as live:

        def say(new: str) -> None:
            spinner.update(text=new)
            live.refresh()  # shown at once: a phase may end before the next timed refresh

        yield say


def _print_capture_notes(notes: list[str], what: str, consequence: str) -> None:
    """Say which settings were turned off to capture the model (see normswap.graph.capture)."""
    if notes:
        out.print(f"note: {what} with {', '.join(notes)} ({consequence})", soft_wrap=True)


def _captured_what(captured: Any) -> str:
    return f"graph captured ({captured.method})" if captured.ok else "graph capture tried"


# What turning a setting off for the analysis capture means for the user.
_ANALYSIS_ONLY = "for the capture only: torch.export cannot return a cache; the model keeps its config"
_NO_CACHE = "it returns no cache; the model's own config is unchanged"


def _data_and_holdout(
    data: str, holdout: str | None, args: Any, kwargs: Any, batch_size: int | None, normalize: str | None
) -> tuple[Any, Any]:
    """The batches of --data, and the first batch of --holdout when given (read with the same options)."""
    from normswap.calibrate import load_calibration_data
    from normswap.errors import BadInputError

    options: dict[str, Any] = {
        "example_args": args,
        "example_kwargs": kwargs,
        "batch_size": batch_size,
        "normalize": normalize,
    }
    source = load_calibration_data(data, **options)
    held_out = None
    if holdout is not None:
        held_out = next(iter(load_calibration_data(holdout, **options, ignore_inapplicable=True)), None)
        if held_out is None:
            raise BadInputError(f"--holdout {holdout} yields no batch")
    return source, held_out


def _check_output_before_work(model: Any, output: Path, args: Any, kwargs: Any, quiet: bool) -> None:
    """Before minutes of training: can ``output``'s format be written? A .pt2 or .onnx is an export,
    tried on the example inputs when they are known; a .pt must pickle."""
    from normswap.graph.capture import capture_graph
    from normswap.load import SAVE_FORMATS, check_writable

    captured = None
    if SAVE_FORMATS.get(output.suffix.lower()) != "pickle" and (args is not None or kwargs):
        with _status("checking that the model can be exported", quiet):
            captured = capture_graph(model, args, kwargs)
    check_writable(model, output, args, kwargs, captured=captured)


def _save_trained(
    model: Any, output: Path, args: Any, kwargs: Any, data: Any, inputs_known: bool, source: str
) -> None:
    """Write a model whose parameters were re-estimated from DATA (never over its input file)."""
    from normswap.load import save_model

    if not inputs_known and data.first is not None:
        # No example inputs given: a data batch shows export what the model takes.
        args, kwargs = data.first.args, data.first.kwargs
    refuse = Path(source) if Path(source).exists() else None
    label = save_model(model, output, args or (), kwargs, refuse_path=refuse)
    out.print(f"wrote {output} ({label})", soft_wrap=True)


@app.command()
@_handles_errors
def inspect(
    model: ModelArg,
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the sites as JSON.")] = None,
) -> None:
    """List every normalization in MODEL: kind, shape, eps, affine, and what feeds and reads it."""
    from normswap.discover import find_norms
    from normswap.load import resolve_inputs

    _check_paths({"MODEL": model, "--weights": weights, "--inputs": inputs}, {"--json": json_out})
    loaded = _load(model, weights, trust_pickle)
    resolved = resolve_inputs(loaded, inputs_file=inputs, input_shapes=input_shape)
    args, kwargs = resolved if resolved is not None else (None, None)
    if inputs is not None or input_shape:
        _check_inputs_fit(loaded.model, args, kwargs)
    with _status("capturing a graph of the model", quiet=json_out is not None):
        inventory = find_norms(loaded.model, args, kwargs)

    table = Table(title=f"Norms in {model}", show_lines=False)
    for column in ("path", "kind", "class", "shape", "eps", "affine", "producer -> consumers"):
        table.add_column(column, overflow="fold")
    for site in inventory:
        cls = (site.class_name or site.source).rsplit(".", 1)[-1]
        if site.source != "module":
            cls = f"{cls} ({site.source})"
        affine = ("w" if site.affine else "-") + ("+b" if site.bias else "")
        flow = f"{site.producer or '?'} -> {', '.join(site.consumers) or '?'}"
        shape = "x".join(str(d) for d in site.normalized_shape) if site.normalized_shape else "?"
        table.add_row(site.path, site.kind, cls, shape, _fmt_float(site.eps), affine, flow)
    out.print(table)
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(inventory.counts().items())) or "none"
    graph = (
        f"graph captured with {inventory.graph_method}"
        if inventory.graph_method
        else f"no graph ({inventory.capture.reason}): {inventory.capture.advice}"
    )
    out.print(f"{len(inventory)} norm sites: {counts}; {escape(graph)}", soft_wrap=True)
    if inventory.graph_method == "fx" and inventory.capture.errors:
        out.print(f"[dim]{inventory.capture.reason}[/]", soft_wrap=True)
    _print_capture_notes(inventory.capture.notes, _captured_what(inventory.capture), _ANALYSIS_ONLY)
    if json_out is not None:
        _write_json(
            json_out,
            {
                "model": model,
                "graph_method": inventory.graph_method,
                "graph_errors": inventory.capture.errors,
                "graph_notes": inventory.capture.notes,
                "counts": inventory.counts(),
                "sites": [s.to_dict() for s in inventory],
            },
        )


@app.command()
@_handles_errors
def convert(
    model: ModelArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="Output file: .pt2, .pt or .onnx.")],
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="Swap norms to this kind: rmsnorm (exact where the residual stream can be recentered, "
            "architectural elsewhere), layernorm, batchnorm, groupnorm, instancenorm, dyt, identity "
            "(architectural), or fused (the same norms on normswap's fused kernels; exact).",
        ),
    ] = None,
    from_kinds: Annotated[
        list[str] | None,
        typer.Option(
            "--from",
            help="Only replace norms of this kind (batch, layer, rms, group, instance); repeatable. "
            "Default: every kind that differs from --to.",
        ),
    ] = None,
    groups: Annotated[int | None, typer.Option("--groups", min=1, help="Groups of --to groupnorm.")] = None,
    calibrate: Annotated[
        str | None,
        typer.Option(
            "--calibrate",
            help="Fit the swapped norms' affine parameters (and BatchNorm statistics) to the original "
            "norms' outputs on this data, layer by layer. " + DATA_SHORT_HELP,
        ),
    ] = None,
    calibrate_batches: Annotated[
        int | None, typer.Option("--calibrate-batches", min=1, help="Use the first N batches of --calibrate.")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="Batch size for an image folder or a single tensor [32]."),
    ] = None,
    fold_bn: Annotated[
        bool, _flag("--fold-bn", help="Fold eval-mode BatchNorm into the conv/linear beside it.")
    ] = False,
    fuse_add: Annotated[
        bool,
        _flag(
            "--fuse-add",
            help="With --to fused: also fuse each residual add into the norm after it (the output becomes "
            "a torch.fx GraphModule; exact).",
        ),
    ] = False,
    fuse_inline: Annotated[
        bool,
        _flag(
            "--fuse-inline",
            help="With --to fused: also fuse norms that are no module of their own (functional calls and "
            "norms written out inside another forward; the output becomes a torch.fx GraphModule; exact).",
        ),
    ] = False,
    fold_norm_affine: Annotated[
        bool,
        _flag(
            "--fold-norm-affine",
            help="Fold each norm's weight and bias into the Linear layers that read it (exact).",
        ),
    ] = False,
    add_weight_norm: Annotated[
        str | None,
        typer.Option(
            "--add-weight-norm",
            help="Wrap these Conv/ConvTranspose/Linear layers in weight norm: comma-separated module "
            "paths, or 'all' (exact).",
        ),
    ] = None,
    weight_norm_dim: Annotated[
        str,
        typer.Option(
            "--weight-norm-dim",
            help="Weight-norm magnitude dim: 'output' (one per output channel), an int, or 'none'.",
        ),
    ] = "output",
    remove_weight_norm: Annotated[
        bool,
        _flag("--remove-weight-norm", help="Fold every weight norm back into a plain weight (exact)."),
    ] = False,
    exact: Annotated[bool, _flag("--exact", help="Fail instead of applying any non-exact rewrite.")] = False,
    allow_lossy: Annotated[
        bool,
        _flag(
            "--allow-lossy",
            help="With --to rmsnorm: accept the architectural (lossy) LayerNorm -> RMSNorm swap where the "
            "exact route failed (no graph captured, a form normswap does not handle). Without it such a "
            "run fails and writes nothing; post-LN LayerNorms, which have no exact route, are swapped "
            "either way.",
        ),
    ] = False,
    opset: OpsetOpt = None,
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
) -> None:
    """Rewrite MODEL's norms, check the result against the original, and write it to -o."""
    from normswap.errors import BadInputError, CheckFailedError
    from normswap.passes import ExactOnlyError, Pipeline, RemoveWeightNorm

    _check_paths(
        {"MODEL": model, "--weights": weights, "--inputs": inputs, "--calibrate": calibrate},
        {"-o": output, "--report": report},
    )
    passes = _convert_passes(
        to=to,
        from_kinds=from_kinds,
        groups=groups,
        exact=exact,
        fold_bn=fold_bn,
        fold_norm_affine=fold_norm_affine,
        fuse_add=fuse_add,
        fuse_inline=fuse_inline,
        add_weight_norm=add_weight_norm,
        weight_norm_dim=weight_norm_dim,
        remove_weight_norm=remove_weight_norm,
    )
    if calibrate is not None and not any(p.name == "swap_norm" for p in passes):
        raise BadInputError("--calibrate fits swapped norms: give an architectural --to KIND")
    if allow_lossy and exact:
        raise BadInputError("--allow-lossy and --exact contradict each other: give one")
    if allow_lossy and to != "rmsnorm":
        raise BadInputError(
            "--allow-lossy applies to --to rmsnorm, whose exact route can fall back to a lossy swap; "
            "an architectural --to KIND is lossy by request"
        )
    try:
        pipeline = Pipeline(passes, exact_only=exact)
    except ExactOnlyError as exc:
        raise CheckFailedError(f"--exact: {exc}; nothing written") from None

    from normswap.graph.capture import capture_graph, capture_notes
    from normswap.load import SAVE_FORMATS, check_writable, require_inputs, save_model

    if output.suffix not in SAVE_FORMATS:
        raise BadInputError(f"-o {output}: unknown output format; use one of {', '.join(SAVE_FORMATS)}")
    if SAVE_FORMATS[output.suffix] == "pickle" and (fuse_inline or fuse_add):
        # said before the run, not after it: an exported program's module does not pickle
        flag = "--fuse-inline" if fuse_inline else "--fuse-add"
        raise BadInputError(
            f"{flag} makes the model an exported torch.fx GraphModule, which cannot be pickled to {output}: "
            "save as .pt2 or .onnx"
        )
    if SAVE_FORMATS[output.suffix] == "pickle" and add_weight_norm is not None:
        raise BadInputError(
            f"--add-weight-norm makes parametrized modules, which torch.save cannot pickle to {output}: "
            "save as .pt2 or .onnx"
        )
    loaded = _load(model, weights, trust_pickle)
    args, kwargs = require_inputs(loaded, inputs_file=inputs, input_shapes=input_shape)
    _check_inputs_fit(loaded.model, args, kwargs)
    quiet = report is not None
    # Captured once, before the work: it tells whether the output format can be written at all (a .pt2
    # or .onnx is an export), and the first pass analyzes this same graph instead of capturing it again.
    with _status("capturing a graph of the model (torch.export)", quiet):
        captured = capture_graph(loaded.model, args, kwargs)
    writable = loaded.model
    if SAVE_FORMATS[output.suffix] == "pickle" and remove_weight_norm:
        # a weight-norm parametrization does not pickle, and what is written is the model without it:
        # judge that model, so that anything else in it that does not pickle still fails before the work
        writable, _ = RemoveWeightNorm()(loaded.model)
    check_writable(writable, output, args, kwargs, captured=captured)
    del writable
    with _status("converting", quiet) as say:
        converted, result = pipeline(loaded.model, args, kwargs, captured=captured, on_step=say)
    _print_pipeline(result)
    _print_capture_notes(captured.notes, _captured_what(captured), _ANALYSIS_ONLY)
    lossy = None if allow_lossy or exact else _lossy_without_consent(result, to)
    extra: dict[str, Any] = {}
    if allow_lossy:
        from normswap.passes.recenter_layernorm import lossy_after_failure

        consented = [skip.site for skip in lossy_after_failure(result.passes)]
        extra["lossy_by_consent"] = consented
        if consented:
            out.print(
                f"note: --allow-lossy: {len(consented)} LayerNorm(s) swapped lossily where the exact route "
                "failed (see Skipped)",
                soft_wrap=True,
            )
    if calibrate is not None and lossy is None:
        extra = _calibrate_swaps(
            loaded.model, converted, result, calibrate, calibrate_batches, batch_size, args, kwargs, quiet
        )
    not_exact = _not_exact_under_flag(result, to) if exact else None

    written = False
    if result.ok and not_exact is None and lossy is None:
        source = Path(model) if Path(model).exists() else None
        if output.suffix.lower() == ".onnx":
            extra["onnx"] = _export_checked(converted, output, args, kwargs, opset, False, source, quiet)
        else:
            how = "exporting" if SAVE_FORMATS[output.suffix] == "pt2" else "writing"
            with _status(f"{how} {output}", quiet):
                label = save_model(converted, output, args, kwargs, refuse_path=source)
            out.print(f"wrote {output} ({label})")
            if label == "pt2":
                extra["output_notes"] = capture_notes(converted, args, kwargs)
                _print_capture_notes(extra["output_notes"], f"{output} exported", _NO_CACHE)
        written = True
    if report is not None:
        data = {"model": model, "output": str(output), "written": written, **result.to_dict(), **extra}
        data["graph_notes"] = captured.notes
        _write_json(report, data)
    if not result.ok:
        raise CheckFailedError(
            "exact rewrite changed the outputs: " + "; ".join(result.exact_failures) + "; nothing written"
        )
    if not_exact is not None:
        raise CheckFailedError(not_exact)
    if lossy is not None:
        raise CheckFailedError(lossy)


def _convert_passes(
    *,
    to: str | None,
    from_kinds: list[str] | None,
    groups: int | None,
    exact: bool,
    fold_bn: bool,
    fold_norm_affine: bool,
    fuse_add: bool,
    fuse_inline: bool,
    add_weight_norm: str | None,
    weight_norm_dim: str,
    remove_weight_norm: bool,
) -> list[Any]:
    """The passes of a convert run, in the order that lets each see what it needs."""
    from normswap.discover.site import NORM_KINDS
    from normswap.errors import BadInputError
    from normswap.passes import (
        SWAP_TARGETS,
        AddWeightNorm,
        FoldBatchNorm,
        FoldNormAffine,
        RecenterLayerNorm,
        RemoveWeightNorm,
        SwapNorm,
    )

    targets = [*SWAP_TARGETS, "fused"]
    if to is not None and to not in targets:
        raise BadInputError(
            f"--to {to!r} is not a norm kind normswap can swap to; choose from {', '.join(targets)}"
        )
    if to == "groupnorm" and groups is None:
        raise BadInputError("--to groupnorm needs --groups N")
    if groups is not None and to != "groupnorm":
        raise BadInputError("--groups applies to --to groupnorm only")
    for kind in from_kinds or ():
        if kind not in NORM_KINDS:
            raise BadInputError(f"--from {kind!r}: choose from {', '.join(NORM_KINDS)}")
    if from_kinds and to is None:
        raise BadInputError("--from picks which norms --to replaces: give --to KIND")
    if fuse_add and to != "fused":
        raise BadInputError("--fuse-add fuses residual adds into fused norms: give --to fused")
    if fuse_inline and to != "fused":
        raise BadInputError("--fuse-inline fuses norms inside other forwards: give --to fused")
    passes: list[Any] = []
    # plain weights first, so the folds see and rewrite real parameters
    if remove_weight_norm:
        passes.append(RemoveWeightNorm())
    if fold_bn:
        passes.append(FoldBatchNorm())
    kinds = tuple(from_kinds) if from_kinds else None
    if to == "rmsnorm" and (kinds is None or "layer" in kinds):
        # exact where the residual stream can be recentered; the generic swap takes the rest
        passes.append(RecenterLayerNorm())
        if not exact:
            passes.append(SwapNorm(to, kinds))
    elif to == "fused":
        from normswap.passes.fuse_norm import FuseNorm

        passes.append(FuseNorm())
    elif to is not None:
        passes.append(SwapNorm(to, kinds, groups=groups))
    if fold_norm_affine:
        passes.append(FoldNormAffine())
    if add_weight_norm is not None:
        paths = (
            None if add_weight_norm == "all" else [p.strip() for p in add_weight_norm.split(",") if p.strip()]
        )
        dim: Any = None if weight_norm_dim == "none" else weight_norm_dim
        if isinstance(dim, str) and dim != "output":
            try:
                dim = int(dim)
            except ValueError:
                raise BadInputError(
                    f"--weight-norm-dim {weight_norm_dim!r}: give output, an int or none"
                ) from None
        passes.append(AddWeightNorm(targets=paths, dim=dim))
    # Graph rewrites come last: every module edit must be done on the user's module first. Norms are
    # fused before adds are fused into them.
    if fuse_inline:
        from normswap.passes.fuse_graph_norm import FuseGraphNorm

        passes.append(FuseGraphNorm())
    if fuse_add:
        from normswap.passes.fuse_add_norm import FuseAddNorm

        passes.append(FuseAddNorm())
    if not passes:
        raise BadInputError(
            "nothing to do: give --to KIND, --fold-bn, --fold-norm-affine, --add-weight-norm or "
            "--remove-weight-norm"
        )
    return passes


def _calibrate_swaps(
    original: Any,
    converted: Any,
    result: Any,
    data: str,
    max_batches: int | None,
    batch_size: int | None,
    args: tuple,
    kwargs: dict,
    quiet: bool = False,
) -> dict[str, Any]:
    """Fit the swapped norms to the original's outputs on DATA; print and return the figures."""
    import itertools

    from normswap.calibrate.affine_fit import calibrate_swapped_norms
    from normswap.validate.compare import compare_models

    sites = [c.site for p in result.passes if p.pass_name == "swap_norm" for c in p.changes]
    source, _ = _data_and_holdout(data, None, args, kwargs, batch_size, None)
    batches = list(itertools.islice(source, max_batches))
    with _progress(disable=quiet) as progress:
        task = progress.add_task("calibrating", total=len(sites))
        fitted = calibrate_swapped_norms(
            original, converted, sites, batches, on_site=lambda _s: progress.advance(task)
        )
    table = Table(title=f"Calibration on {fitted.batches} batches (site SQNR dB vs the original norm)")
    for column in ("site", "new norm", "before", "after", "note"):
        table.add_column(column, overflow="fold")
    for site in fitted.sites:
        note = site.note or ("statistics re-estimated" if site.statistics else "")
        if site.alpha is not None:
            note = f"alpha {site.alpha:.3g}"
        table.add_row(
            site.site,
            site.module_class,
            _fmt_float(site.sqnr_before_db),
            _fmt_float(site.sqnr_after_db),
            note,
        )
    out.print(table)
    out.print(
        f"calibration: whole model on the calibration data SQNR {_fmt_float(fitted.model_sqnr_before_db)} dB "
        f"-> {_fmt_float(fitted.model_sqnr_after_db)} dB"
    )
    overall = compare_models(original, converted, args, kwargs)
    out.print(
        f"after calibration, whole model vs original on the example inputs: SQNR {_fmt_float(overall.worst_sqnr_db)} dB"
    )
    return {"calibration": fitted.to_dict(), "overall_after_calibration": overall.to_dict()}


def _not_exact_under_flag(result: Any, to: str | None) -> str | None:
    """Under --exact, a norm that --to asked for but that has no exact rewrite fails the command."""
    skipped = [s for p in result.passes if p.pass_name == "recenter_layernorm" for s in p.skips]
    if to == "rmsnorm" and skipped:
        first = skipped[0]
        return (
            f"--exact: {len(skipped)} LayerNorm(s) cannot become RMSNorm exactly "
            f"({first.site}: {first.reason}); nothing written"
        )
    return None


def _by_reason(skips: list[Any]) -> dict[str, list[str]]:
    """The skipped sites under each reason, in order of first appearance."""
    grouped: dict[str, list[str]] = {}
    for skip in skips:
        grouped.setdefault(skip.reason, []).append(skip.site)
    return grouped


def _site_list(sites: list[str], shown: int = 3) -> str:
    if len(sites) <= shown:
        return ", ".join(sites)
    return f"{len(sites)} sites: {', '.join(sites[: shown - 1])}, ..., {sites[-1]}"


def _lossy_without_consent(result: Any, to: str | None) -> str | None:
    """--to rmsnorm: the LayerNorms that the exact route (recentering) skipped for a failure, a missing
    graph or a form normswap does not handle, and that the architectural swap then changed. Their lossy
    result needs --allow-lossy; a post-LN LayerNorm (skipped for the architecture) has no exact route."""
    from normswap.passes.recenter_layernorm import lossy_after_failure

    lossy = lossy_after_failure(result.passes) if to == "rmsnorm" else []
    if not lossy:
        return None
    reasons = list(dict.fromkeys(skip.reason for skip in lossy))
    why = reasons[0] if len(reasons) == 1 else f"{reasons[0]}; and {len(reasons) - 1} other reason(s)"
    swap = next((p for p in result.passes if p.pass_name == "swap_norm"), None)
    figures = swap.validation if swap is not None and swap.validation else {}
    sqnr = (
        f" (whole model SQNR {_fmt_float(figures['worst_sqnr_db'])} dB)"
        if figures.get("worst_sqnr_db") is not None
        else ""
    )
    return (
        f"--to rmsnorm: the exact route failed for {len(lossy)} LayerNorm(s), not because of the model's "
        f"architecture: {why}. Only the lossy swap changed them{sqnr}: fix the cause, or pass --allow-lossy "
        "to accept the lossy swap; nothing written"
    )


def _print_pipeline(result: Any) -> None:
    from normswap.validate.variants import format_shapes

    table = Table(title="Changes", show_lines=False)
    for column in ("pass", "site", "kind", "what"):
        table.add_column(column, overflow="fold")
    # one row per pass and reason: a cause shared by many sites (no graph captured) is said once; the
    # JSON report keeps every site
    skips = Table(title="Skipped", show_lines=False)
    for column in ("pass", "sites", "reason"):
        skips.add_column(column, overflow="fold")
    for p in result.passes:
        for c in p.changes:
            what = c.description
            if "site_sqnr_db" in c.details:
                what += f" (site SQNR {_fmt_float(c.details['site_sqnr_db'])} dB)"
            table.add_row(p.pass_name, c.site, c.kind.value, what)
        for reason, sites in _by_reason(p.skips).items():
            skips.add_row(p.pass_name, _site_list(sites), escape(reason))
    out.print(table)
    if skips.row_count:
        out.print(skips)
    for p in result.passes:
        if p.validation is None:
            note = "no change" if not p.changes else "not validated (no example inputs)"
            out.print(f"{p.pass_name}: {len(p.changes)} changed, {len(p.skips)} skipped; {note}")
            continue
        # a model that returns no tensor compares nothing: no worst output, and never a PASS
        worst = max(p.validation["outputs"], key=lambda o: o["max_rel"], default=None)
        if p.kind.value == "exact":
            half = p.validation.get("half_precision")
            failed = p.validation.get("failed_inputs", [])
            passed = (half["within_rounding"] if half else p.validation["within_tolerance"]) and not failed
            verdict = "[green]PASS[/]" if passed else "[bold red]FAIL[/]"
            figures = (
                f"max abs {_fmt_float(worst['max_abs'])} = {_fmt_float(worst['max_rel'])} x max|ref| "
                f"(tolerance {worst['tolerance']:g})"
                if worst is not None
                else "the model returns no tensor to compare"
            )
            out.print(
                f"{p.pass_name} (exact): {len(p.changes)} changed, {len(p.skips)} skipped; {figures} {verdict}",
                soft_wrap=True,
            )
            if half:
                out.print(
                    f"  judged against the model in fp32: {_fmt_float(half['rewritten_rel_error'])} x max|ref| "
                    f"vs the original's own {_fmt_float(half['original_rel_error'])} (allowed: twice that)"
                )

            verified = p.validation.get("verified_inputs", [])
            if verified:
                out.print(
                    f"  verified on {len(verified)} input shape{'s' if len(verified) != 1 else ''}: "
                    + ", ".join(format_shapes(v["shapes"]) for v in verified),
                    soft_wrap=True,
                )
            for f in failed:
                what = f.get("error") or (
                    f"{_fmt_float(f['worst_rel'])} x max|ref|" if f.get("compared") else "no tensor compared"
                )
                out.print(
                    f"  [bold red]FAIL[/] on {format_shapes(f['shapes'])} ({f['label']}): {what}",
                    soft_wrap=True,
                )
            for limitation in p.validation.get("limitations", []):
                out.print(f"  limited: {limitation}", soft_wrap=True)
        elif worst is None:
            out.print(
                f"{p.pass_name} ({p.kind.value}): {len(p.changes)} changed, {len(p.skips)} skipped; "
                "the model returns no floating-point output to compare"
            )
        else:
            out.print(
                f"{p.pass_name} ({p.kind.value}): {len(p.changes)} changed, {len(p.skips)} skipped; "
                f"SQNR {_fmt_float(p.validation['worst_sqnr_db'])} dB, cosine {_fmt_float(worst['cosine'], 6)}, "
                f"max abs {_fmt_float(worst['max_abs'])}"
            )
    if result.overall is not None and not result.overall.outputs:
        out.print("whole model vs original: the model returns no tensor to compare")
    elif result.overall is not None:
        out.print(
            f"whole model vs original: SQNR {_fmt_float(result.overall.worst_sqnr_db)} dB, "
            f"max abs / max|ref| {_fmt_float(result.overall.worst_rel)}"
        )


@app.command()
@_handles_errors
def export(
    model: ModelArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="The .onnx file to write.")],
    opset: OpsetOpt = None,
    dynamic_batch: Annotated[
        bool, _flag("--dynamic-batch", help="Make dim 0 of every input a dynamic batch dim.")
    ] = False,
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
) -> None:
    """Export MODEL to ONNX and check the file in onnxruntime against PyTorch before writing it."""
    from normswap.errors import BadInputError
    from normswap.load import check_writable, require_inputs

    _check_paths(
        {"MODEL": model, "--weights": weights, "--inputs": inputs}, {"-o": output, "--report": report}
    )
    if output.suffix.lower() != ".onnx":
        raise BadInputError(f"-o {output}: an ONNX export is written to a .onnx file")
    loaded = _load(model, weights, trust_pickle)
    check_writable(loaded.model, output, None)  # the ONNX packages, before the model is run
    args, kwargs = require_inputs(loaded, inputs_file=inputs, input_shapes=input_shape)
    _check_inputs_fit(loaded.model, args, kwargs)
    source = Path(model) if Path(model).exists() else None
    checked = _export_checked(
        loaded.model, output, args, kwargs, opset, dynamic_batch, source, quiet=report is not None
    )
    if report is not None:
        _write_json(report, {"model": model, "output": str(output), "written": True, "onnx": checked})


def _export_checked(
    model: Any,
    output: Path,
    args: tuple,
    kwargs: dict,
    opset: int | None,
    dynamic_batch: bool,
    source: Any,
    quiet: bool = False,
) -> dict[str, Any]:
    """Export to ONNX, check in onnxruntime, print the figures; returns them for the JSON report."""

    from normswap.export.onnx import export_onnx, onnx_tolerance
    from normswap.graph.capture import capture_friendly

    with (
        contextlib.redirect_stdout(sys.stderr) if not err.is_terminal else contextlib.nullcontext(),
        _status(f"exporting {output} to ONNX and checking it in onnxruntime", quiet),
        # the ONNX exporter captures with torch.export, and PyTorch's side of the check runs the same way
        capture_friendly(model, args, kwargs) as notes,
    ):
        # torch.onnx prints progress lines to stdout; keep stdout for normswap's own report
        result = export_onnx(
            model, output, args, kwargs, opset=opset, dynamic_batch=dynamic_batch, refuse_path=source
        )
    ops = ", ".join(f"{name} {count}" for name, count in result.op_counts.items())
    out.print(f"ONNX opset {result.opset}: {sum(result.op_counts.values())} nodes ({ops})")
    worst = max(result.outputs, key=lambda o: o.max_rel)
    sizes = " and ".join(str(b) for b in result.checked_batch_sizes)
    tol = onnx_tolerance(worst.dtype)
    out.print(
        f"onnxruntime vs PyTorch on batch size {sizes}: max abs {_fmt_float(worst.max_abs)} = "
        f"{_fmt_float(worst.max_rel)} x max|ref| (tolerance {tol:g}) [green]PASS[/]"
    )
    out.print(f"wrote {output} (onnx)")
    _print_capture_notes(notes, f"{output} exported", _NO_CACHE)
    return {**result.to_dict(), "capture_notes": notes}


@app.command()
@_handles_errors
def validate(
    original: Annotated[
        str, typer.Argument(help="The reference model (same forms as MODEL).", show_default=False)
    ],
    converted: Annotated[str, typer.Argument(help="The model to check against it.", show_default=False)],
    exact: Annotated[
        bool, _flag("--exact", help="Fail (exit 1) unless every output is within the exact tolerance.")
    ] = False,
    min_sqnr: Annotated[
        float | None,
        typer.Option(
            "--min-sqnr",
            help="Fail (exit 1) if an output's SQNR is below this many dB; also the "
            "per-layer threshold for the first divergent layer [40].",
        ),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of the per-layer SQNR, norm sites marked.")
    ] = None,
    data: Annotated[
        str | None, typer.Option("--data", help="Compare on the batches of DATA. " + DATA_SHORT_HELP)
    ] = None,
    batches: Annotated[
        int | None, typer.Option("--batches", min=1, help="Use the first N batches of --data.")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="Batch size for an image folder or a single tensor [32]."),
    ] = None,
    weights: WeightsOpt = None,
    converted_weights: Annotated[
        Path | None, typer.Option("--converted-weights", help="Weights for a factory CONVERTED model.")
    ] = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
) -> None:
    """Compare CONVERTED with ORIGINAL on the same inputs: per output, per layer, per norm site."""
    import itertools

    from normswap.errors import BadInputError, CheckFailedError
    from normswap.validate.layerwise import DEFAULT_MIN_SQNR_DB, plot_norm_sites, validate_models

    _check_paths(
        {
            "ORIGINAL": original,
            "CONVERTED": converted,
            "--weights": weights,
            "--converted-weights": converted_weights,
            "--inputs": inputs,
            "--data": data,
        },
        {"--plot": plot, "--report": report},
    )
    if exact and min_sqnr is not None:
        raise BadInputError("--exact and --min-sqnr are two different checks: give one")
    if plot is not None and plot.suffix.lower() != ".png":
        raise BadInputError(f"--plot {plot}: the plot is a PNG file")
    reference = _load(original, weights, trust_pickle)
    candidate = _load(converted, converted_weights, trust_pickle)
    if data is not None:
        from normswap.load import resolve_inputs

        resolved = resolve_inputs(reference, inputs_file=inputs, input_shapes=input_shape)
        args, kwargs = resolved if resolved is not None else (None, None)
        source, _ = _data_and_holdout(data, None, args, kwargs, batch_size, None)
        pairs = [(b.args, b.kwargs) for b in itertools.islice(source, batches)]
        if not pairs:
            raise BadInputError(f"--data {data} yields no batch")
    else:
        from normswap.load import require_inputs

        pairs = [require_inputs(reference, inputs_file=inputs, input_shapes=input_shape)]
    with _status("finding the norm sites of ORIGINAL", quiet=report is not None):
        norm_paths = _norm_paths(reference.model, pairs[0])
    with _progress(disable=len(pairs) < 4 or report is not None) as bar:
        task = bar.add_task("comparing", total=len(pairs))
        try:
            result = validate_models(
                reference.model,
                candidate.model,
                pairs,
                exact=exact,
                min_sqnr_db=DEFAULT_MIN_SQNR_DB if min_sqnr is None else min_sqnr,
                norm_paths=norm_paths,
                on_batch=lambda _i: bar.advance(task),
            )
        except ValueError as exc:
            raise BadInputError(f"cannot compare: {exc}") from None
    _print_validation(result)
    if plot is not None:
        from normswap.load import atomic_write

        try:
            atomic_write(
                plot, lambda tmp: plot_norm_sites(result, str(tmp), title=f"{converted} vs {original}")
            )
        except ImportError:
            raise BadInputError("--plot needs matplotlib: pip install 'normswap[plot]'") from None
        out.print(f"wrote {plot}")
    if report is not None:
        _write_json(report, {"original": original, "converted": converted, **result.to_dict()})
    if (exact or min_sqnr is not None) and not result.passed:
        what = "exact tolerance" if exact else f"{min_sqnr:g} dB"
        where = f"; first divergent layer: {result.first_divergent}" if result.first_divergent else ""
        raise CheckFailedError(f"outputs are not within the {what}{where}")


def _norm_paths(model: Any, pair: tuple) -> list[str]:
    from normswap.discover import find_norms

    inventory = find_norms(model, *pair)
    return [site.path for site in inventory if site.is_module]


def _print_validation(result: Any) -> None:
    table = Table(title=f"Outputs ({result.batches} batch{'es' if result.batches != 1 else ''})")
    for column in ("output", "shape", "max abs", "max rel", "SQNR dB", "cosine", "top-1", "top-5"):
        table.add_column(column, overflow="fold")
    for figures in result.outputs:
        o = figures.comparison
        table.add_row(
            o.name,
            "x".join(map(str, o.shape)),
            _fmt_float(o.max_abs),
            _fmt_float(o.max_rel),
            _fmt_float(o.sqnr_db),
            _fmt_float(o.cosine, 6),
            "" if o.top1_agreement is None else f"{o.top1_agreement:.1%}",
            "" if figures.top5_agreement is None else f"{figures.top5_agreement:.1%}",
        )
    out.print(table)
    norms = Table(title="Norm sites, in execution order (SQNR of each site's output vs the original)")
    for column in ("site", "original", "converted", "SQNR dB", "max rel"):
        norms.add_column(column, overflow="fold")
    for layer in result.norm_sites:
        norms.add_row(
            layer.path,
            layer.original_class,
            layer.converted_class,
            _fmt_float(layer.sqnr_db),
            _fmt_float(layer.max_rel),
        )
    if norms.row_count:
        out.print(norms)
    rule = "the exact tolerance" if result.exact else f"{result.min_sqnr_db:g} dB"
    if result.first_divergent is None:
        out.print(f"{result.shared_modules} shared modules compared; none diverges past {rule}")
    else:
        layer = next(x for x in result.layers if x.path == result.first_divergent)
        out.print(
            f"{result.shared_modules} shared modules compared; first divergent past {rule}: "
            f"{layer.path} ({layer.original_class} -> {layer.converted_class}, SQNR {_fmt_float(layer.sqnr_db)} dB)"
        )
    verdict = "[green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
    out.print(
        f"verdict ({'exact tolerance' if result.exact else f'min SQNR {result.min_sqnr_db:g} dB'}): {verdict}"
    )


DATA_HELP = (
    "Calibration data: a folder of images (resized and centre-cropped to the model's input H x W, scaled "
    "to [0, 1]), a .pt file holding a tensor (N, ...), a list of batch tensors or a list of batches, or a "
    "factory 'package.module:callable' / 'file.py:callable' returning an iterable of batches (a factory is "
    "code that normswap imports and runs)."
)


@app.command()
@_handles_errors
def recalibrate(
    model: ModelArg,
    data: Annotated[str, typer.Option("--data", help=DATA_HELP, show_default=False)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output file: .pt2, .pt or .onnx.")],
    batches: Annotated[
        int | None,
        typer.Option(
            "--batches",
            min=1,
            help="Calibrate on the first N batches (the next one is held out unless --holdout is given).",
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="Batch size for an image folder or a single tensor [32]."),
    ] = None,
    normalize: Annotated[
        str | None, typer.Option("--normalize", help="Normalize images with a dataset's mean/std: imagenet.")
    ] = None,
    holdout: Annotated[
        str | None,
        typer.Option(
            "--holdout",
            help="Compare outputs before/after on the first batch of this data (same forms as --data) "
            "instead of holding out the last batch of --data.",
        ),
    ] = None,
    weights: WeightsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
) -> None:
    """Re-estimate MODEL's BatchNorm statistics as averages over the batches of DATA; write it to -o."""
    from normswap.calibrate import recalibrate_batchnorm
    from normswap.errors import BadInputError, CheckFailedError
    from normswap.load import SAVE_FORMATS, resolve_inputs

    _check_paths(
        {"MODEL": model, "--data": data, "--holdout": holdout, "--weights": weights, "--inputs": inputs},
        {"-o": output, "--report": report},
    )
    if output.suffix not in SAVE_FORMATS:
        raise BadInputError(f"-o {output}: unknown output format; use one of {', '.join(SAVE_FORMATS)}")
    loaded = _load(model, weights, trust_pickle)
    resolved = resolve_inputs(loaded, inputs_file=inputs, input_shapes=input_shape)
    args, kwargs = resolved if resolved is not None else (None, None)
    if resolved is not None:
        _check_inputs_fit(loaded.model, args, kwargs)
    _check_output_before_work(loaded.model, output, args, kwargs, quiet=report is not None)
    calibration, held_out = _data_and_holdout(data, holdout, args, kwargs, batch_size, normalize)
    with _progress(disable=report is not None) as progress:
        task = progress.add_task("calibrating", total=None)
        recalibrated, result = recalibrate_batchnorm(
            loaded.model,
            calibration,
            holdout=held_out,
            max_batches=batches,
            inplace=True,
            on_batch=lambda done, total: progress.update(task, completed=done, total=total),
        )
    notes = calibration.notes + result.notes
    out.print(calibration.description, soft_wrap=True)
    _print_recalibration(result, notes)

    written = False
    if result.ok:
        _save_trained(recalibrated, output, args, kwargs, calibration, resolved is not None, model)
        written = True
    if report is not None:
        _write_json(
            report,
            {
                "model": model,
                "data": data,
                "data_description": calibration.description,
                "output": str(output),
                "written": written,
                **result.to_dict(),
                "notes": notes,
            },
        )
    if not result.ok:
        bad = ", ".join(result.non_finite_layers) or "the held-out outputs"
        raise CheckFailedError(f"recalibration produced non-finite values in {bad}; nothing written")


def _print_recalibration(result: Any, notes: list[str]) -> None:
    table = Table(title="BatchNorm statistics, new vs old", show_lines=False)
    for column in ("layer", "class", "channels", "mean shift (σ)", "var ratio"):
        table.add_column(column, overflow="fold")
    for layer in result.layers:
        table.add_row(
            layer.path,
            layer.class_name,
            str(layer.num_features),
            _fmt_float(layer.mean_shift),
            f"{_fmt_float(layer.var_ratio_min)}..{_fmt_float(layer.var_ratio_max)}",
        )
    out.print(table)
    if result.skips:
        skips = Table(title="Skipped", show_lines=False)
        for column in ("site", "reason"):
            skips.add_column(column, overflow="fold")
        for skip in result.skips:
            skips.add_row(skip.site, skip.reason)
        out.print(skips)
    for note in notes:
        out.print(f"note: {note}", soft_wrap=True)
    out.print(
        f"recalibrate_batchnorm ({result.kind.value}): {len(result.layers)} BatchNorm layers re-estimated "
        f"on {result.batches} batches ({result.samples} samples), {len(result.skips)} skipped",
        soft_wrap=True,
    )
    if result.holdout is None:
        out.print("held-out batch: none, no comparison")
        return
    worst = min(result.holdout.outputs, key=lambda o: o.sqnr_db, default=None)
    if worst is None:
        out.print("held-out batch: the model returns no floating-point output to compare")
        return
    top1 = f", top-1 agreement {worst.top1_agreement:.1%}" if worst.top1_agreement is not None else ""
    out.print(
        f"held-out batch ({result.holdout_samples} samples, {result.holdout_source}), outputs after vs "
        f"before: SQNR {_fmt_float(worst.sqnr_db)} dB, cosine {_fmt_float(worst.cosine, 6)}, max abs "
        f"{_fmt_float(worst.max_abs)} ({_fmt_float(worst.max_rel)} x max|before|){top1}",
        soft_wrap=True,
    )


@app.command()
@_handles_errors
def distill(
    original: Annotated[
        str,
        typer.Argument(help="The model to match, the teacher (same forms as MODEL).", show_default=False),
    ],
    converted: Annotated[
        str,
        typer.Argument(
            help="The model to fine-tune, the student: e.g. convert's output (.pt2, or .pt with "
            "--trust-pickle).",
            show_default=False,
        ),
    ],
    data: Annotated[str, typer.Option("--data", help=DATA_HELP, show_default=False)],
    steps: Annotated[
        int,
        typer.Option("--steps", help="Optimizer steps; the training batches are cycled.", show_default=False),
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output file: .pt2, .pt or .onnx.")],
    lr: Annotated[
        float, typer.Option("--lr", help="AdamW learning rate (constant, no weight decay).")
    ] = 1e-4,
    loss: Annotated[
        str,
        typer.Option(
            "--loss",
            help="mse: mean squared error on the outputs; kl: KL divergence of the softmax over the last "
            "dim (classifier or LM logits). An HF output's logits are used alone.",
        ),
    ] = "mse",
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Softmax temperature of --loss kl [1].")
    ] = None,
    train: Annotated[
        str,
        typer.Option(
            "--train", help="all: every floating-point parameter; norms: only the norms' parameters."
        ),
    ] = "all",
    holdout: Annotated[
        str | None,
        typer.Option(
            "--holdout",
            help="Measure before/after on the first batch of this data (same forms as --data) instead of "
            "holding out the last batch of --data.",
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="Batch size for an image folder or a single tensor [32]."),
    ] = None,
    normalize: Annotated[
        str | None, typer.Option("--normalize", help="Normalize images with a dataset's mean/std: imagenet.")
    ] = None,
    weights: WeightsOpt = None,
    converted_weights: Annotated[
        Path | None, typer.Option("--converted-weights", help="Weights for a factory CONVERTED model.")
    ] = None,
    trust_pickle: TrustPickleOpt = False,
    inputs: InputsOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
) -> None:
    """Fine-tune CONVERTED for a few steps so its outputs match ORIGINAL's on DATA; write it to -o."""
    from normswap.calibrate.distill import check_options
    from normswap.calibrate.distill import distill as distill_model
    from normswap.errors import BadInputError, CheckFailedError
    from normswap.load import SAVE_FORMATS, resolve_inputs

    _check_paths(
        {
            "ORIGINAL": original,
            "CONVERTED": converted,
            "--data": data,
            "--holdout": holdout,
            "--weights": weights,
            "--converted-weights": converted_weights,
            "--inputs": inputs,
        },
        {"-o": output, "--report": report},
    )
    if output.suffix not in SAVE_FORMATS:
        raise BadInputError(f"-o {output}: unknown output format; use one of {', '.join(SAVE_FORMATS)}")
    if temperature is not None and loss != "kl":
        raise BadInputError("--temperature applies to --loss kl")
    check_options(steps=steps, lr=lr, loss=loss, temperature=temperature or 1.0, train=train)
    teacher = _load(original, weights, trust_pickle)
    student = _load(converted, converted_weights, trust_pickle)
    resolved = resolve_inputs(teacher, inputs_file=inputs, input_shapes=input_shape) or resolve_inputs(
        student
    )
    args, kwargs = resolved if resolved is not None else (None, None)
    if resolved is not None:
        # before training: minutes of training must not end in a refusal
        _check_inputs_fit(teacher.model, args, kwargs, what="ORIGINAL")
        _check_inputs_fit(student.model, args, kwargs, what="CONVERTED")
    _check_output_before_work(student.model, output, args, kwargs, quiet=report is not None)
    batches, held_out = _data_and_holdout(data, holdout, args, kwargs, batch_size, normalize)
    with _progress(disable=report is not None) as progress:
        task = progress.add_task("distilling", total=steps)
        distilled, result = distill_model(
            teacher.model,
            student.model,
            batches,
            steps=steps,
            lr=lr,
            loss=loss,
            temperature=temperature if temperature is not None else 1.0,
            train=train,
            holdout=held_out,
            inplace=True,
            on_step=lambda done, _total, value: progress.update(
                task, completed=done, description=f"distilling (loss {value:.4g})"
            ),
            example_args=args,
            example_kwargs=kwargs,
        )
    notes = batches.notes + result.notes
    out.print(batches.description, soft_wrap=True)
    _print_distillation(result, notes)

    written = False
    if result.ok:
        _save_trained(distilled, output, args, kwargs, batches, resolved is not None, converted)
        written = True
    if report is not None:
        _write_json(
            report,
            {
                "original": original,
                "converted": converted,
                "data": data,
                "data_description": batches.description,
                "output": str(output),
                "written": written,
                **result.to_dict(),
                "notes": notes,
            },
        )
    if not result.ok:
        raise CheckFailedError(
            "distillation produced non-finite values (loss or held-out outputs); nothing written"
        )


def _print_distillation(result: Any, notes: list[str]) -> None:
    for note in notes:
        out.print(f"note: {note}", soft_wrap=True)
    what = f"{result.loss}" + (f" at T={result.temperature:g}" if result.temperature is not None else "")
    trained = (
        (f"{len(result.trained_modules)} norm modules, " if result.train == "norms" else "")
        + f"{result.trained_tensors} tensors, {result.trained_elements:,} of {result.total_elements:,} parameters"
    )
    out.print(
        f"distill ({result.kind.value}): {result.steps_done} AdamW steps, lr {result.lr:g}, {what} loss on "
        f"{', '.join(result.loss_outputs)}; {result.batches} training batches ({result.samples} samples); "
        f"trained {trained}; {result.seconds:.1f} s",
        soft_wrap=True,
    )
    out.print(
        f"training loss: first {_fmt_float(result.loss_first)}, last {_fmt_float(result.loss_last)}, "
        f"min {_fmt_float(result.loss_min)}",
        soft_wrap=True,
    )
    if result.before is None or result.after is None:
        out.print("held-out batch: none, no comparison")
        return
    table = Table(
        title=f"Held-out batch ({result.holdout_samples} samples, {result.holdout_source}): converted vs "
        "original, before -> after"
    )
    for column in ("output", "SQNR dB", "cosine", "max abs", "top-1"):
        table.add_column(column, overflow="fold")
    others = 0
    for before, after in zip(result.before.outputs, result.after.outputs, strict=True):
        if before.name not in result.loss_outputs:
            others += 1  # an HF model's caches and hidden states: not what was distilled
            continue
        top1 = (
            f"{before.top1_agreement:.1%} -> {after.top1_agreement:.1%}"
            if before.top1_agreement is not None and after.top1_agreement is not None
            else ""
        )
        table.add_row(
            before.name,
            f"{_fmt_float(before.sqnr_db)} -> {_fmt_float(after.sqnr_db)}",
            f"{_fmt_float(before.cosine, 4)} -> {_fmt_float(after.cosine, 4)}",
            f"{_fmt_float(before.max_abs)} -> {_fmt_float(after.max_abs)}",
            top1,
        )
    out.print(table)
    if others:
        out.print(f"{others} other outputs, not in the loss, are compared in --report", soft_wrap=True)
    out.print(
        f"held-out {result.loss} loss {_fmt_float(result.holdout_loss_before)} -> "
        f"{_fmt_float(result.holdout_loss_after)}; SQNR {_fmt_float(result.sqnr_before_db)} dB -> "
        f"{_fmt_float(result.sqnr_after_db)} dB",
        soft_wrap=True,
    )


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
