"""ONNX Runtime's fused norm ops in an exported file (``normswap export --target onnxruntime``).

Runtimes before opset 23 have no RMSNormalization, and the standard ops have no residual add. ONNX
Runtime ships its own: ``SimplifiedLayerNormalization`` (RMSNorm; ORT registers it in the default
domain) and, in its ``com.microsoft`` domain, ``SkipSimplifiedLayerNormalization`` and
``SkipLayerNormalization`` (``h = x + skip``, then the norm of h; h is the fourth output). This module
rewrites a file the exporter wrote into those ops:

- RMSNorm written out, in either form the exporter produces (``Pow(x, 2)`` or ``Mul(x, x)``, then
  ``ReduceMean`` over the last axis, ``Add(eps)``, ``Sqrt``, then ``Div(x, .)`` or
  ``Reciprocal`` and ``Mul(x, .)``), with the weight ``Mul`` after it when there is one, becomes one
  ``SimplifiedLayerNormalization``;
- a ``SimplifiedLayerNormalization`` or ``LayerNormalization`` over the last axis whose input is an
  ``Add`` of two tensors of the same shape becomes the ``Skip`` op; the sum keeps its name, so the
  residual stream reads it unchanged.

Left as they are, with the reason in the report: an eps outside (0, 1e-4], the range in which ONNX
Runtime's own fusions use these ops (its transformer optimizer skips the others); norms in another
dtype than the file's float (casts around the statistics); a weight that is not a constant of the
row's length; statistics that something else reads. ``export_onnx`` then runs the rewritten file in
onnxruntime against PyTorch, as for any export, before it is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MS_DOMAIN = "com.microsoft"
EPS_MAX = 1e-4


@dataclass
class OrtFusion:
    """What the rewrite did: fused op type -> count, and the norm sites it left, with the reason."""

    fused: dict[str, int] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)


class _Graph:
    """Lookups over one ``GraphProto``: producers, consumers, constants and static shapes."""

    def __init__(self, graph: Any) -> None:
        from onnx import numpy_helper

        self.producer = {out: node for node in graph.node for out in node.output if out}
        self.consumers: dict[str, list[Any]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}
        self.constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for attr in node.attribute:
                    if attr.name == "value":
                        self.constants[node.output[0]] = numpy_helper.to_array(attr.t)
        self.types: dict[str, tuple[int, list[int | str | None]]] = {}
        for info in [*graph.input, *graph.value_info, *graph.output]:
            tensor = info.type.tensor_type
            dims = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
            ]
            self.types[info.name] = (tensor.elem_type, dims if tensor.HasField("shape") else None)

    def only_user(self, name: str) -> Any | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def scalar(self, name: str) -> float | None:
        value = self.constants.get(name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    def shape(self, name: str) -> list[int | str | None] | None:
        found = self.types.get(name)
        return found[1] if found else None

    def elem_type(self, name: str) -> int | None:
        found = self.types.get(name)
        return found[0] if found else None


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _reduces_last_axis(g: _Graph, node: Any, x: str) -> bool:
    if _attr(node, "keepdims", 1) != 1:
        return False
    axes = _attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = g.constants.get(node.input[1])
        axes = None if value is None else [int(a) for a in value.reshape(-1)]
    shape = g.shape(x)
    rank = len(shape) if shape is not None else None
    return (
        axes is not None and len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))
    )


@dataclass
class _RmsSite:
    x: str
    eps: float
    nodes: list[Any]  # the matched nodes, in graph order of discovery
    normalized: str  # the output of x / rms(x)


def _match_rms(g: _Graph, reduce_mean: Any) -> _RmsSite | None:
    """The written-out RMSNorm around ``reduce_mean``, or None if it is not one."""
    square = g.producer.get(reduce_mean.input[0])
    if square is None or g.only_user(square.output[0]) is not reduce_mean:
        return None
    if (square.op_type == "Pow" and g.scalar(square.input[1]) == 2.0) or (
        square.op_type == "Mul" and square.input[0] == square.input[1]
    ):
        x = square.input[0]
    else:
        return None
    if not _reduces_last_axis(g, reduce_mean, x):
        return None
    add = g.only_user(reduce_mean.output[0])
    if add is None or add.op_type != "Add":
        return None
    eps_name = add.input[1] if add.input[0] == reduce_mean.output[0] else add.input[0]
    eps = g.scalar(eps_name)
    sqrt = g.only_user(add.output[0])
    if eps is None or sqrt is None or sqrt.op_type != "Sqrt":
        return None
    after = g.only_user(sqrt.output[0])
    if after is not None and after.op_type == "Div" and list(after.input) == [x, sqrt.output[0]]:
        return _RmsSite(x, eps, [square, reduce_mean, add, sqrt, after], after.output[0])
    if after is not None and after.op_type == "Reciprocal":
        scale = g.only_user(after.output[0])
        if (
            scale is not None
            and scale.op_type == "Mul"
            and sorted(scale.input) == sorted([x, after.output[0]])
        ):
            return _RmsSite(x, eps, [square, reduce_mean, add, sqrt, after, scale], scale.output[0])
    return None


def _row_length(g: _Graph, name: str) -> int | None:
    shape = g.shape(name)
    return shape[-1] if shape and isinstance(shape[-1], int) else None


def _weight_of(g: _Graph, site: _RmsSite) -> tuple[str | None, Any | None]:
    """The weight multiply after the norm: (its constant input, the Mul node), or (None, None)."""
    mul = g.only_user(site.normalized)
    if mul is None or mul.op_type != "Mul":
        return None, None
    weight = mul.input[1] if mul.input[0] == site.normalized else mul.input[0]
    value = g.constants.get(weight)
    n = _row_length(g, site.x)
    if value is None or value.ndim != 1 or (n is not None and value.shape[0] != n):
        return None, None
    return weight, mul


def _rebuild(graph: Any, edits: list[tuple[list[Any], Any, Any]]) -> None:
    """Apply every (nodes to drop, new node, the dropped node whose place it takes) at once.

    At once because a protobuf list copies what it is given: after one rebuild the node objects found
    before it are no longer the graph's.
    """
    drop = {id(node) for old, _, _ in edits for node in old}
    placed = {id(at): new for _, new, at in edits}
    kept = []
    for node in graph.node:
        if id(node) in placed:
            kept.append(placed[id(node)])
        elif id(node) not in drop:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


def _eps_reason(eps: float) -> str | None:
    if 0.0 < eps <= EPS_MAX:
        return None
    return f"eps {eps:g} is outside (0, {EPS_MAX:g}], where onnxruntime's own fusions use its fused ops"


def _fuse_rms(graph: Any, fusion: OrtFusion) -> None:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    g = _Graph(graph)
    edits = []
    for node in graph.node:
        if node.op_type != "ReduceMean":
            continue
        site = _match_rms(g, node)
        if site is None:
            continue
        where = f"RMSNorm of {site.x}"
        if (reason := _eps_reason(site.eps)) is not None:
            fusion.left.append(f"{where}: {reason}")
            continue
        if g.elem_type(site.x) not in (TensorProto.FLOAT, None):
            fusion.left.append(f"{where}: its input is not float32 (fused only in float32 files)")
            continue
        weight, mul = _weight_of(g, site)
        nodes, output = site.nodes, site.normalized
        if mul is not None:
            nodes, output = [*nodes, mul], mul.output[0]
        else:
            n = _row_length(g, site.x)
            if n is None:
                fusion.left.append(f"{where}: no weight and no static row length for the scale of ones")
                continue
            weight = f"{site.x}_rms_ones"
            graph.initializer.append(numpy_helper.from_array(np.ones(n, dtype=np.float32), weight))
        fused = helper.make_node(
            "SimplifiedLayerNormalization",
            [site.x, weight],
            [output],
            name=f"{nodes[-1].name or output}_fused",
            axis=-1,
            epsilon=site.eps,
            stash_type=1,
        )
        edits.append((nodes, fused, nodes[-1]))
        fusion.fused["SimplifiedLayerNormalization"] = fusion.fused.get("SimplifiedLayerNormalization", 0) + 1
    _rebuild(graph, edits)


def _fuse_skip(graph: Any, fusion: OrtFusion) -> None:
    from onnx import helper

    g = _Graph(graph)
    edits = []
    for node in graph.node:
        if node.op_type not in ("SimplifiedLayerNormalization", "LayerNormalization"):
            continue
        x = node.input[0]
        add = g.producer.get(x)
        if add is None or add.op_type != "Add":
            continue
        a, b = add.input
        shapes = [g.shape(a), g.shape(b), g.shape(x)]
        if (
            any(s is None or None in s or len(s) < 2 for s in shapes)
            or not shapes[0] == shapes[1] == shapes[2]
        ):
            continue  # a broadcast add (a bias), or shapes the file does not say: not a residual sum
        if _attr(node, "axis", -1) not in (-1, len(shapes[2]) - 1):
            continue
        if any(out and g.consumers.get(out) for out in node.output[1:]):
            fusion.left.append(
                f"norm of {x}: its statistics are read, which the Skip ops do not output alike"
            )
            continue
        eps = float(_attr(node, "epsilon", 1e-5))
        if (reason := _eps_reason(eps)) is not None:
            fusion.left.append(f"norm of {x}: {reason}")
            continue
        params = [i for i in node.input[1:] if i]
        if any(p not in g.constants for p in params):
            continue  # the Skip node takes the Add's place, before a computed weight would exist
        rms = node.op_type == "SimplifiedLayerNormalization"
        op_type = "SkipSimplifiedLayerNormalization" if rms else "SkipLayerNormalization"
        skip = helper.make_node(
            op_type,
            [a, b, *params],
            [node.output[0], "", "", add.output[0]],  # the sum keeps its name: its readers are unchanged
            name=f"{node.name or node.output[0]}_skip",
            domain=MS_DOMAIN,
            epsilon=eps,
        )
        edits.append(([add, node], skip, add))
        fusion.fused[op_type] = fusion.fused.get(op_type, 0) + 1
        if rms:
            fusion.fused["SimplifiedLayerNormalization"] -= 1
    _rebuild(graph, edits)


def _drop_unused_constants(graph: Any) -> None:
    """Remove the constants only the replaced nodes read (eps, the exponent 2, axes)."""
    while True:
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        unused = [
            node
            for node in graph.node
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output[0] not in used
        ]
        if not unused:
            break
        for node in unused:
            graph.node.remove(node)
    inputs = {i.name for i in graph.input}
    keep = [i for i in graph.initializer if i.name in used or i.name in inputs]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def fuse_for_onnxruntime(path: Path, external_data_bytes: int | None = None) -> OrtFusion:
    """Rewrite the .onnx file at ``path`` in place (see the module docstring); returns what it did. The
    file is saved back as it was written: weights above ``external_data_bytes`` in ``OUT.onnx.data``."""
    import onnx
    from onnx import helper

    from normswap.load.onnx_file import save_proto

    model = onnx.load(str(path))
    fusion = OrtFusion()
    _fuse_rms(model.graph, fusion)
    _fuse_skip(model.graph, fusion)
    _drop_unused_constants(model.graph)
    fusion.fused = {k: v for k, v in sorted(fusion.fused.items()) if v}
    if any(node.domain == MS_DOMAIN for node in model.graph.node) and not any(
        o.domain == MS_DOMAIN for o in model.opset_import
    ):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    save_proto(model, path, external_data_bytes)
    return fusion
