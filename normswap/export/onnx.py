"""ONNX export that proves itself: export with torch.onnx (dynamo), run the file in onnxruntime, compare.

The file is written to a temporary path, loaded in onnxruntime and run on the example inputs; only if
its outputs agree with PyTorch's (tolerance by dtype: :func:`normswap.util.tolerance.onnx_tolerance`) is
it moved to the destination. A large model's weights go to an external data file ``OUT.onnx.data``
(:mod:`normswap.load.onnx_file`), checked with the .onnx from the path and published with it. normswap's fused-norm ops become standard ops through
:mod:`normswap.kernels.onnx_translation`.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.errors import BadInputError, CheckFailedError, shorten
from normswap.export.onnx_names import name_axes, output_names, varied_dims
from normswap.export.onnx_opset import EXPORTER_OPSET, convert_down
from normswap.export.onnx_ort import fuse_for_onnxruntime
from normswap.graph.capture import capture_friendly, export_program
from normswap.load.onnx_file import data_file, save_program
from normswap.load.paths import check_output, check_paths
from normswap.load.save import atomic_write_onnx
from normswap.util.modes import modes_restored
from normswap.util.shapes import format_shapes, input_shapes
from normswap.util.tolerance import onnx_tolerance
from normswap.verify.metrics import TensorComparison, compare_tensors
from normswap.verify.variants import InputVariant
from normswap.verify.written import WrittenShapes, refuse_untaken, shapes_taken

# "standard": ONNX's own ops only; "onnxruntime": norms as ONNX Runtime's fused ops where it has them
TARGETS = ("standard", "onnxruntime")


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise BadInputError(f"--target must be {' or '.join(TARGETS)}, got {target!r}")


@dataclass
class OnnxExport:
    path: str
    opset: int
    op_counts: dict[str, int] = field(default_factory=dict)
    # every floating output, compared with PyTorch's at each shape the file was checked on
    outputs: list[TensorComparison] = field(default_factory=list)
    # the axes a runtime may size freely, by input: {"input_ids": {0: "batch", 1: "sequence"}}
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)
    # the shapes it was checked on in onnxruntime, and those it rejects (a dim fixed in the file)
    shapes: WrittenShapes = field(default_factory=WrittenShapes)
    note: str = ""
    # why the file is fixed at the example's shapes, when the export with free dims failed
    fallbacks: list[str] = field(default_factory=list)
    target: str = "standard"
    # the external data file beside the .onnx (its name), when the weights are too large to sit inside
    external_data: str | None = None
    # --target onnxruntime: {"fused": {op type: count}, "left": [why a norm site kept standard ops]}
    onnxruntime_fusion: dict[str, Any] = field(default_factory=dict)

    @property
    def within_tolerance(self) -> bool:
        return bool(self.outputs) and all(_agrees(o) for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shapes"] = self.shapes.to_dict()
        data["within_tolerance"] = self.within_tolerance
        return data


def _failing_op(message: str) -> str:
    """The op the exporter could not translate, from its message ("No ONNX function found for ...")."""
    found = re.search(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)", message)
    if found:
        return f"{found.group(1)}.{found.group(2)}"
    found = re.search(r"target=(?:torch\.ops\.)?([\w]+\.[\w]+(?:\.[\w]+)?)", message)
    return found.group(1) if found else ""


# The exporter's report ends with what went wrong while it translated a node:
# "## Exception summary\n\n<class 'ValueError'>: Cannot view a tensor with shape ..."
_EXCEPTION_SUMMARY = re.compile(r"## Exception summary\s*<class '(?:[\w]+\.)*(\w+)'>: ([^\n]+)")


def _describe(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # the exporter colours its messages
    first = text.splitlines()[0][:300] if text else ""
    op = _failing_op(text)
    if not op:
        return f"{type(exc).__name__}: {first}"
    summary = _EXCEPTION_SUMMARY.search(text)
    if summary and "No ONNX function found" not in summary.group(2):
        # the op has a translation; running it failed (a torch.onnx limitation, not a missing op)
        return f"translating op {op} failed ({summary.group(1)}: {shorten(summary.group(2).strip(), 200)})"
    return f"no ONNX translation for op {op} ({type(exc).__name__})"


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _read_back(path: Path) -> tuple[int, dict[str, int]]:
    """Default-domain opset and op counts of the file as written (the exporter may convert on save)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    counts = Counter(node.op_type for node in proto.graph.node)
    for function in proto.functions:  # ops inside local functions count too
        counts.update(node.op_type for node in function.node)
    return int(opset), dict(sorted(counts.items()))


def _ort_run(path: Path) -> Callable[[tuple, dict], list[torch.Tensor]]:
    """The file at ``path`` in one onnxruntime session, as a call on torch inputs."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(args: tuple, kwargs: dict) -> list[torch.Tensor]:
        leaves = _tensor_leaves((args, kwargs))
        if len(leaves) != len(names):
            raise BadInputError(
                f"the .onnx graph takes {len(names)} inputs ({', '.join(names)}) but the example inputs "
                f"hold {len(leaves)} tensors"
            )
        feeds = {name: leaf.detach().cpu().numpy() for name, leaf in zip(names, leaves, strict=True)}
        return [torch.from_numpy(o) for o in session.run(None, feeds)]

    return run


def run_onnx(path: Path, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Run an .onnx file in onnxruntime (CPU) on torch inputs; outputs as torch tensors."""
    return _ort_run(path)(args, kwargs)


def _padding(kwargs: dict) -> torch.Tensor | None:
    """The padding positions of a padded batch of sentences (True where HF's ``attention_mask`` is 0),
    None when the inputs have none."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.is_floating_point():
        return None
    padding = mask == 0
    return padding if bool(padding.any()) and bool(((mask == 0) | (mask == 1)).all()) else None


def _compare(expected: Any, got: list[torch.Tensor], at: str, kwargs: dict) -> list[TensorComparison]:
    """onnxruntime's outputs against PyTorch's (``expected``, the model's output) at the shape ``at``.

    An output per token of a padded batch (logits, hidden states: (batch, tokens, ...)) is compared at
    the tokens alone: at a padding position of a left-padded batch, causal attention sees no token at
    all, and what it returns there (a mean over masked keys in PyTorch, another value in onnxruntime)
    is read by nothing. Every other position and output is compared."""
    reference = _tensor_leaves(expected)
    if len(got) != len(reference):
        raise CheckFailedError(f"onnxruntime returned {len(got)} outputs, PyTorch {len(reference)}")
    padding = _padding(kwargs)
    compared = []
    # every output: integer and bool ones (argmax, ids, masks) must be equal, as in every comparison
    for i, (ref, out) in enumerate(zip(reference, got, strict=True)):
        name = f"output[{i}] at {at}"
        if (
            padding is not None
            and tuple(ref.shape[:2]) == tuple(padding.shape)
            and tuple(out.shape) == tuple(ref.shape)
        ):
            tokens = ~padding.to(ref.device)
            ref, out = ref[tokens], out.to(ref.device)[tokens]
            name += f" (its {int(padding.sum())} padding positions left out)"
        compared.append(compare_tensors(name, ref, out.to(ref.dtype)))
    return compared


def _agrees(output: TensorComparison) -> bool:
    """An output of the file agrees with PyTorch's: within onnxruntime's tolerance for its dtype, or equal
    for an integer or bool output."""
    dtype = getattr(torch, output.dtype, None)
    if isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex):
        return output.within_tolerance
    return output.max_rel <= onnx_tolerance(output.dtype)


def _checked(
    model: nn.Module, temp: Path, variants: list[InputVariant], result: OnnxExport, example_output: Any
) -> WrittenShapes:
    """Run the file in onnxruntime on each of ``variants`` (the example first, whose model output
    ``example_output`` is already known) and compare every output with the model's: a shape the file
    rejects is recorded (a dim fixed in the file), one it runs must agree within :func:`onnx_tolerance`
    or nothing is written."""
    known = [example_output]  # taken by the first variant, the example: not run twice
    try:
        run = _ort_run(temp)
    except Exception as exc:  # e.g. a dtype onnxruntime's CPU build has no kernel for (bf16)
        raise CheckFailedError(
            f"onnxruntime cannot load the exported file: {_describe(exc)}; nothing written"
        ) from None

    def run_and_compare(args: tuple, kwargs: dict) -> None:
        if known:
            expected = known.pop()
        else:
            with torch.no_grad():
                expected = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        at = format_shapes(input_shapes(args, kwargs))
        got = run(args, kwargs)  # raises on a shape the file does not take
        result.outputs += _compare(expected, got, at, kwargs)

    shapes = shapes_taken(run_and_compare, variants)
    if variants and shapes.rejected and shapes.rejected[0]["label"] == "example":
        raise CheckFailedError(
            f"onnxruntime cannot run the exported file: {shapes.rejected[0]['error']}; nothing written"
        )
    if not result.within_tolerance:
        failing = [o for o in result.outputs if not _agrees(o)]
        worst = max(failing, key=lambda o: o.max_rel, default=None)
        what = (
            "no output was compared"
            if worst is None
            else (f"{worst.name} max abs {worst.max_abs:.3g} ({worst.max_rel:.3g} x max|ref|)")
        )
        raise CheckFailedError(f"onnxruntime disagrees with PyTorch: {what}; nothing written")
    return shapes


def export_onnx(
    model: nn.Module,
    path: Path,
    example_args: tuple,
    example_kwargs: dict | None = None,
    *,
    opset: int | None = None,
    static_shapes: bool = False,
    check_shapes: list[InputVariant] | None = None,
    exact: bool = False,
    refuse_path: Path | None = None,
    target: str = "standard",
    overwrite: bool = False,
    external_data_bytes: int | None = None,
) -> OnnxExport:
    """Export ``model`` to ``path`` and check the file in onnxruntime; nothing is written if either fails.

    The file takes any batch and any sequence length the model leaves free (the same free dims as a
    saved ``.pt2``: :func:`normswap.graph.capture.export_program`), its axes named ``batch`` and
    ``sequence`` and its outputs after what the model returns (:mod:`.onnx_names`); ``static_shapes``
    fixes every dim at the example's. It is run in onnxruntime and compared with the model on every shape
    of ``check_shapes`` (default: the example alone; it must come first); a shape it rejects is
    recorded in :attr:`OnnxExport.shapes`, and with ``exact`` (unless ``static_shapes``) a rejected batch
    or length refuses the file.

    Raises :class:`BadInputError` when the export fails (naming the failing op when the exporter does)
    and :class:`CheckFailedError` when onnxruntime's outputs leave their tolerance (:func:`onnx_tolerance`).
    ``target="onnxruntime"`` writes the norms as ONNX Runtime's fused ops (:mod:`.onnx_ort`).
    Weights above ``external_data_bytes`` (default :data:`normswap.load.onnx_file.EXTERNAL_DATA_BYTES`)
    go to ``OUT.onnx.data`` beside the file. An existing ``path`` (or its data file) is refused unless
    ``overwrite``.
    """
    from normswap.kernels.onnx_translation import LAYER_NORMALIZATION_OPSET, translation_table

    path = Path(path)
    if path.suffix.lower() != ".onnx":
        raise BadInputError(f"-o {path}: an ONNX export is written to a .onnx file")
    check_paths({"the input model": refuse_path}, {"-o": path})  # never it, nor a folder that holds it
    check_output("-o", path, overwrite=overwrite)
    check_target(target)
    if opset is not None:
        from onnx.defs import onnx_opset_version

        if opset > onnx_opset_version():  # before the export, which fails with a traceback of its own
            raise BadInputError(
                f"--opset {opset}: the installed onnx knows opsets up to {onnx_opset_version()}; choose "
                f"--opset {onnx_opset_version()} or lower (or a newer onnx)"
            )
    args, kwargs = tuple(example_args), dict(example_kwargs or {})
    table = translation_table(opset) if opset is None or opset >= LAYER_NORMALIZATION_OPSET else None
    result = OnnxExport(path=str(path), opset=0, target=target)
    variants = check_shapes or [InputVariant("example", args, kwargs)]
    assert variants[0].label == "example", "the example is checked first (its output is reused)"

    # below the exporter's own opset: exported at it, converted down and repaired (export/onnx_opset.py)
    below = opset is not None and opset < EXPORTER_OPSET

    def write(temp: Path) -> None:
        with torch.no_grad():
            example_output = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        result.output_names = output_names(example_output)
        program = _onnx_program(
            model,
            args,
            kwargs,
            static_shapes,
            result.fallbacks,
            dict(
                opset_version=EXPORTER_OPSET if below else opset,
                custom_translation_table=table,
                output_names=result.output_names or None,
            ),
        )
        # temp is named as the output, inside a temp folder: the data file's name inside it is final
        if save_program(program, temp, external_data_bytes):
            result.external_data = data_file(path).name
        if below:
            assert opset is not None
            repaired = convert_down(temp, opset, external_data_bytes)
            if repaired:
                result.note = f"converted down from opset {EXPORTER_OPSET}; {repaired} Split nodes given their sizes as inputs"
        if target == "onnxruntime":  # after any conversion: onnx's converter knows no contrib op
            result.onnxruntime_fusion = asdict(fuse_for_onnxruntime(temp, external_data_bytes))
        # a dim the file leaves free is declared so only where a verified shape varies it
        example = _tensor_leaves((args, kwargs))
        varied = varied_dims(example, [_tensor_leaves((v.args, v.kwargs)) for v in variants])
        result.dynamic_axes = name_axes(temp, example, varied)
        result.opset, result.op_counts = _read_back(temp)
        if opset is not None and result.opset != opset:
            # torch.onnx falls back to the opset it built when converting down fails, with only a warning
            raise BadInputError(
                f"the exporter could not write opset {opset} (it produced opset {result.opset}); "
                f"choose --opset {result.opset} or higher"
            )
        result.shapes = _checked(model, temp, variants, result, example_output)
        if exact and not static_shapes:
            refuse_untaken(path, result.shapes, result.fallbacks)
        _declare_what_ran(temp, example, variants, varied, result)

    # exporting must not change the model; the names, the export and the check see the same settings
    with modes_restored(model, inference=True), capture_friendly(model, args, kwargs):
        atomic_write_onnx(path, write, overwrite=overwrite)
    return result


def _declare_what_ran(
    temp: Path, example: list[torch.Tensor], variants: list, varied: set[tuple[int, int]], result: OnnxExport
) -> None:
    """Declare free only the dims along which every verified shape ran: a dim only shapes the file
    rejected vary, or along which one verified size failed (timm's efficientnet_b0 took 8x8 and failed
    45x45: torch.export bounded the image size), is declared at the example's size, and the shapes the
    file took along it are then rejected too, with the reason (a runtime reads a free dim as any size)."""

    def leaves(v: Any) -> list[torch.Tensor]:
        return _tensor_leaves((v.args, v.kwargs))

    taken = [v for v in variants if v.describe() in result.shapes.accepted]
    failed = [v for v in variants if v.describe() not in result.shapes.accepted]
    free = varied_dims(example, [leaves(v) for v in taken]) - varied_dims(
        example, [leaves(v) for v in failed]
    )
    if free == varied:
        return
    result.dynamic_axes = name_axes(temp, example, free)
    for variant in taken:
        if not varied_dims(example, [leaves(variant)]) <= free:
            result.shapes.accepted.remove(variant.describe())
            result.shapes.rejected.append(
                {
                    "shapes": variant.describe(),
                    "label": variant.label,
                    "error": "declared at the example's size: a verified size along the same dims failed",
                }
            )


def _onnx_program(
    model: nn.Module, args: tuple, kwargs: dict, static_shapes: bool, fallbacks: list[str], options: dict
) -> Any:
    """torch.onnx's program of ``model``: exported by torch.export with the free dims of a saved program
    (or fixed, ``static_shapes``), then translated. Each step that cannot keep the dims free falls back
    to the example's shapes and says why in ``fallbacks``: the export (then torch.onnx's own capture),
    or the translation of a symbolic shape (T5's attention views a transposed tensor with strides that
    torch.onnx cannot reshape symbolically)."""
    try:
        exported = export_program(
            model, args, kwargs, dynamic=not static_shapes, grow_unit_dims=True, fallbacks=fallbacks
        )
    except Exception as exc:  # torch.onnx has captures of its own (strict, draft) that may still succeed
        exported = None
        fallbacks.append(
            f"torch.export could not trace the model ({_describe(exc)}), so torch.onnx's own capture "
            "made the file, fixed at the example's shapes"
        )

    def translate(source: Any) -> Any:
        if not isinstance(source, torch.export.ExportedProgram):
            return torch.onnx.export(
                source, args, kwargs=kwargs or None, dynamo=True, optimize=False, verbose=False, **options
            )
        try:
            return torch.onnx.export(source, dynamo=True, optimize=False, verbose=False, **options)
        except Exception as first:
            # torch.onnx's own decompositions can drop a .contiguous() before a view (HF T5's attention:
            # "Cannot view a tensor with shape ... and strides ..."); torch.export's core ATen set keeps
            # it. Not the first choice: it also writes out ops ONNX has whole (rms_norm at opset 23)
            try:
                return torch.onnx.export(
                    source.run_decompositions(), dynamo=True, optimize=False, verbose=False, **options
                )
            except Exception:
                raise first from None  # the translation's own failure is the one to tell

    try:
        try:
            program = translate(exported if exported is not None else model)
        except Exception as exc:
            free = exported is not None and not static_shapes and not fallbacks
            if not free:
                raise
            fallbacks.append(
                f"the ONNX translation with free batch and sequence dims failed ({_describe(exc)}), so "
                f"the file is fixed at the example's shapes {format_shapes(input_shapes(args, kwargs))}"
            )
            program = translate(export_program(model, args, kwargs, dynamic=False))
    except Exception as exc:  # the exporter raises many types; the user needs the op that failed
        raise BadInputError(f"ONNX export failed: {_describe(exc)}") from None
    if program is None:
        raise BadInputError("ONNX export produced no program")
    # torch.onnx's own optimizer, less its opset-23 fusions: its RotaryEmbedding fusion reads HF's
    # (1, T, D) cos/sin caches as one row per batch, so the file fails at any batch but 1 once the batch
    # is free (onnxruntime: "cos_cache and sin_cache are expected to have the same shape as input x")
    import onnxscript.optimizer

    onnxscript.optimizer.optimize_ir(program.model)
    return program
