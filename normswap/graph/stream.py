"""Residual streams whose mean no reader sees, and the parameters that write into them.

A LayerNorm over the last dim is blind to the mean of its input across that dim. In a pre-LN
transformer every reader of the residual stream is such a LayerNorm, so the stream's mean never reaches
the output. Subtract the mean from every value written into the stream (embedding rows, positional
embeddings, class tokens, the output projections of attention and MLP, a patch-embedding conv) and the
model computes the same function, while each LayerNorm now sees zero-mean inputs, where it equals an
RMSNorm (Jiang et al., "Pre-RMSNorm and Pre-CRMSNorm Transformers", NeurIPS 2023).

:func:`close_stream` answers, on a captured graph and starting from a LayerNorm's input: which values
must be zero-mean along the hidden dim (the "stream"), which parameters must be centered to make them
so — or why it cannot be done, as a sentence for a person.

The stream is closed in both directions. Backwards, a value is zero-mean if it is a sum of zero-mean
values, a reshaping/selection that keeps the hidden dim whole, or written by a linear map whose weight
(and bias) can be centered. Forwards, every reader of a stream value must be a mean-blind LayerNorm or
itself part of the stream (a residual add, a dropout, a permute...); anything else would see the
change.

A refusal says whether the graph shows the stream cannot be recentered (a reader that sees the mean, a
normalized value or a nonlinearity written into the stream: a post-LN layout, ``Stream.limit`` False)
or normswap could not tell (a shape it does not know, an op or a form of the hidden dim it does not
follow: ``Stream.limit`` True). Only the first is the model's architecture; after the second an exact
route may well exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from normswap.graph.analysis import GraphView
from normswap.graph.ops import CAST_OPS, arg, op_name, real_users, reduce_dims, tensor_meta

# Ops that pass a value through unchanged (or cast it), in either direction.
_IDENTITY_OPS = CAST_OPS | {"detach", "lift_fresh_copy", "dropout", "identity"}
_RESHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"})
_SUM_OPS = frozenset({"add", "sub"})
_SCALE_OPS = frozenset({"mul", "div"})
_NORM_OPS = frozenset({"layer_norm", "rms_norm", "batch_norm", "group_norm", "instance_norm"})
# Nonlinear ops: what they output has a mean no centering of the parameters before them controls, and
# what they read they see whole. One of them writing or reading the stream rules recentering out.
_NONLINEAR_OPS = frozenset(
    {
        "relu", "relu6", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu", "softplus",
        "hardtanh", "hardswish", "hardsigmoid", "tanh", "sigmoid", "glu", "softmax", "_softmax",
        "log_softmax", "exp", "log", "sqrt", "rsqrt", "reciprocal", "pow", "square", "abs", "sign",
        "clamp", "clamp_min", "clamp_max", "erf", "sin", "cos",
    }
)  # fmt: skip
# Ops that read every feature of a value (a linear map over the hidden dim, a statistic of it): a
# stream value read by one sees its mean.
_READS_FEATURES_OPS = frozenset(
    {
        "linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d",
        "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "scaled_dot_product_attention", "var", "std", "var_mean", "std_mean", "amax", "amin", "max",
        "min", "norm", "linalg_vector_norm", "logsumexp", "argmax", "argmin",
    }
)  # fmt: skip


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


class _Refused(Exception):
    """Why the stream cannot be recentered. ``limit``: normswap cannot tell (an unknown shape, an op or a
    form it does not follow), rather than the graph showing that it cannot be done."""

    def __init__(self, reason: str, *, limit: bool) -> None:
        super().__init__(reason)
        self.limit = limit


def _shape(node: object) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    meta = tensor_meta(node)
    return meta[0] if meta else None


def _map_reshape(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> int | None:
    """Where dim ``d`` of ``src`` lands in ``dst`` when a reshape keeps it whole, else None.

    A dim survives a reshape intact when the product of the dims before it, and its own size, are the
    same on both sides.
    """
    before, size = math.prod(src[:d]), src[d]
    for i, s in enumerate(dst):
        if s == size and math.prod(dst[:i]) == before:
            return i
    return None


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _transposed_param(view: GraphView, node: object) -> fx.Node | None:
    """The 2-D parameter ``node`` is the transpose of (``W.t()``, ``W.T``, ``W.transpose(0, 1)``), if any."""
    if not isinstance(node, fx.Node) or op_name(node) not in ("t", "transpose", "permute", "numpy_T"):
        return None
    source = node.args[0]
    shape = _shape(source)
    if not view.is_param(source) or shape is None or len(shape) != 2:
        return None
    if op_name(node) == "permute" and [d % 2 for d in arg(node, 1, "dims")] != [1, 0]:
        return None
    return source  # type: ignore[return-value]


def _reads_as_input(user: fx.Node, value: fx.Node) -> bool:
    """A norm op reads ``value`` as the tensor it normalizes, not as its weight or bias."""
    if user.op == "call_function" and op_name(user) == "layer_norm":
        return bool(user.args) and user.args[0] is value
    return True


class _StreamBuilder:
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

    def in_norm(self, node: fx.Node) -> bool:
        """The value is computed by a norm (a mean-blind LayerNorm, or an fx leaf norm module)."""
        if node in self.mean_blind:
            return True
        module = self.modules.get(str(node.target)) if node.op == "call_module" else None
        return module is not None and "norm" in type(module).__name__.lower()

    def passes_through(self, node: fx.Node) -> bool:
        """The op returns its input unchanged (an eval-mode dropout, a cast, an identity module)."""
        if op_name(node) == "dropout":
            return not arg(node, 2, "train", False)
        return op_name(node) in _IDENTITY_OPS or self.identity_module(node)

    def identity_module(self, node: fx.Node) -> bool:
        """An fx leaf call of a module that passes its input through in eval mode."""
        if node.op != "call_module":
            return False
        module = self.modules.get(str(node.target))
        return isinstance(module, (nn.Identity, nn.Dropout)) and not (
            module.training and isinstance(module, nn.Dropout)
        )

    def add(self, node: fx.Node, d: int) -> None:
        assert self.stream is not None
        known = self.stream.nodes.get(node)
        if known is None:
            self.stream.nodes[node] = d
            self.work.append(node)
        elif known != d:
            raise _Refused(
                f"{self.describe(node)} carries the hidden dim at two positions ({known}, {d})", limit=True
            )

    def build(self, seed: fx.Node) -> Stream:
        shape = _shape(seed)
        if not shape:
            return Stream(
                hidden=0, reason="the graph records no shapes (no example inputs to export with)", limit=True
            )
        self.stream = Stream(hidden=shape[-1])
        try:
            self.add(seed, len(shape) - 1)
            while self.work:
                node = self.work.pop()
                self.backward(node, self.stream.nodes[node])
                self.forward(node, self.stream.nodes[node])
            self.finish()
        except _Refused as exc:
            self.stream.reason = str(exc)
            self.stream.limit = exc.limit
        return self.stream

    # -- backwards: how is this value made, and can it be made zero-mean?
    def backward(self, node: fx.Node, d: int) -> None:
        name = op_name(node)
        shape = _shape(node)
        if self.view.is_param(node):
            self.write_param(node, d, "direct", self.view.innermost_path(node))
            return
        if node.op == "placeholder":
            raise _Refused(
                f"graph input {node.name} is written into the residual stream as it is", limit=False
            )
        if shape is None:
            raise _Refused(f"shape of {self.describe(node)} is unknown", limit=True)
        if self.writer(node, name, d, shape):
            return
        if self.identity_module(node):
            self.add(node.args[0], d)
        elif name in _IDENTITY_OPS:
            if name == "dropout" and arg(node, 2, "train", False):
                raise _Refused(f"{self.describe(node)} is a dropout in training mode", limit=False)
            self.add(node.args[0], d)
        elif name in _SUM_OPS:
            for operand in node.args[:2]:
                self.sum_operand(node, operand, d, shape)
            alpha = node.kwargs.get("alpha", 1)
            if not isinstance(alpha, (int, float)):
                raise _Refused(f"{self.describe(node)} has a tensor alpha", limit=True)
        elif name in _SCALE_OPS or name == "neg":
            self.scaled(node, d, shape)
        elif name in _RESHAPE_OPS:
            src = node.args[0]
            d_in = _map_reshape(shape, _shape(src) or (), d)
            if d_in is None:
                raise _Refused(f"{self.describe(node)} splits or merges the hidden dim", limit=True)
            self.add(src, d_in)
        elif name in ("permute", "transpose", "t", "expand", "select", "slice", "cat", "mean", "sum"):
            self.layout(node, name, d, shape)
        elif name in _NORM_OPS or self.in_norm(node):
            raise _Refused(
                f"the output of {self.describe(node)} is written into the residual stream (a post-LN block): "
                "a normalized value cannot be recentered through parameters",
                limit=False,
            )
        elif name in _NONLINEAR_OPS:
            raise _Refused(
                f"{self.describe(node)} ({name}) writes into the residual stream and is not a linear map "
                "whose weights can be centered",
                limit=False,
            )
        else:
            # an op this analysis does not model (torch.roll, a gather, an unrecognized linear map...):
            # it may well keep the stream zero-mean, but normswap cannot tell
            raise _Refused(
                f"{self.describe(node)} ({name or node.op}) writes into the residual stream, and normswap "
                "does not know whether it keeps the stream's mean zero",
                limit=True,
            )

    def sum_operand(self, node: fx.Node, operand: object, d: int, shape: tuple[int, ...]) -> None:
        if isinstance(operand, (int, float)):
            if operand != 0:
                raise _Refused(
                    f"{self.describe(node)} adds the constant {operand} to the stream", limit=False
                )
            return
        if not isinstance(operand, fx.Node):
            raise _Refused(f"{self.describe(node)} has an operand of unknown kind", limit=True)
        op_shape = _shape(operand)
        if op_shape is None:
            raise _Refused(f"shape of {self.describe(operand)} is unknown", limit=True)
        d_op = d - (len(shape) - len(op_shape))
        if d_op < 0 or op_shape[d_op] != shape[d]:
            # broadcast along the hidden dim: the same value added to every feature is pure mean
            raise _Refused(
                f"{self.describe(node)} adds {self.describe(operand)}, which is constant across the hidden dim",
                limit=False,
            )
        self.add(operand, d_op)

    def scaled(self, node: fx.Node, d: int, shape: tuple[int, ...]) -> None:
        """A product keeps zero mean when only one factor varies along the hidden dim."""
        operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        full = []
        for operand in operands:
            op_shape = _shape(operand)
            if op_shape is None:
                raise _Refused(f"shape of {self.describe(operand)} is unknown", limit=True)
            d_op = d - (len(shape) - len(op_shape))
            if d_op >= 0 and op_shape[d_op] != 1:
                full.append((operand, d_op))
        name = op_name(node)
        if len(full) == 2 and name == "mul" and self.fold_scale(node, full, d):
            return
        if len(full) != 1 or (name == "div" and full[0][0] is not node.args[0]):
            raise _Refused(
                f"{self.describe(node)} scales the stream by a per-feature factor that cannot be folded "
                "into the layer before it",
                limit=False,
            )
        self.add(*full[0])

    def fold_scale(self, node: fx.Node, full: list[tuple[fx.Node, int]], d: int) -> bool:
        """LayerScale: ``gamma * writer(x)`` with gamma a parameter read only here and a linear writer
        read only by this product. Folding gamma into the writer's weight and bias makes the product a
        plain writer, which is then centered; gamma becomes ones."""
        assert self.stream is not None
        scales = [(a, da) for a, da in full if self.view.is_param(a) and len(real_users(a)) == 1]
        if len(scales) != 1:
            return False
        scale, d_scale = scales[0]
        scale_shape = _shape(scale) or ()
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
        value_shape = _shape(writer)
        if found is None or value_shape is None:
            return False
        want, params = found
        d_value = d - (len(_shape(node) or ()) - len(value_shape))
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

    def layout(self, node: fx.Node, name: str | None, d: int, shape: tuple[int, ...]) -> None:
        src = node.args[0]
        if name == "cat":
            dim = _norm_dim(arg(node, 1, "dim", 0), len(shape))
            if dim == d:
                # zero-mean parts make a zero-mean whole, but the parts do not have the hidden size
                raise _Refused(f"{self.describe(node)} concatenates along the hidden dim", limit=True)
            for part in src:
                self.add(part, d)
            return
        src_shape = _shape(src)
        if src_shape is None:
            raise _Refused(f"shape of {self.describe(src)} is unknown", limit=True)
        if name == "permute":
            self.add(src, list(arg(node, 1, "dims"))[d] % len(src_shape))
        elif name in ("transpose", "t"):
            a, b = (
                (0, 1)
                if name == "t"
                else (_norm_dim(node.args[1], len(shape)), _norm_dim(node.args[2], len(shape)))
            )
            self.add(src, b if d == a else a if d == b else d)
        elif name == "expand":
            d_in = d - (len(shape) - len(src_shape))
            if d_in < 0 or src_shape[d_in] != shape[d]:
                raise _Refused(
                    f"{self.describe(node)} broadcasts one value across the hidden dim", limit=False
                )
            self.add(src, d_in)
        elif name == "select":
            dim = _norm_dim(node.args[1], len(src_shape))
            self.add(src, d + 1 if dim <= d else d)
        elif name == "slice":
            dim = _norm_dim(arg(node, 1, "dim", 0), len(src_shape))
            if dim == d:
                raise _Refused(f"{self.describe(node)} keeps only part of the hidden dim", limit=True)
            self.add(src, d)
        else:  # mean / sum over other dims: an average of zero-mean vectors is zero-mean
            dims = reduce_dims(node)
            if dims is None:
                raise _Refused(f"{self.describe(node)} reduces over dims that are not constant", limit=True)
            reduced = {_norm_dim(x, len(src_shape)) for x in dims} or set(range(len(src_shape)))
            kept = (
                list(range(len(src_shape)))
                if arg(node, 2, "keepdim", False)
                else [i for i in range(len(src_shape)) if i not in reduced]
            )
            if kept[d] in reduced:
                raise _Refused(f"{self.describe(node)} reduces over the hidden dim", limit=False)
            self.add(src, kept[d])

    def writer(self, node: fx.Node, name: str | None, d: int, shape: tuple[int, ...]) -> bool:
        """Record the parameters of a linear map that writes ``node``; False if ``node`` is not one."""
        found = self._writer_params(node, name)
        if found is None:
            return False
        want, params = found
        if d != (want if want >= 0 else len(shape) + want):
            raise _Refused(
                f"{self.describe(node)} ({name or node.op}) writes the hidden dim from its dim {d}, "
                "not from its output features",
                limit=True,
            )
        if self._groups(node, name) != 1:
            # centering a grouped conv's weight over all output channels does not center its output
            raise _Refused(
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
                    raise _Refused(
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

    def write_param(self, node: fx.Node, dim: int, via: str, path: str) -> None:
        self.write_param_name(self.view.param_name(node), dim, via, path, node)

    def write_param_name(
        self, name: str | None, dim: int, via: str, path: str, node: fx.Node | None, scale: str | None = None
    ) -> None:
        assert self.stream is not None and name is not None
        tensor = self.tensors.get(name)
        shape = tuple(tensor.shape) if tensor is not None else _shape(node)
        if shape is not None and dim < 0:
            dim += len(shape)
        if shape is None or not 0 <= dim < len(shape) or shape[dim] != self.stream.hidden:
            raise _Refused(f"parameter {name} does not have the hidden size along dim {dim}", limit=True)
        for other in self.stream.params:
            if other.name == name and (other.dim, other.scale) != (dim, scale):
                raise _Refused(
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
                    raise _Refused(
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

    # -- forwards: who reads this value, and do they all not care about its mean?
    def forward(self, node: fx.Node, d: int) -> None:
        shape = _shape(node)
        for user in real_users(node):
            if user in self.stream.nodes:  # type: ignore[union-attr]
                continue
            if user in self.mean_blind and _reads_as_input(user, node):
                if shape is None or d != len(shape) - 1:
                    raise _Refused(
                        f"{self.describe(user)} normalizes the stream over another dim", limit=False
                    )
                continue
            if user.op == "output":
                raise _Refused(
                    f"{self.describe(node)} is an output of the model, which would see its mean", limit=False
                )
            d_out = self.forward_dim(user, node, d, shape)
            if d_out is None:
                what = f"{self.describe(node)} is read by {self.describe(user)} ({op_name(user) or user.op})"
                if self.sees_mean(user, d, shape):
                    raise _Refused(f"{what}, which would see its mean", limit=False)
                raise _Refused(
                    f"{what}, and normswap does not know whether that reader sees the stream's mean",
                    limit=True,
                )
            self.add(user, d_out)

    def sees_mean(self, user: fx.Node, d: int, shape: tuple[int, ...] | None) -> bool:
        """``user``, which is not part of the stream, is known to see the mean of the stream value it
        reads (hidden dim ``d``): a linear map, a nonlinearity, another norm, a statistic, or a
        selection or reduction of the hidden dim. False where normswap does not know the op, or not
        what it does to the hidden dim (a reshape that splits it, a concatenation along it, an
        unknown shape)."""
        if user.op == "call_module":
            module = self.modules.get(str(user.target))
            linear = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
            return isinstance(module, linear) or self.in_norm(user)
        name = op_name(user)
        if name in _NONLINEAR_OPS or name in _READS_FEATURES_OPS or name in _NORM_OPS:
            return True
        if shape is None or _shape(user) is None:
            return False
        if name in ("select", "slice"):  # reads some features only
            return True
        if name in ("mean", "sum"):  # over the hidden dim (forward_dim followed any other)
            return reduce_dims(user) is not None
        return False

    def forward_dim(self, user: fx.Node, src: fx.Node, d: int, shape: tuple[int, ...] | None) -> int | None:
        """The hidden dim of ``user``'s output if ``user`` is part of the stream, else None."""
        name = op_name(user)
        out = _shape(user)
        if out is None or shape is None:
            return None
        if self.identity_module(user):
            return d
        if name in _IDENTITY_OPS or name in _SUM_OPS or name in _SCALE_OPS or name in ("neg", "expand"):
            d_out = d + len(out) - len(shape)
            return d_out if out[d_out] == shape[d] else None
        if name in _RESHAPE_OPS:
            return _map_reshape(shape, out, d)
        if name == "permute":
            return [_norm_dim(x, len(out)) for x in arg(user, 1, "dims")].index(d)
        if name in ("transpose", "t"):
            a, b = (
                (0, 1)
                if name == "t"
                else (_norm_dim(user.args[1], len(out)), _norm_dim(user.args[2], len(out)))
            )
            return b if d == a else a if d == b else d
        if name == "select":
            dim = _norm_dim(user.args[1], len(shape))
            return None if dim == d else d - 1 if dim < d else d
        if name == "slice":
            return None if _norm_dim(arg(user, 1, "dim", 0), len(shape)) == d else d
        if name == "cat":
            return None if _norm_dim(arg(user, 1, "dim", 0), len(out)) == d else d
        if name in ("mean", "sum"):
            dims = reduce_dims(user)
            if dims is None:
                return None
            dims = tuple(_norm_dim(x, len(shape)) for x in dims) or tuple(range(len(shape)))
            if d in dims:
                return None
            return d if bool(arg(user, 2, "keepdim", False)) else d - sum(1 for x in dims if x < d)
        return None


def close_stream(
    view: GraphView, seed: fx.Node, mean_blind: set[fx.Node], modules: dict[str, nn.Module]
) -> Stream:
    """The residual stream around ``seed`` (a LayerNorm's input, hidden dim last); see the module doc.

    ``mean_blind`` holds the graph nodes that read a value without seeing its mean along its last dim
    (the ops of every LayerNorm over the last dim); ``modules`` is the model's ``named_modules()``.
    """
    return _StreamBuilder(view, mean_blind, modules).build(seed)
