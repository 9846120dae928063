"""ONNX files below opset 18: written at 18 by torch.onnx, converted down by onnx, and repaired where onnx's
converter leaves them invalid.

torch.onnx's exporter builds opset 18 and up. Asked for less, it converts its own result, and for a model
with a ``Split`` (GPT-2's fused qkv) that conversion either fails (the file stays at 18, with a warning) or
writes an invalid file: opset 18 gave ``Split`` a ``num_outputs`` attribute, which opsets 13-17 do not
know (they take the sizes as a second input), and onnx's converter keeps it (onnx.checker: "Unrecognized
attribute: num_outputs for operator Split"; onnxruntime refuses to load the file), and onnx's own
``version_converter`` has no adapter for Split from 18 at all. So normswap exports at opset 18, rewrites
each such ``Split`` with its sizes as an int64 input (opset 18's ``num_outputs`` chunks are ``ceil(d / n)``
with a smaller last one, ``d`` read from shape inference on the valid opset-18 model): a Split of that
form means the same from opset 13 to 18, so it waits in a domain of its own while
``onnx.version_converter`` converts every other op, and comes back unchanged. A split over a dim that is
not static has no sizes to write, and is refused with the reason. The converter also keeps opset 18's
``noop_with_empty_axes`` on the reductions whose axes it moves back into an attribute (a converted
model's RMSNorm is a ``ReduceMean``): it is dropped, as it changes nothing where axes are given. The file is then checked by
``onnx.checker`` and, as every export, in onnxruntime against PyTorch.
"""

from __future__ import annotations

import math
from pathlib import Path

from normswap.errors import BadInputError

# the lowest opset torch.onnx's exporter builds without converting
EXPORTER_OPSET = 18
# the domain Split nodes wait in while onnx converts the rest
_PARKED = "normswap.parked"


def _static_dims(model: object) -> dict[str, list[int | None]]:
    """Value name -> its dims (None where not static), by shape inference on a valid model."""
    from onnx import shape_inference

    inferred = shape_inference.infer_shapes(model)  # type: ignore[arg-type]
    graph = inferred.graph
    dims: dict[str, list[int | None]] = {}
    for info in (*graph.input, *graph.value_info, *graph.output):
        shape = info.type.tensor_type.shape
        dims[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]
    for init in graph.initializer:
        dims[init.name] = list(init.dims)
    return dims


def _repair_splits(model: object, dims: dict[str, list[int | None]]) -> int:
    """Give every ``Split`` with opset 18's ``num_outputs`` its sizes as an input instead; the count."""
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph  # type: ignore[attr-defined]
    repaired = 0
    for node in graph.node:
        if node.op_type != "Split" or node.domain not in ("", "ai.onnx"):
            continue
        attributes = {a.name: a for a in node.attribute}
        if "num_outputs" not in attributes:
            continue
        count = attributes["num_outputs"].i
        shape = dims.get(node.input[0])
        axis = attributes["axis"].i if "axis" in attributes else 0
        size = shape[axis % len(shape)] if shape else None
        if size is None:
            raise BadInputError(
                f"ONNX export below opset {EXPORTER_OPSET}: {node.name or 'a Split'} splits a dim that is not "
                f"static, so its sizes cannot be written for opsets before 18; choose --opset {EXPORTER_OPSET}"
            )
        chunk = math.ceil(size / count)
        sizes = [chunk] * (count - 1) + [size - chunk * (count - 1)]
        name = f"{node.name or node.output[0]}_sizes"
        graph.initializer.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), name))
        node.attribute.remove(attributes["num_outputs"])
        del node.input[1:]
        node.input.append(name)
        repaired += 1
    for function in getattr(model, "functions", []):
        if any(
            n.op_type == "Split" and any(a.name == "num_outputs" for a in n.attribute) for n in function.node
        ):
            raise BadInputError(
                f"ONNX export below opset {EXPORTER_OPSET}: a Split inside the local function {function.name} "
                f"cannot be rewritten; choose --opset {EXPORTER_OPSET}"
            )
    return repaired


# Reductions that took their axes as an input from opset 18 on, and gained ``noop_with_empty_axes`` there;
# onnx's converter moves the axes back into an attribute and keeps the new attribute, which the older
# schema rejects ("Unrecognized attribute: noop_with_empty_axes for operator ReduceMean")
_AXES_INPUT_IN_18 = frozenset(
    {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum"}
    | {"ReduceLogSumExp", "ReduceSumSquare"}
)


def _drop_noop_with_empty_axes(model: object) -> None:
    """Remove ``noop_with_empty_axes`` from the converted reductions: with axes given it changes nothing; a
    reduction with no axes that was a no-op at 18 would reduce everything below it, and is refused."""
    graphs = [model.graph.node, *(f.node for f in getattr(model, "functions", []))]  # type: ignore[attr-defined]
    for nodes in graphs:
        for node in nodes:
            if node.op_type not in _AXES_INPUT_IN_18 or node.domain not in ("", "ai.onnx"):
                continue
            attributes = {a.name: a for a in node.attribute}
            noop = attributes.get("noop_with_empty_axes")
            if noop is None:
                continue
            has_axes = "axes" in attributes and len(attributes["axes"].ints) > 0
            if noop.i and not has_axes:
                raise BadInputError(
                    f"ONNX export below opset {EXPORTER_OPSET}: {node.name or node.op_type} reduces no axes "
                    f"as a no-op, which opsets before 18 cannot say; choose --opset {EXPORTER_OPSET}"
                )
            node.attribute.remove(noop)


def convert_down(path: Path, opset: int, external_data_bytes: int | None = None) -> int:
    """Rewrite the file at ``path`` (written at opset 18 or more) at ``opset``; the number of Splits
    repaired. BadInputError when onnx cannot convert it or the result is not a valid model. Saved back
    as it was written: weights above ``external_data_bytes`` in ``OUT.onnx.data``."""
    import onnx
    from onnx import version_converter

    from normswap.load.onnx_file import save_proto

    model = onnx.load(str(path))
    repaired = _repair_splits(model, _static_dims(model))
    # onnx's converter has no adapter for Split from 18 down; a Split given its sizes as an input means the
    # same in opsets 13-18, so it crosses the conversion in a domain of its own and comes back unchanged
    splits = [n for n in model.graph.node if n.op_type == "Split" and n.domain in ("", "ai.onnx")]
    for node in splits:
        node.domain = _PARKED
    model.opset_import.append(onnx.helper.make_opsetid(_PARKED, 1))
    try:
        converted = version_converter.convert_version(model, opset)
    except Exception as exc:  # the converter raises RuntimeError and others; the op is what matters
        reason = str(exc).rpartition("failed: ")[2].strip() or type(exc).__name__
        raise BadInputError(
            f"onnx cannot convert the export down to opset {opset} ({reason}); choose a higher --opset"
        ) from None
    for node in converted.graph.node:
        if node.domain == _PARKED:
            node.domain = ""
    _drop_noop_with_empty_axes(converted)
    kept = [o for o in converted.opset_import if o.domain != _PARKED]
    del converted.opset_import[:]
    converted.opset_import.extend(kept)
    try:
        onnx.checker.check_model(converted)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise BadInputError(f"the export converted to opset {opset} is not a valid model: {first}") from None
    save_proto(converted, path, external_data_bytes)
    return repaired
