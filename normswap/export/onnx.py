"""ONNX export that proves itself: export with torch.onnx (dynamo), run the file in onnxruntime, compare.

The file is written to a temporary path, loaded in onnxruntime and run on the example inputs; only if
its outputs agree with PyTorch's (tolerance by dtype: :func:`normswap.util.tolerance.onnx_tolerance`) is
it moved to the destination. A large model's weights go to an external data file ``OUT.onnx.data``
(:mod:`normswap.load.onnx_file`), checked with the .onnx from the path and published with it. normswap's fused-norm ops become standard ops through
:mod:`normswap.kernels.onnx_translation`.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.errors import BadInputError, CheckFailedError, shorten
from normswap.export.onnx_opset import EXPORTER_OPSET, convert_down
from normswap.export.onnx_ort import fuse_for_onnxruntime
from normswap.load.onnx_file import data_file, save_program
from normswap.load.paths import check_output, same_path
from normswap.load.save import atomic_write_onnx
from normswap.util.modes import modes_restored
from normswap.util.tolerance import onnx_tolerance
from normswap.verify.metrics import TensorComparison, compare_tensors

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
    outputs: list[TensorComparison] = field(default_factory=list)
    dynamic_batch: bool = False
    checked_batch_sizes: list[int] = field(default_factory=list)
    note: str = ""
    target: str = "standard"
    # the external data file beside the .onnx (its name), when the weights are too large to sit inside
    external_data: str | None = None
    # --target onnxruntime: {"fused": {op type: count}, "left": [why a norm site kept standard ops]}
    onnxruntime_fusion: dict[str, Any] = field(default_factory=dict)

    @property
    def within_tolerance(self) -> bool:
        return all(o.max_rel <= onnx_tolerance(o.dtype) for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
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


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, ...] | dict[str, Any]:
    batch = torch.export.Dim("batch", min=1, max=1024)

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {0: batch} if value.ndim else None
        return None

    if kwargs:
        # with keyword inputs, torch.export wants every input keyed by the forward's parameter names
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        return {name: spec(value) for name, value in bound.arguments.items()}
    return tuple(spec(a) for a in args)


def _read_back(path: Path) -> tuple[int, dict[str, int]]:
    """Default-domain opset and op counts of the file as written (the exporter may convert on save)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    counts = Counter(node.op_type for node in proto.graph.node)
    for function in proto.functions:  # ops inside local functions count too
        counts.update(node.op_type for node in function.node)
    return int(opset), dict(sorted(counts.items()))


def _repeat_batch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The same inputs with the batch dim doubled, to check a dynamic batch dim really is dynamic."""

    def twice(value: Any) -> Any:
        return torch.cat([value, value]) if isinstance(value, torch.Tensor) and value.ndim else value

    return tuple(twice(a) for a in args), {k: twice(v) for k, v in kwargs.items()}


def run_onnx(path: Path, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Run an .onnx file in onnxruntime (CPU) on torch inputs; outputs as torch tensors."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    leaves = _tensor_leaves((args, kwargs))
    if len(leaves) != len(names):
        raise BadInputError(
            f"the .onnx graph takes {len(names)} inputs ({', '.join(names)}) but the example inputs hold "
            f"{len(leaves)} tensors"
        )
    feeds = {name: leaf.detach().cpu().numpy() for name, leaf in zip(names, leaves, strict=True)}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]


def _compare(model: nn.Module, path: Path, args: tuple, kwargs: dict) -> list[TensorComparison]:
    with torch.no_grad():
        expected = _tensor_leaves(model(*args, **kwargs))
    try:
        got = run_onnx(path, args, kwargs)
    except BadInputError:
        raise
    except Exception as exc:  # e.g. a dtype onnxruntime's CPU build has no kernel for (bf16)
        raise CheckFailedError(
            f"onnxruntime cannot run the exported file: {_describe(exc)}; nothing written"
        ) from None
    if len(got) != len(expected):
        raise CheckFailedError(f"onnxruntime returned {len(got)} outputs, PyTorch {len(expected)}")
    return [
        compare_tensors(f"output[{i}]", ref, out.to(ref.dtype))
        for i, (ref, out) in enumerate(zip(expected, got, strict=True))
        if ref.is_floating_point()
    ]


def export_onnx(
    model: nn.Module,
    path: Path,
    example_args: tuple,
    example_kwargs: dict | None = None,
    *,
    opset: int | None = None,
    dynamic_batch: bool = False,
    refuse_path: Path | None = None,
    target: str = "standard",
    overwrite: bool = False,
    external_data_bytes: int | None = None,
) -> OnnxExport:
    """Export ``model`` to ``path`` and check the file in onnxruntime; nothing is written if either fails.

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
    if refuse_path is not None and same_path(path, refuse_path):
        raise BadInputError(
            f"refusing to overwrite the input model {refuse_path}: choose another output path"
        )
    check_output("-o", path, overwrite=overwrite)
    check_target(target)
    args, kwargs = tuple(example_args), dict(example_kwargs or {})
    table = translation_table(opset) if opset is None or opset >= LAYER_NORMALIZATION_OPSET else None
    result = OnnxExport(path=str(path), opset=0, dynamic_batch=dynamic_batch, target=target)

    # below the exporter's own opset: exported at it, converted down and repaired (export/onnx_opset.py)
    below = opset is not None and opset < EXPORTER_OPSET

    def write(temp: Path) -> None:
        try:
            program = torch.onnx.export(
                model,
                args,
                kwargs=kwargs or None,
                dynamo=True,
                opset_version=EXPORTER_OPSET if below else opset,
                custom_translation_table=table,
                dynamic_shapes=_dynamic_shapes(model, args, kwargs) if dynamic_batch else None,
                verbose=False,
            )
        except Exception as exc:  # the exporter raises many types; the user needs the op that failed
            raise BadInputError(f"ONNX export failed: {_describe(exc)}") from None
        if program is None:
            raise BadInputError("ONNX export produced no program")
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
        result.opset, result.op_counts = _read_back(temp)
        if opset is not None and result.opset != opset:
            # torch.onnx falls back to the opset it built when converting down fails, with only a warning
            raise BadInputError(
                f"the exporter could not write opset {opset} (it produced opset {result.opset}); "
                f"choose --opset {result.opset} or higher"
            )
        result.outputs = _compare(model, temp, args, kwargs)
        result.checked_batch_sizes = [_batch_size(args, kwargs)]
        if dynamic_batch:
            bigger_args, bigger_kwargs = _repeat_batch(args, kwargs)
            result.outputs += _compare(model, temp, bigger_args, bigger_kwargs)
            result.checked_batch_sizes.append(_batch_size(bigger_args, bigger_kwargs))
        if not result.within_tolerance:
            worst = max(result.outputs, key=lambda o: o.max_rel)
            raise CheckFailedError(
                f"onnxruntime disagrees with PyTorch: {worst.name} max abs {worst.max_abs:.3g} "
                f"({worst.max_rel:.3g} x max|ref|); nothing written"
            )

    with modes_restored(model, inference=True):  # exporting must not change the model
        atomic_write_onnx(path, write, overwrite=overwrite)
    return result


def _batch_size(args: tuple, kwargs: dict) -> int:
    leaves = [t for t in _tensor_leaves((args, kwargs)) if t.ndim]
    return int(leaves[0].shape[0]) if leaves else 0
