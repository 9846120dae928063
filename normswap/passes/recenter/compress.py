"""Pre-CRMSNorm: LayerNorm -> RMSNorm on a residual stream one dimension narrower. A graph rewrite (exact).

Recentering (:mod:`normswap.passes.recenter.layernorm`) makes every vector of a pre-LN transformer's
residual stream sum to zero, so its last coordinate is minus the sum of the others. Pre-CRMSNorm (Jiang et
al., NeurIPS 2023) stores only the first ``d - 1``: every parameter that writes into the stream keeps the
first ``d - 1`` of its centered output coordinates (an embedding's columns, a linear's output rows and
bias, a positional embedding, a class token, a patch conv's output channels), so the stream and every
residual add on it are ``d - 1`` wide; and every LayerNorm that reads it becomes a
:class:`~normswap.modules.zero_sum.ZeroSumRMSNorm`, which completes the vector (``x_d = -sum(z)``) and
normalizes it as the recentered model's RMSNorm would. What the norms return is unchanged, so nothing
after them changes.

Why on the exported graph (``Needs.EXPORTED_GRAPH``) and not by editing modules: a model's own forward
often states the stream's width in Python, which a narrower stream then breaks. HF GPT-2 computes its
output shape from the embeddings' width before the blocks run and views the final norm's output with it;
torchvision's ViT reshapes its patch embedding with the ``hidden_dim`` it stored. On the graph those
widths are constants at known positions of known nodes: the stream analysis (:mod:`normswap.graph.stream`)
gives every stream value with its hidden dim, and each ``view``/``reshape``/``expand`` of a stream value
gets ``d - 1`` where it said ``d``. A token embedding whose matrix something outside the stream also
reads (GPT-2's LM head) stays whole and tied: each lookup is followed by its centring and narrowing in the
graph. Any other centered weight read outside the stream is untied in the graph: the writer's uses read a
new, centered and narrowed parameter, under the name its module gives it; the other reader the original.

A stream is narrowed whole or not at all: every LayerNorm that reads it is converted, or none, with the
stream's reason. Since the graph may hold ops the analysis passes through but that still state a width
(a ``new_zeros`` of the stream's shape), the narrowing is tried first on a copy of the graph and run on
the example inputs; an error is the refusal. The result is then checked like every exact rewrite.

What it saves is one output row of every writer (about ``1/d`` of their parameters and multiply-adds)
and one column of every residual add; what it costs is a sum and a concatenation in every norm. The
result is a ``torch.fx.GraphModule``. The numbers: README.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx, nn

from normswap.graph.analysis import module_path
from normswap.graph.ops import op_name
from normswap.graph.stream import close_stream
from normswap.graph.stream_params import Stream
from normswap.modules.zero_sum import ZeroSumRMSNorm
from normswap.passes.core.base import Change, Needs, Pass, PassContext, Refusal, RewriteKind, SkipCause
from normswap.passes.core.graph_rewrite import finish_graph
from normswap.passes.recenter.writers import (
    center_along,
    named_tensors,
    stream_edits,
    tensor_aliases,
    tied_embeddings,
    under_any,
)
from normswap.verify.variants import describe_error

# Ops whose shape argument (args[1]) states the sizes of their output, hidden dim included.
_SHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "expand"})


@dataclass(frozen=True)
class CompressSite:
    path: str
    node: fx.Node  # an aten.layer_norm call


@dataclass(frozen=True)
class CompressPlan:
    site: CompressSite
    stream: int


@dataclass
class Narrowing:
    """One stream's rewrite, by node and parameter *names*, so that it applies to a copy of the graph."""

    stream: Stream
    shape_nodes: dict[str, int]  # node name -> the hidden dim of its output
    norms: list[str]  # the layer_norm nodes that read the stream
    norm_paths: dict[str, str]  # layer_norm node -> the module path it ran in


@dataclass
class CompressionState:
    narrowings: list[Narrowing] = field(default_factory=list)
    stream_of: dict[fx.Node, int] = field(default_factory=dict)  # a LayerNorm's input -> its stream
    # a LayerNorm node's name -> its stream: by name, since narrowing a stream replaces all its norms
    norm_stream: dict[str, int] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    applied: set[int] = field(default_factory=set)


def _layer_norms(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and op_name(n) == "layer_norm"]


def _over_last_dim(node: fx.Node) -> bool:
    shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
    return isinstance(shape, (list, tuple)) and len(shape) == 1


def _set_attr(gm: fx.GraphModule, name: str, value: torch.Tensor, parameter: bool) -> None:
    owner_path, _, attr = name.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if hasattr(owner, attr) and attr not in owner._parameters and attr not in owner._buffers:
        delattr(owner, attr)
    if parameter:
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))
    else:
        owner.register_buffer(attr, value)


def _free_name(gm: fx.GraphModule, wanted: str) -> str:
    names = {n for n, _ in named_tensors(gm)}
    candidate, i = wanted, 1
    while candidate in names:
        candidate, i = f"{wanted}_{i}", i + 1
    return candidate


def _within(path: str, modules: set[str]) -> bool:
    """``path`` is one of ``modules`` or inside one of them."""
    return path in modules or under_any(path, modules)


def _narrow_params(gm: fx.GraphModule, narrowing: Narrowing) -> list[str]:
    """Run the stream's recentring edits (:func:`stream_edits`) on the graph's tensors, each narrowed to
    its first d - 1 output coordinates; an untied writer's uses read a new tensor."""
    stream, keep = narrowing.stream, narrowing.stream.hidden - 1
    nodes = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    named = dict(named_tensors(gm))
    done = []
    for edit in stream_edits(stream, tensor_aliases(gm), set(), tied_embeddings(stream)):
        tensor, param = named[edit.name], edit.param
        is_parameter = isinstance(tensor, nn.Parameter)
        if edit.center_output:
            _center_rows(gm, nodes[edit.name], edit.readers, keep)
            done.append(edit.describe())
            continue
        if param is None:  # a LayerScale folded into its writer: ones, narrowed along the stream's dim
            dims = [i for i, size in enumerate(tensor.shape) if size == stream.hidden]
            _set_attr(
                gm,
                edit.name,
                torch.ones_like(tensor.detach()).narrow(dims[-1], 0, keep).clone(),
                is_parameter,
            )
            done.append(edit.describe())
            continue
        scale = named[param.scale] if param.scale else None
        value = center_along(tensor.detach(), param.dim, scale).narrow(param.dim, 0, keep).clone()
        if not edit.readers:
            _set_attr(gm, edit.name, value, is_parameter)
            done.append(edit.describe())
            continue
        # The writer's uses read a new tensor, under a name of the tied tensor that no other reader owns
        # (GPT-2: transformer.wte.weight, while lm_head.weight keeps the original).
        source = nodes[edit.name]
        writers = [u for u in source.users if not _within(module_path(u), set(edit.readers))]
        name = (
            edit.rewritten[0]
            if edit.rewritten
            else _free_name(gm, f"{param.module_path}.{edit.name.rpartition('.')[2]}".lstrip("."))
        )
        _set_attr(gm, name, value, is_parameter)
        with gm.graph.inserting_after(source):
            fresh = gm.graph.get_attr(name)
        fresh.meta = dict(source.meta)
        for user in writers:
            user.replace_input_with(source, fresh)
        done.append(
            f"{name} (dim {param.dim}, via {param.via}; untied from {edit.name}, which keeps the original)"
        )
    return done


def _center_rows(gm: fx.GraphModule, source: fx.Node, readers: frozenset[str], keep: int) -> None:
    """Each lookup of a tied embedding's matrix ``source`` outside ``readers`` centres its rows (in fp32
    for half precision, rounded once) and keeps the first ``keep``: the matrix stays whole and tied."""
    for lookup in [u for u in source.users if not _within(module_path(u), set(readers))]:
        later = list(lookup.users)
        value = lookup.meta.get("val")
        dtype = getattr(value, "dtype", torch.float32)
        half = dtype in (torch.float16, torch.bfloat16)
        ops, graph = torch.ops.aten, gm.graph
        with graph.inserting_before(lookup.next):
            wide = (
                graph.call_function(ops._to_copy.default, (lookup,), {"dtype": torch.float32})
                if half
                else lookup
            )
            mean = graph.call_function(ops.mean.dim, (wide, [-1], True))
            back = centred = graph.call_function(ops.sub.Tensor, (wide, mean))
            if half:
                back = graph.call_function(ops._to_copy.default, (centred,), {"dtype": dtype})
            narrowed = graph.call_function(ops.slice.Tensor, (back, -1, 0, keep))
        for node in {wide, mean, centred, back, narrowed} - {lookup}:
            node.meta = {k: v for k, v in lookup.meta.items() if k != "val"}
        for user in later:
            user.replace_input_with(lookup, narrowed)


def _narrow_shapes(gm: fx.GraphModule, narrowing: Narrowing) -> None:
    hidden = narrowing.stream.hidden
    for node in gm.graph.nodes:
        dim = narrowing.shape_nodes.get(node.name)
        if dim is None:
            continue
        shape = list(node.args[1])
        if shape[dim] == hidden:
            shape[dim] = hidden - 1
            node.args = (node.args[0], shape, *node.args[2:])


def _norm_module(node: fx.Node, gm: fx.GraphModule) -> ZeroSumRMSNorm:
    _, shape, weight, bias, eps = (list(node.args) + [None] * 5)[:5]
    eps = node.kwargs.get("eps", eps if eps is not None else 1e-5)
    tensors = dict(named_tensors(gm))
    w = tensors[str(weight.target)] if isinstance(weight, fx.Node) and weight.op == "get_attr" else None
    b = tensors[str(bias.target)] if isinstance(bias, fx.Node) and bias.op == "get_attr" else None
    value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    dtype = w.dtype if w is not None else getattr(value, "dtype", None)
    norm = ZeroSumRMSNorm(tuple(shape), float(eps), w is not None, b is not None, dtype=dtype)
    with torch.no_grad():
        if w is not None:
            norm.weight.copy_(w.detach())
        if b is not None:
            norm.bias.copy_(b.detach())
    return norm


def _holds_only(module: nn.Module, names: set[str]) -> bool:
    """A container export made for a norm's parameters: a plain Module holding exactly ``names``."""
    own = set(module._parameters) | set(module._buffers)
    return type(module) is nn.Module and not module._modules and own == names


def _replace_norms(gm: fx.GraphModule, narrowing: Narrowing) -> None:
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in narrowing.norms:
        node = nodes[name]
        norm = _norm_module(node, gm)
        path = narrowing.norm_paths[name]
        held = {
            t.target.rpartition(".")[2]
            for t in node.args[2:4]
            if isinstance(t, fx.Node) and t.op == "get_attr"
        }
        try:
            container = gm.get_submodule(path) if path else None
        except AttributeError:
            container = None
        if container is not None and held and _holds_only(container, held):
            # the norm takes its place: the state_dict keeps the LayerNorm's keys
            parent, _, leaf = path.rpartition(".")
            setattr(gm.get_submodule(parent) if parent else gm, leaf, norm)
            target = path
        else:
            target = _free_name(gm, (path or "norm").replace(".", "_") + "_crms")
            gm.add_submodule(target, norm)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(target, (node.args[0],))
        call.meta = {k: v for k, v in node.meta.items() if k != "val"}
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)


def _narrow(gm: fx.GraphModule, narrowing: Narrowing) -> list[str]:
    done = _narrow_params(gm, narrowing)
    _narrow_shapes(gm, narrowing)
    _replace_norms(gm, narrowing)
    return done


class CompressStream(Pass[CompressSite, CompressPlan, CompressionState]):
    """Pre-CRMSNorm on the exported graph: the residual stream d -> d - 1 wide, LayerNorms -> ZeroSumRMSNorm."""

    name: ClassVar[str] = "compress_stream"
    kind: ClassVar[RewriteKind] = RewriteKind.EXACT
    needs: ClassVar[Needs] = Needs.EXPORTED_GRAPH
    doing: ClassVar[str] = "narrowing the residual stream"
    inside_changes: ClassVar[str] = (
        "the residual stream is recentred and carried in d - 1 coordinates: hidden states inside the "
        "model are neither the original's values nor its width, and the written program returns only the "
        "outputs of the example inputs; the model's outputs are unchanged"
    )

    def prepare(self, ctx: PassContext) -> CompressionState:
        assert ctx.view is not None and isinstance(ctx.model, fx.GraphModule)
        state = CompressionState()
        norms = _layer_norms(ctx.model.graph)
        mean_blind = {n for n in norms if _over_last_dim(n)}
        readers: dict[int, list[fx.Node]] = {}
        for norm in norms:
            seed = norm.args[0]
            if not _over_last_dim(norm) or not isinstance(seed, fx.Node):
                continue
            if seed not in state.stream_of:
                stream = close_stream(ctx.view, seed, mean_blind, ctx.modules)
                index = len(state.narrowings)
                shapes = {n.name: d for n, d in stream.nodes.items() if op_name(n) in _SHAPE_OPS}
                state.narrowings.append(Narrowing(stream, shapes, [], {}))
                for node in (seed, *stream.nodes):
                    state.stream_of.setdefault(node, index)
                if stream.reason is not None:
                    state.refused[index] = stream.reason
                elif stream.hidden < 2:
                    state.refused[index] = f"it is {stream.hidden} wide: there is no dimension to drop"
            index = state.stream_of[seed]
            state.norm_stream[norm.name] = index
            state.narrowings[index].norms.append(norm.name)
            state.narrowings[index].norm_paths[norm.name] = module_path(norm)
            readers.setdefault(index, []).append(norm)
        open_streams = [i for i in readers if i not in state.refused]
        if open_streams and ctx.has_inputs:
            problem = _trial(ctx, [state.narrowings[i] for i in open_streams])
            if problem is not None:
                state.refused.update({i: problem for i in open_streams})
        return state

    def candidates(self, ctx: PassContext, state: CompressionState) -> list[CompressSite]:
        assert isinstance(ctx.model, fx.GraphModule)
        return [CompressSite(module_path(n) or n.name, n) for n in _layer_norms(ctx.model.graph)]

    def check(self, site: CompressSite, ctx: PassContext, state: CompressionState) -> CompressPlan | Refusal:
        if not _over_last_dim(site.node):
            return Refusal(
                "normalizes more than the last dim; only a LayerNorm over the last dim equals RMSNorm on a "
                "centered input",
                SkipCause.ARCHITECTURE,
            )
        index = state.norm_stream.get(site.node.name)
        if index is None:
            return Refusal("its input could not be followed in the graph", SkipCause.UNSUPPORTED)
        if index in state.refused:
            stream = state.narrowings[index].stream
            cause = SkipCause.UNSUPPORTED if stream.limit else SkipCause.ARCHITECTURE
            return Refusal(f"its residual stream cannot be narrowed: {state.refused[index]}", cause)
        return CompressPlan(site, index)

    def apply(self, plan: CompressPlan, ctx: PassContext, state: CompressionState) -> Change:
        assert isinstance(ctx.model, fx.GraphModule)
        narrowing = state.narrowings[plan.stream]
        details: dict[str, Any] = {"stream": plan.stream, "hidden": narrowing.stream.hidden, "narrowed": []}
        if plan.stream not in state.applied:
            state.applied.add(plan.stream)
            details["narrowed"] = _narrow(ctx.model, narrowing)
        hidden = narrowing.stream.hidden
        what = f"LayerNorm -> ZeroSumRMSNorm, the residual stream {hidden} -> {hidden - 1} wide"
        if details["narrowed"]:
            what += f" (centered and narrowed {len(details['narrowed'])} writer tensors)"
        return Change(self.name, plan.site.path, self.kind, what, details)


def _trial(ctx: PassContext, narrowings: list[Narrowing]) -> str | None:
    """Narrow a copy of the graph and run it on the example inputs: the error, if it does not run."""
    assert isinstance(ctx.model, fx.GraphModule)
    trial = copy.deepcopy(ctx.model)
    try:
        for narrowing in narrowings:
            _narrow(trial, narrowing)
        finish_graph(trial, ctx.model)
        with torch.no_grad():
            trial(*(ctx.example_args or ()), **(ctx.example_kwargs or {}))
    except Exception as exc:  # the graph run with a narrower stream: any error is the answer
        return f"the graph does not run one dimension narrower ({describe_error(exc)})"
    return None
