"""What :func:`normswap.graph.stream.close_stream` finds: a residual stream (:class:`Stream`) and the
parameters to center (:class:`CenteredParam`); and the part of its search that finds the linear maps
writing into the stream and records the parameters of each (a per-feature LayerScale after one is folded
into it), checking that no writer reads the stream it writes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn

from normswap.graph.analysis import GraphView
from normswap.graph.ops import CAST_OPS, arg, op_name, real_users, tensor_meta

# Ops that pass a value through unchanged (or cast it), in either direction.
IDENTITY_OPS = CAST_OPS | {"detach", "lift_fresh_copy", "dropout", "identity"}


@dataclass(frozen=True)
class CenteredParam:
    """A parameter (or buffer) to center along ``dim``: subtract its mean over that dim."""

    name: str  # qualified name as the graph knows it (export names a tied weight after one owner)
    dim: int
    module_path: str  # the module whose op writes it into the stream ("" for the root)
    via: str  # the op that writes it: "linear", "addmm", "conv2d", "embedding", or "direct"
    # A per-feature scale applied to the writer's output (LayerScale): folded into this parameter
    # (multiplied along ``dim``) before centering, and then set to ones.
    scale: str | None = None


@dataclass
class Stream:
    """One residual stream found from a LayerNorm input, or the reason it cannot be recentered."""

    hidden: int
    nodes: dict[fx.Node, int] = field(default_factory=dict)  # stream value -> its hidden dim
    params: list[CenteredParam] = field(default_factory=list)
    # Per-feature scales folded into the writer before them: set to ones after the fold.
    folded_scales: list[str] = field(default_factory=list)
    # Parameters that other, non-stream ops also read: name -> module paths of those readers.
    shared: dict[str, set[str]] = field(default_factory=dict)
    reason: str | None = None
    # The refusal is a limit of this analysis (normswap cannot tell), not a fact the graph shows.
    limit: bool = False

    @property
    def ok(self) -> bool:
        return self.reason is None


class StreamRefused(Exception):
    """Why the stream cannot be recentered. ``limit``: normswap cannot tell (an unknown shape, an op or a
    form it does not follow), rather than the graph showing that it cannot be done."""

    def __init__(self, reason: str, *, limit: bool) -> None:
        super().__init__(reason)
        self.limit = limit


def shape_of_node(node: object) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    meta = tensor_meta(node)
    return meta[0] if meta else None


def _transposed_param(view: GraphView, node: object) -> fx.Node | None:
    """The 2-D parameter ``node`` is the transpose of (``W.t()``, ``W.T``, ``W.transpose(0, 1)``), if any."""
    if not isinstance(node, fx.Node) or op_name(node) not in ("t", "transpose", "permute", "numpy_T"):
        return None
    source = node.args[0]
    shape = shape_of_node(source)
    if not view.is_param(source) or shape is None or len(shape) != 2:
        return None
    if op_name(node) == "permute" and [d % 2 for d in arg(node, 1, "dims")] != [1, 0]:
        return None
    return source  # type: ignore[return-value]


class ParamRecorder:
    """One stream search's state, and the recording of the writers' parameters; the walk over the graph
    is the stream builder of :mod:`normswap.graph.stream`, built on this."""

    def __init__(self, view: GraphView, mean_blind: set[fx.Node], modules: dict[str, nn.Module]) -> None:
        self.view = view
        self.mean_blind = mean_blind
        self.modules = modules
        self.tensors = {
            **dict(self._named(modules, "named_parameters")),
            **dict(self._named(modules, "named_buffers")),
        }
        self.param_nodes: dict[str, fx.Node] = {}
        self.writers: list[fx.Node] = []
        self.stream: Stream | None = None
        self.work: list[fx.Node] = []

    @staticmethod
    def _named(modules: dict[str, nn.Module], method: str) -> list[tuple[str, torch.Tensor]]:
        root = modules.get("")
        return list(getattr(root, method)(remove_duplicate=False)) if root is not None else []

    def describe(self, node: fx.Node) -> str:
        return self.view.describe(node)

    def passes_through(self, node: fx.Node) -> bool:
        """The op returns its input unchanged (an eval-mode dropout, a cast, an identity module)."""
        if op_name(node) == "dropout":
            return not arg(node, 2, "train", False)
        return op_name(node) in IDENTITY_OPS or self.identity_module(node)

    def identity_module(self, node: fx.Node) -> bool:
        """An fx leaf call of a module that passes its input through in eval mode."""
        if node.op != "call_module":
            return False
        module = self.modules.get(str(node.target))
        return isinstance(module, (nn.Identity, nn.Dropout)) and not (
            module.training and isinstance(module, nn.Dropout)
        )

    def fold_scale(self, node: fx.Node, full: list[tuple[fx.Node, int]], d: int) -> bool:
        """LayerScale: ``gamma * writer(x)`` with gamma a parameter read only here and a linear writer
        read only by this product. Folding gamma into the writer's weight and bias makes the product a
        plain writer, which is then centered; gamma becomes ones."""
        assert self.stream is not None
        scales = [(a, da) for a, da in full if self.view.is_param(a) and len(real_users(a)) == 1]
        if len(scales) != 1:
            return False
        scale, d_scale = scales[0]
        scale_shape = shape_of_node(scale) or ()
        if sum(1 for s in scale_shape if s != 1) != 1:
            return False
        value = next(a for a, _ in full if a is not scale)
        chain = [value]
        while self.passes_through(chain[-1]):
            chain.append(chain[-1].args[0])  # type: ignore[arg-type]
        writer = chain[-1]
        if any(len(real_users(n)) != 1 for n in chain):
            return False
        found = self._writer_params(writer, op_name(writer))
        value_shape = shape_of_node(writer)
        if found is None or value_shape is None:
            return False
        want, params = found
        d_value = d - (len(shape_of_node(node) or ()) - len(value_shape))
        if d_value != (want if want >= 0 else len(value_shape) + want):
            return False
        if self._groups(writer, op_name(writer)) != 1:
            return False
        self.writers.append(writer)
        scale_name = self.view.param_name(scale)
        path = self.view.innermost_path(writer)
        for n in chain:
            self.stream.nodes[n] = d_value  # handled here: not walked backwards as a plain writer
        for tensor, dim in params:
            if tensor is None:
                continue
            if isinstance(tensor, str):
                self.write_param_name(tensor, dim, op_name(writer) or "module", path, None, scale_name)
            elif self.view.is_param(tensor):
                name = self.view.param_name(tensor)
                self.write_param_name(name, dim, op_name(writer) or "op", path, tensor, scale_name)
            else:
                return False
        assert scale_name is not None
        self.stream.folded_scales.append(scale_name)
        self.stream.nodes[scale] = d_scale
        return True

    def writer(self, node: fx.Node, name: str | None, d: int, shape: tuple[int, ...]) -> bool:
        """Record the parameters of a linear map that writes ``node``; False if ``node`` is not one."""
        found = self._writer_params(node, name)
        if found is None:
            return False
        want, params = found
        if d != (want if want >= 0 else len(shape) + want):
            raise StreamRefused(
                f"{self.describe(node)} ({name or node.op}) writes the hidden dim from its dim {d}, "
                "not from its output features",
                limit=True,
            )
        if self._groups(node, name) != 1:
            # centering a grouped conv's weight over all output channels does not center its output
            raise StreamRefused(
                f"{self.describe(node)} is a grouped convolution writing into the stream", limit=False
            )
        self.writers.append(node)
        path = self.view.innermost_path(node)
        for tensor, dim in params:
            if isinstance(tensor, str):  # a call_module's own parameter, by qualified name
                self.write_param_name(tensor, dim, name or "module", path, None)
            elif tensor is not None:
                if not self.view.is_param(tensor):
                    # (a weight-normed or otherwise parametrized layer): normswap centers stored tensors only
                    raise StreamRefused(
                        f"{self.describe(node)} ({name}) uses a computed weight, not a parameter", limit=True
                    )
                self.write_param_name(self.view.param_name(tensor), dim, name or "op", path, tensor)
        return True

    def _groups(self, node: fx.Node, name: str | None) -> int:
        if node.op == "call_module":
            return int(getattr(self.modules.get(str(node.target)), "groups", 1))
        if name in ("conv1d", "conv2d", "conv3d"):
            groups = arg(node, 6, "groups", 1)
        elif name == "convolution":
            groups = arg(node, 8, "groups", 1)
        else:
            return 1
        return groups if isinstance(groups, int) else -1

    def _writer_params(self, node: fx.Node, name: str | None) -> tuple[int, list[tuple[object, int]]] | None:
        """(hidden dim of the output, [(weight or bias, dim to center)]) for a linear writer op."""
        if node.op == "call_module":
            module = self.modules.get(str(node.target))
            if isinstance(module, nn.Embedding):
                return -1, [(f"{node.target}.weight", 1)]
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                bias = f"{node.target}.bias" if module.bias is not None else None
                return (-1 if isinstance(module, nn.Linear) else 1), [(f"{node.target}.weight", 0), (bias, 0)]
            return None
        aten = isinstance(node.target, torch._ops.OpOverload)
        if name == "linear":
            return -1, [(node.args[1], 0), (arg(node, 2, "bias"), 0)]
        if name == "addmm":  # HF Conv1D: bias + x @ W with W stored (in, out)
            return 1, [(node.args[2], 1), (node.args[0], -1)]  # the bias may be (N, C): its last dim
        if name in ("mm", "matmul") and self.view.is_param(node.args[1]):
            return -1, [(node.args[1], 1)]
        if name in ("mm", "matmul") and _transposed_param(self.view, node.args[1]) is not None:
            # x @ W.T with W stored (out, in), as Falcon's linear layers compute it
            return -1, [(_transposed_param(self.view, node.args[1]), 0)]
        if name in ("conv1d", "conv2d", "conv3d") or (
            name == "convolution" and not arg(node, 6, "transposed")
        ):
            return 1, [(node.args[1], 0), (arg(node, 2, "bias"), 0)]
        if name == "embedding":  # aten: (weight, indices); F.embedding: (input, weight)
            return -1, [(node.args[0] if aten else arg(node, 1, "weight"), 1)]
        return None

    def write_param_name(
        self, name: str | None, dim: int, via: str, path: str, node: fx.Node | None, scale: str | None = None
    ) -> None:
        assert self.stream is not None and name is not None
        tensor = self.tensors.get(name)
        shape = tuple(tensor.shape) if tensor is not None else shape_of_node(node)
        if shape is not None and dim < 0:
            dim += len(shape)
        if shape is None or not 0 <= dim < len(shape) or shape[dim] != self.stream.hidden:
            raise StreamRefused(f"parameter {name} does not have the hidden size along dim {dim}", limit=True)
        for other in self.stream.params:
            if other.name == name and (other.dim, other.scale) != (dim, scale):
                raise StreamRefused(
                    f"parameter {name} is written into the stream in two different ways", limit=True
                )
        record = CenteredParam(name, dim, path, via, scale)
        if record not in self.stream.params:
            self.stream.params.append(record)
        if node is not None and via != "direct":
            self.param_nodes[name] = node

    def finish(self) -> None:
        """Check that no writer reads the stream (it would see the mean it loses), and record readers of
        centered weights that are not themselves stream writers (e.g. a tied head)."""
        assert self.stream is not None
        for writer in self.writers:
            for value in writer.all_input_nodes:
                if value in self.stream.nodes and not self.view.is_param(value):
                    raise StreamRefused(
                        f"{self.describe(writer)} reads the stream it writes into (x + f(x) with no norm "
                        "before f), so it sees the mean that centering removes",
                        limit=False,
                    )
        for name, node in self.param_nodes.items():
            for user in real_users(node):
                if user in self.stream.nodes or self._transpose_for_writers(user, node):
                    continue
                self.stream.shared.setdefault(name, set()).add(self.view.innermost_path(user))

    def _transpose_for_writers(self, user: fx.Node, param: fx.Node) -> bool:
        """``user`` is ``param.t()`` read only by stream writers (x @ W.T): part of those writers."""
        assert self.stream is not None
        return _transposed_param(self.view, user) is param and all(
            u in self.stream.nodes for u in real_users(user)
        )
