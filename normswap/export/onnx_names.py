"""Names in a written ONNX file that a deployment can read: outputs named for what the model returns
(``logits``, ``last_hidden_state``), and the dynamic axes named for what they are (``batch``,
``sequence``, ``height``, ``width``), as ``optimum-cli export onnx`` writes them, instead of the exporter's ``linear_72`` and
``s43``.

The exporter names a graph input after the forward's parameter (``input_ids``, ``attention_mask``) and a
free dim after its symbol in torch.export's shape environment. The symbols are renamed here in the
file's inputs, outputs and value infos, expressions included (``s43*2`` becomes ``batch*2``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree


def output_names(output: Any) -> list[str]:
    """A name per tensor in ``output`` (the model's return value), in the order the ONNX graph returns
    them: the keys and attributes that lead to it (``logits``, ``hidden_states.3``); a lone tensor is
    ``output``, the items of a tuple ``output_0``, ``output_1``."""
    leaves, _ = pytree.tree_flatten_with_path(output)
    names: list[str] = []
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        parts = [_key_name(key) for key in path]
        name = ".".join(parts) if parts else "output"
        if parts and all(p.isdigit() for p in parts):
            name = "output_" + "_".join(parts)
        names.append(_unique(re.sub(r"[^\w.]", "_", name), names))
    return names


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _unique(name: str, taken: list[str]) -> str:
    if name not in taken:
        return name
    n = 2
    while f"{name}_{n}" in taken:
        n += 1
    return f"{name}_{n}"


# the free dims of a channels-first floating input, as optimum names an image's: an image N x C x H x W,
# a clip N x C x T x H x W
_SPATIAL = {4: {2: "height", 3: "width"}, 5: {2: "frames", 3: "height", 4: "width"}}


def axis_names(input_leaves: list[torch.Tensor], symbols: list[list[str | int]]) -> dict[str, str]:
    """{exporter symbol: name} for the free dims of the graph's inputs: dim 0 is ``batch``, a free dim of
    an integer input (token ids, masks) ``sequence``, an image's ``height`` and ``width``; a second symbol of the same kind gets ``_2``
    (an encoder-decoder's two lengths). ``symbols``: per input, its dims as the file states them."""
    names: dict[str, str] = {}
    for leaf, dims in zip(input_leaves, symbols, strict=False):
        for dim, symbol in enumerate(dims):
            if not isinstance(symbol, str) or not symbol or symbol in names:
                continue
            if dim == 0:
                kind = "batch"
            elif not leaf.is_floating_point():
                kind = "sequence"
            else:
                kind = _SPATIAL.get(leaf.ndim, {}).get(dim, f"dim{dim}")
            names[symbol] = _unique(kind, list(names.values()))
    return names


def _dims(value_info: Any) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def varied_dims(example: list[torch.Tensor], variants: list[list[torch.Tensor]]) -> set[tuple[int, int]]:
    """(input, dim) of each dim whose size one of ``variants`` (the input tensors of each shape a
    conversion was verified on) changes from the ``example``'s."""
    varied = set()
    for leaves in variants:
        for i, (leaf, base) in enumerate(zip(leaves, example, strict=False)):
            if leaf.ndim == base.ndim:
                varied |= {(i, d) for d in range(leaf.ndim) if leaf.shape[d] != base.shape[d]}
    return varied


def name_axes(
    path: Path, input_leaves: list[torch.Tensor], varied: set[tuple[int, int]] | None = None
) -> dict[str, dict[int, str]]:
    """Rename the free dims of the ONNX file at ``path`` (:func:`axis_names`), in place; the file keeps
    its external data file untouched. With ``varied`` (:func:`varied_dims`), an input dim the file leaves
    free but no verified shape varies is declared at the example's size: the exporter's free symbol says
    nothing of the graph (a program exported from one fixed at its example's shapes keeps its reshapes'
    sizes, and onnxruntime then fails inside the graph), and a file declares free only what was checked.
    Returns {input name: {dim: axis name}}: the axes a runtime may size freely."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    if varied is not None:
        for i, (leaf, info) in enumerate(zip(input_leaves, proto.graph.input, strict=False)):
            for d, dim in enumerate(info.type.tensor_type.shape.dim):
                if dim.dim_param and (i, d) not in varied and d < leaf.ndim:
                    dim.dim_value = int(leaf.shape[d])  # clears dim_param (one of a oneof)
    names = axis_names(input_leaves, [_dims(i) for i in proto.graph.input])
    if names:
        symbol = re.compile(
            r"\b(" + "|".join(re.escape(s) for s in sorted(names, key=len, reverse=True)) + r")\b"
        )
        graph = proto.graph
        for info in (*graph.input, *graph.output, *graph.value_info):
            for dim in info.type.tensor_type.shape.dim:
                if dim.dim_param:
                    dim.dim_param = symbol.sub(lambda m: names[m.group(1)], dim.dim_param)
    if names or varied is not None:
        onnx.save(proto, str(path))
    return {
        i.name: {d: str(s) for d, s in enumerate(_dims(i)) if isinstance(s, str) and s}
        for i in proto.graph.input
        if any(isinstance(s, str) and s for s in _dims(i))
    }


__all__ = ["axis_names", "name_axes", "output_names", "varied_dims"]
