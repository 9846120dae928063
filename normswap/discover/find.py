"""find_norms: every normalization in a model, with where its input comes from and where it goes.

Module classes with known semantics are read directly (:mod:`normswap.discover.classify`). Everything
else is found on the captured graph: functional norm calls (``F.layer_norm`` inside a block's forward),
and norms written out as elementary ops in any algebraic form, each confirmed by running it
(:mod:`normswap.graph.patterns`, whose docstring says what is and is not taken for a norm). A module whose
whole forward is such a pattern (HF ``LlamaRMSNorm``, a hand-written LayerNorm class), or one
``F.layer_norm``/``F.rms_norm`` call on its own weight and bias (nanoGPT's LayerNorm, timm's RmsNorm),
becomes a ``structural`` module site and can be swapped like a torch.nn norm; a norm inside a larger
forward stays a ``pattern`` or ``functional`` site. Without a graph, candidate modules are probed one by
one on a synthetic input.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn

from normswap.discover.classify import classify_module, is_norm_candidate
from normswap.discover.own_forward import computes_more_than_its_norm
from normswap.discover.site import NormSite
from normswap.graph.analysis import GraphView, ModuleCall, normalize_module_path, view_of
from normswap.graph.capture import CapturedGraph, capture_graph
from normswap.graph.ops import CAST_OPS, CHECK_OPS, arg, op_name, rank, tensor_meta
from normswap.graph.patterns import NormMatch, find_norm_patterns
from normswap.modules.semantics import NormKind, NormSemantics, applied_eps, declared_semantics, dtype_name

FUNCTIONAL_NORM_OPS = {
    "layer_norm": NormKind.LAYER,
    "batch_norm": NormKind.BATCH,
    "group_norm": NormKind.GROUP,
    "instance_norm": NormKind.INSTANCE,
    "rms_norm": NormKind.RMS,
    # normswap's fused ops, as a converted model's graph (or a .pt2 of it) holds them
    "rms_norm_fwd": NormKind.RMS,
    "layer_norm_fwd": NormKind.LAYER,
    "add_rms_norm_fwd": NormKind.RMS,
    "add_layer_norm_fwd": NormKind.LAYER,
}
_NORM_OP_NAMES = frozenset(FUNCTIONAL_NORM_OPS)


@dataclass
class NormInventory:
    """The norm sites of a model and how the graph behind them was captured."""

    sites: list[NormSite]
    capture: CapturedGraph = field(repr=False)

    def __iter__(self) -> Iterator[NormSite]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def __getitem__(self, index: int) -> NormSite:
        return self.sites[index]

    @property
    def graph_method(self) -> str | None:
        return self.capture.method

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for site in self.sites:
            out[site.kind.value] = out.get(site.kind.value, 0) + 1
        return out

    def by_path(self, path: str) -> NormSite:
        for site in self.sites:
            if site.path == path:
                return site
        raise KeyError(path)


def find_norms(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    captured: CapturedGraph | None = None,
) -> NormInventory:
    """Find every normalization site in ``model``.

    With example inputs the graph comes from torch.export, otherwise from fx tracing; if neither works
    the module-level findings are returned and ``inventory.capture.reason`` says why the graph is missing.
    """
    if captured is None:
        captured = capture_graph(model, example_args, example_kwargs)
    modules = dict(model.named_modules())
    sites: dict[str, NormSite] = {}
    for path, module in modules.items():
        if not path:
            continue
        site = classify_module(path, module)
        if site is not None and not _inside_known_norm(path, sites):
            sites[path] = site

    if captured.ok:
        view = view_of(captured)
        order = {n: i for i, n in enumerate(view.nodes)}
        demoted = {}
        for path in [p for p, s in sites.items() if s.module is not None]:
            if computes_more_than_its_norm(view, path, modules[path], _NORM_OP_NAMES):
                demoted[path] = sites.pop(path)  # found again as a call inside its forward
        _add_graph_sites(view, modules, sites, order)
        found_again = set()
        for site in sites.values():
            owner = site.path.split("::")[0]
            if not site.is_module and owner in demoted:
                site.class_name = demoted[owner].class_name
                found_again.add(owner)
        # a norm the graph holds out of the sweep's sight (inside an autocast region: timm's fast norms)
        # stays the module it was read as: never dropped without being found again
        sites.update({path: site for path, site in demoted.items() if path not in found_again})
        for site in sites.values():
            if site.source in ("module", "structural"):
                _annotate_module_site(view, site, modules, order)
    else:
        _probe_candidates(modules, sites)

    ordered = sorted(sites.values(), key=lambda s: s.order)
    return NormInventory(ordered, captured)


def _inside_known_norm(path: str, sites: dict[str, NormSite]) -> bool:
    return any(path.startswith(p + ".") for p in sites)


def _owner_path(view: GraphView, nodes: list[fx.Node]) -> str:
    """The deepest module path that every node of ``nodes`` ran inside."""
    common: list[str] | None = None
    for n in nodes:
        if view.is_param(n):
            continue
        stack = [e[0] for e in (n.meta.get("nn_module_stack") or {}).values()]
        paths = [normalize_module_path(p) for p in stack]
        if common is None:
            common = paths
        else:
            k = 0
            while k < min(len(common), len(paths)) and common[k] == paths[k]:
                k += 1
            common = common[:k]
    return common[-1] if common else ""


def _module_is_exactly(view: GraphView, call: ModuleCall, nodes: set[fx.Node]) -> bool:
    """True when every op of the module call belongs to the matched norm (casts and checks aside)."""
    for n in call.nodes:
        name = op_name(n)
        if n in nodes or name in CAST_OPS or name in CHECK_OPS or view.is_param(n) or n.op == "get_attr":
            continue
        return False
    return True


def _relative_name(view: GraphView, node: fx.Node | None, prefix: str) -> str | None:
    """The name of the parameter ``node`` stands for, relative to the module at ``prefix``."""
    name = view.param_name(node) if node is not None else None
    if name is None:
        return None
    if prefix and name.startswith(prefix + "."):
        return name[len(prefix) + 1 :]
    return name if not prefix else None


def _semantics_from_match(
    match: NormMatch, view: GraphView, model: nn.Module, prefix: str = ""
) -> NormSemantics:
    """The semantics of a norm matched in the graph; parameter names relative to the module at ``prefix``."""
    meta = tensor_meta(match.input)
    weight_shape = None
    if match.weight is not None:
        wmeta = tensor_meta(match.weight)
        weight_shape = wmeta[0] if wmeta else _param_shape(model, view.param_name(match.weight))
    shape = weight_shape
    if shape is None and meta is not None and match.dims:
        shape = tuple(meta[0][d] for d in match.dims)
    kind = NormKind.parse(match.kind)
    return NormSemantics(
        kind=kind,
        normalized_dims=match.dims,
        normalized_shape=shape,
        eps=match.eps,  # the constant the graph adds: as applied
        dtype=dtype_name(meta[1]) if meta else None,
        affine=match.weight is not None,
        bias=match.bias is not None,
        weight_name=_relative_name(view, match.weight, prefix),
        bias_name=_relative_name(view, match.bias, prefix),
        casting=match.casting,
        weight_offset=match.weight_offset,
        running_stats=kind is NormKind.BATCH,
    )


def _param_shape(model: nn.Module, name: str | None) -> tuple[int, ...] | None:
    if name is None:
        return None
    try:
        return tuple(model.get_parameter(name).shape)
    except AttributeError:
        try:
            return tuple(model.get_buffer(name).shape)
        except AttributeError:
            return None


def _add_graph_sites(
    view: GraphView, modules: dict[str, nn.Module], sites: dict[str, NormSite], order: dict[fx.Node, int]
) -> None:
    known_calls: set[fx.Node] = set()
    for path in sites:
        for call in view.calls.get(path, ()):
            known_calls.update(call.nodes)

    for match in find_norm_patterns(view, modules[""]):
        if match.output in known_calls or (match.input in known_calls and match.output in known_calls):
            continue
        if any(n in known_calls for n in match.nodes):
            continue
        owner = _owner_path(view, match.nodes)
        calls = view.calls.get(owner, [])
        module = modules.get(owner)
        semantics = _semantics_from_match(match, view, modules[""], owner)
        if (
            owner
            and _runs(module)
            and calls
            and owner not in sites
            and all(_module_is_exactly(view, c, set(match.nodes)) for c in calls[:1])
        ):
            cls = type(module)
            sites[owner] = NormSite(
                path=owner,
                source="structural",
                semantics=semantics,
                class_name=f"{cls.__module__}.{cls.__qualname__}",
                module=module,
                training=module.training,
            )
            for c in calls:
                known_calls.update(c.nodes)
            continue
        path = f"{owner or '<root>'}::{match.output.name}"
        sites[path] = NormSite(
            path=path,
            source="pattern",
            semantics=semantics,
            producer=view.describe(match.input, modules),
            consumers=[view.describe(u, modules) for u in _users_of(match.output)],
            call_count=1,
            order=order[match.output],
        )
        known_calls.update(match.nodes)

    for n in view.nodes:
        kind = FUNCTIONAL_NORM_OPS.get(op_name(n) or "")
        if kind is None or n in known_calls:
            continue
        owner = view.innermost_path(n)
        path = f"{owner or '<root>'}::{n.name}"
        site = _functional_site(view, n, kind, path, modules, order)
        whole = _whole_forward_site(view, n, owner, site, modules) if owner not in sites else None
        if whole is not None:
            sites[owner] = whole
            for call in view.calls.get(owner, []):
                known_calls.update(call.nodes)  # its other calls are this site too
            continue
        sites[path] = site


def _runs(module: nn.Module | None) -> bool:
    """Whether ``module`` is what computes its part of the graph. A bare ``nn.Module`` is not: in a flat
    program (``ExportedProgram.module()``) it only holds tensors that the root's graph reads, and its own
    forward raises. Replacing it would change nothing the model computes, so a norm it holds is a norm
    inside the root's forward, not a module to swap."""
    return module is not None and type(module) is not nn.Module


def _whole_forward_site(
    view: GraphView, n: fx.Node, owner: str, site: NormSite, modules: dict[str, nn.Module]
) -> NormSite | None:
    """The module ``owner`` as a structural site when its whole forward is the one ``F.layer_norm`` /
    ``F.rms_norm`` call ``n`` on its own weight and bias (nanoGPT's and OLMo's LayerNorm, timm's RmsNorm):
    such a module can be swapped like a torch.nn norm. None otherwise."""
    module = modules.get(owner)
    calls = view.calls.get(owner, [])
    if (
        op_name(n) not in ("layer_norm", "rms_norm")
        or not _runs(module)
        or list(module.children())
        or not calls
    ):
        return None
    # besides the call: reads of stored tensors' attributes (fx records ``self.weight.shape``)
    extra = {
        m for m in calls[0].nodes if m.all_input_nodes and all(view.is_param(a) for a in m.all_input_nodes)
    }
    if not _module_is_exactly(view, calls[0], {n, *extra}):
        return None
    names = []
    for index, key in ((2, "weight"), (3, "bias")):
        tensor = arg(n, index, key)
        if tensor is None or (key == "bias" and op_name(n) == "rms_norm"):
            names.append(None)
            continue
        name = _relative_name(view, tensor, owner) if isinstance(tensor, fx.Node) else None
        if name is None:
            return None  # computed in the forward, or another module's tensor
        names.append(name)
    cls = type(module)
    site.path, site.source, site.module, site.training = owner, "structural", module, module.training
    site.class_name = f"{cls.__module__}.{cls.__qualname__}"
    site.semantics = replace(site.semantics, weight_name=names[0], bias_name=names[1])
    return site


def _users_of(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if op_name(u) not in CHECK_OPS]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _functional_site(
    view: GraphView,
    n: fx.Node,
    kind: NormKind,
    path: str,
    modules: dict[str, nn.Module],
    order: dict[fx.Node, int],
) -> NormSite:
    x = n.args[0] if n.args else None
    meta = tensor_meta(x) if isinstance(x, fx.Node) else None
    dtype = meta[1] if meta else None
    fields: dict[str, Any] = {"kind": kind, "dtype": dtype_name(dtype)}
    class_name = None
    name = op_name(n)
    if name in ("layer_norm", "rms_norm"):
        shape = arg(n, 1, "normalized_shape") or ()
        if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape):
            fields["normalized_shape"] = tuple(shape)
            fields["normalized_dims"] = tuple(range(-len(shape), 0))
        fields["affine"] = arg(n, 2, "weight") is not None
        fields["bias"] = name == "layer_norm" and arg(n, 3, "bias") is not None
        eps = arg(n, 4 if name == "layer_norm" else 3, "eps")
        if name == "rms_norm" and eps is None:  # F.rms_norm(eps=None): the dtype's, as torch applies it
            fields["eps"] = applied_eps(None, dtype)
        else:
            fields["eps"] = _number(eps)
    elif name is not None and name.endswith("_norm_fwd"):
        # (x, [residual,] weight, bias, eps, casting, weight_offset): see normswap.kernels.ops
        first = 2 if name.startswith("add_") else 1
        weight, bias = arg(n, first, "weight"), arg(n, first + 1, "bias")
        weight_meta = tensor_meta(weight) if isinstance(weight, fx.Node) else None
        shape = weight_meta[0] if weight_meta else (meta[0][-1:] if meta else None)
        if shape:
            fields["normalized_shape"] = tuple(shape)
            fields["normalized_dims"] = tuple(range(-len(shape), 0))
        fields["affine"], fields["bias"] = weight is not None, bias is not None
        fields["eps"] = _number(arg(n, first + 2, "eps"))
        fields["casting"] = str(arg(n, first + 3, "casting", "none"))
        fields["weight_offset"] = _number(arg(n, first + 4, "weight_offset", 0.0)) or 0.0
        class_name = f"normswap::{name}"
    elif name == "batch_norm":
        fields["normalized_dims"] = (1,)
        fields["affine"] = arg(n, 1, "weight") is not None
        fields["bias"] = arg(n, 2, "bias") is not None
        fields["running_stats"] = arg(n, 3, "running_mean") is not None
        fields["eps"] = _number(arg(n, 7, "eps"))
        fields["momentum"] = _number(arg(n, 6, "momentum"))
        if meta:
            fields["normalized_shape"] = (meta[0][1],)
    elif name == "group_norm":
        fields["num_groups"] = arg(n, 1, "num_groups")
        fields["affine"] = arg(n, 2, "weight") is not None
        fields["bias"] = arg(n, 3, "bias") is not None
        fields["eps"] = _number(arg(n, 4, "eps"))
        if meta:
            fields["normalized_shape"] = (meta[0][1],)
    return NormSite(
        path=path,
        source="functional",
        semantics=NormSemantics(**fields),
        class_name=class_name,
        order=order[n],
        call_count=1,
        producer=view.describe(x, modules) if isinstance(x, fx.Node) else None,
        consumers=[view.describe(u, modules) for u in _users_of(n)],
    )


def _annotate_module_site(
    view: GraphView, site: NormSite, modules: dict[str, nn.Module], order: dict[fx.Node, int]
) -> None:
    calls = view.calls.get(site.path, [])
    site.call_count = len(calls)
    if not calls:
        return
    call = calls[0]
    site.order = min(order[n] for n in call.nodes)
    inputs = call.inputs(view)
    if inputs:
        site.producer = view.describe(inputs[0], modules)
    site.consumers = [view.describe(u, modules) for u in call.consumers()]
    if site.source != "module":
        return  # a structural site's semantics come from this very graph
    meta = tensor_meta(inputs[0]) if inputs else None
    if meta is not None and meta[1].is_floating_point and dtype_name(meta[1]) != site.dtype:
        # it runs in its input's dtype, not its parameters' (norm weights kept in fp32 in a bf16 model)
        assert site.module is not None
        site.semantics = declared_semantics(site.module, meta[1]) or replace(
            site.semantics, dtype=dtype_name(meta[1])
        )
    dims = None
    if site.kind is NormKind.LAYER:
        dims = _effective_layer_norm_dims(site, call, inputs)
    if site.kind is NormKind.INSTANCE and inputs:
        r = rank(inputs[0])
        dims = tuple(range(2 - r, 0)) if r is not None else None
    if dims is not None:
        site.semantics = replace(site.semantics, normalized_dims=dims)


def _effective_layer_norm_dims(
    site: NormSite, call: ModuleCall, inputs: list[fx.Node]
) -> tuple[int, ...] | None:
    """LayerNorm subclasses that permute around the op (timm LayerNorm2d) normalize another dim."""
    for n in call.nodes:
        if op_name(n) != "layer_norm":
            continue
        x = n.args[0]
        if not isinstance(x, fx.Node) or op_name(x) != "permute" or x.args[0] not in inputs:
            return None
        # aten.permute(x, dims) and fx's Tensor.permute(x, *dims)
        perm = list(x.args[1]) if isinstance(x.args[1], list | tuple) else list(x.args[1:])
        r = len(perm)
        k = len(site.normalized_shape or ())
        return tuple(sorted(perm[d] - r for d in range(r - k, r)))
    return None


def _probe_candidates(modules: dict[str, nn.Module], sites: dict[str, NormSite]) -> None:
    """Without a whole-model graph, run each candidate module alone to see if it is a norm."""
    for i, (path, module) in enumerate(modules.items()):
        if not path or path in sites or _inside_known_norm(path, sites) or not is_norm_candidate(module):
            continue
        site = probe_module(path, module)
        if site is not None:
            site.order = i
            sites[path] = site


def probe_module(path: str, module: nn.Module) -> NormSite | None:
    """Trace ``module`` alone on a synthetic input and recognize it if its forward is one norm."""
    weight = getattr(module, "weight", None)
    width = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.ndim >= 1 else 8
    dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    for shape in ((2, 3, width), (2, width, 3, 3)):
        x = torch.randn(shape, dtype=dtype, device=device)
        captured = capture_graph(module, (x,))
        if not captured.ok:
            continue
        view = GraphView(captured)
        matches = find_norm_patterns(view, module)
        if len(matches) != 1:
            continue
        ops = [n for n in view.nodes if n.op in ("call_function", "call_method", "call_module")]
        covered = set(matches[0].nodes)
        if all(n in covered or op_name(n) in CAST_OPS or op_name(n) in CHECK_OPS for n in ops):
            cls = type(module)
            return NormSite(
                path=path,
                source="structural",
                semantics=_semantics_from_match(matches[0], view, module),
                class_name=f"{cls.__module__}.{cls.__qualname__}",
                module=module,
                training=module.training,
            )
    return None
