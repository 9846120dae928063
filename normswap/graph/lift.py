"""Turn the flat graph of a loaded ``.pt2`` back into modules that passes can edit.

``ExportedProgram.module()`` keeps every parameter at its original path but calls ``aten.conv2d``,
``aten.batch_norm``, ``aten.layer_norm``... with ``get_attr`` nodes instead of calling ``nn.Conv2d`` etc.
For each such call whose parameters belong to one module path and to that call alone, this puts a real
torch.nn module at that path (holding the very same Parameter and buffer objects, so state_dict keys and
values are unchanged) and replaces the op node by a ``call_module`` node. The function is unchanged;
afterwards, module-level passes (fold BN, swap a norm) work on a ``.pt2`` as on an eager model.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx, nn

from normswap.graph.analysis import module_path
from normswap.graph.ops import BESIDE_NORM_OPS, arg, op_name

_CONV = {"conv1d": nn.Conv1d, "conv2d": nn.Conv2d, "conv3d": nn.Conv3d}
_BN_BY_RANK = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


# ops whose input is not their first argument (aten.embedding(weight, indices, ...))
_INPUT_POSITION = {"embedding": 1, "addmm": 1}


def _input_of(node: fx.Node) -> object:
    return node.args[_INPUT_POSITION.get(op_name(node) or "", 0)]


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    """The op's tensor operands other than its input: the parameters a module would hold."""
    source = _input_of(node)
    return [a for a in node.args if isinstance(a, fx.Node) and a is not source]


def _owner_of(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The module path owning every get_attr operand of ``node`` if that is all the module holds."""
    attrs = _tensor_args(node)
    if not attrs or any(a.op != "get_attr" or len(a.users) != 1 for a in attrs):
        return None
    prefixes = {str(a.target).rpartition(".")[0] for a in attrs}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    if not prefix:
        return None
    try:
        holder = gm.get_submodule(prefix)
    except AttributeError:
        return None
    held = {f"{prefix}.{n}" for n, _ in holder.named_parameters(recurse=False)}
    held |= {f"{prefix}.{n}" for n, _ in holder.named_buffers(recurse=False)}
    if list(holder.children()) or type(holder) is not nn.Module:
        return None
    used = {str(a.target) for a in attrs}
    # num_batches_tracked is carried over by BatchNorm without being an operand of the op
    if not held - {f"{prefix}.num_batches_tracked"} <= used:
        return None
    return prefix


def _computes_more(scope: list[fx.Node], norm: fx.Node) -> bool:
    """Whether the module that ran ``norm`` computed more than the norm in its own forward (``ScaledLN``:
    ``super().forward(x) * 0.5 + tanh(x)``). Lifted, that module would stand for the whole forward and
    a pass would read every op of its scope as the norm; kept an op, it is a norm call inside a forward.
    The same list of ops as discovery's rule (:mod:`normswap.discover.own_forward`)."""
    return any(n is not norm and op_name(n) not in BESIDE_NORM_OPS for n in scope)


def _get(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        *path, name = str(node.target).split(".")
        return getattr(gm.get_submodule(".".join(path)), name)
    return None


def _set_tensors(module: nn.Module, holder: nn.Module, names: dict[str, torch.Tensor | None]) -> None:
    for name, value in names.items():
        if value is None:
            continue
        if isinstance(value, nn.Parameter):
            setattr(module, name, value)
        else:
            module._buffers[name] = value
    tracked = holder._buffers.get("num_batches_tracked")
    if tracked is not None and "num_batches_tracked" in module._buffers:
        module._buffers["num_batches_tracked"] = tracked


def layer_of(n: fx.Node, weight_shape: torch.Size, bias: bool) -> nn.Module:
    """The torch.nn Conv1d/2d/3d or Linear (on the meta device) that the aten conv or linear call ``n``
    with a weight of ``weight_shape`` is."""
    if op_name(n) == "linear":
        return nn.Linear(weight_shape[1], weight_shape[0], bias=bias, device="meta")
    groups = int(arg(n, 6, "groups", 1))
    return _CONV[op_name(n)](
        weight_shape[1] * groups,
        weight_shape[0],
        tuple(weight_shape[2:]),
        stride=arg(n, 3, "stride", 1),
        padding=arg(n, 4, "padding", 0),
        dilation=arg(n, 5, "dilation", 1),
        groups=groups,
        bias=bias,
        device="meta",
    )


def _layer(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    w, b = _get(gm, arg(n, 1, "weight")), _get(gm, arg(n, 2, "bias"))
    if w is None:
        return None
    m = layer_of(n, w.shape, b is not None)
    _set_tensors(m, holder, {"weight": w, "bias": b})
    return m


def _embedding(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    w = _get(gm, arg(n, 0, "weight"))
    padding_idx, scale_grad, sparse = (
        arg(n, 2, "padding_idx", -1),
        arg(n, 3, "scale_grad_by_freq", False),
        arg(n, 4, "sparse", False),
    )
    if (
        w is None
        or w.ndim != 2
        or not all(isinstance(v, (int, bool)) for v in (padding_idx, scale_grad, sparse))
    ):
        return None
    # aten says "no padding row" with -1; nn.Embedding with None (its -1 is the last row)
    padding = None if padding_idx == -1 else padding_idx
    m = nn.Embedding(
        w.shape[0], w.shape[1], padding, scale_grad_by_freq=scale_grad, sparse=sparse, device="meta"
    )
    _set_tensors(m, holder, {"weight": w})
    return m


_HF_CONV1D = "transformers.pytorch_utils.Conv1D"


def _hf_conv1d(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    """``addmm(b, x.view(-1, nx), w)`` that a Hugging Face ``Conv1D`` ran (GPT-2's projections, weight
    ``(nx, nf)``) -> that class again, holding the same tensors: it runs exactly these ops, and passes know
    it as a layer (a fold into its weight) where a bare ``addmm`` is only an op."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack or list(stack.values())[-1][1] != _HF_CONV1D or n.kwargs:  # beta/alpha: not Conv1D's
        return None
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    w, b = _get(gm, arg(n, 2, "mat2")), _get(gm, arg(n, 0, "self"))
    if w is None or b is None or w.ndim != 2 or tuple(b.shape) != (w.shape[1],):
        return None
    with torch.device("meta"):
        m = Conv1D(w.shape[1], w.shape[0])
    _set_tensors(m, holder, {"weight": w, "bias": b})
    return m


def _conv1d_io(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(x, the output view) when ``addmm`` reads ``x.view(-1, nx)`` alone and its one reader views it as
    ``x.shape[:-1] + (nf,)``: what ``Conv1D.forward`` computes from ``x``."""
    flat, readers = node.args[1], list(node.users)
    if not isinstance(flat, fx.Node) or op_name(flat) != "view" or len(flat.users) != 1 or len(readers) != 1:
        return None
    x, out = flat.args[0], readers[0]
    if not isinstance(x, fx.Node) or op_name(out) != "view":
        return None
    vals = [v.meta.get("val") for v in (x, flat, node, out)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    x_val, flat_val, mm_val, out_val = vals
    if flat_val.ndim != 2 or flat_val.shape[1] != x_val.shape[-1]:
        return None
    if tuple(out_val.shape) != (*x_val.shape[:-1], mm_val.shape[-1]):
        return None
    return x, out


def _batch_norm(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    x = n.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    cls = _BN_BY_RANK.get(val.ndim) if isinstance(val, torch.Tensor) else None
    w, b = _get(gm, arg(n, 1, "weight")), _get(gm, arg(n, 2, "bias"))
    mean, var = _get(gm, arg(n, 3, "running_mean")), _get(gm, arg(n, 4, "running_var"))
    if cls is None or mean is None or var is None or bool(arg(n, 5, "training", False)):
        return None
    m = cls(
        mean.shape[0],
        eps=float(arg(n, 7, "eps", 1e-5)),
        momentum=arg(n, 6, "momentum", 0.1),
        affine=w is not None,
        device="meta",
    )
    _set_tensors(m, holder, {"weight": w, "bias": b, "running_mean": mean, "running_var": var})
    if "num_batches_tracked" not in holder._buffers:
        m._buffers["num_batches_tracked"] = torch.tensor(0, dtype=torch.long, device=mean.device)
    return m.eval()


def _layer_norm(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    shape = tuple(arg(n, 1, "normalized_shape"))
    w, b = _get(gm, arg(n, 2, "weight")), _get(gm, arg(n, 3, "bias"))
    m = nn.LayerNorm(
        shape,
        eps=float(arg(n, 4, "eps", 1e-5)),
        elementwise_affine=w is not None,
        bias=b is not None,
        device="meta",
    )
    _set_tensors(m, holder, {"weight": w, "bias": b})
    return m


def _group_norm(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    w, b = _get(gm, arg(n, 2, "weight")), _get(gm, arg(n, 3, "bias"))
    if w is None:
        return None
    m = nn.GroupNorm(
        int(arg(n, 1, "num_groups")),
        w.shape[0],
        eps=float(arg(n, 4, "eps", 1e-5)),
        affine=True,
        device="meta",
    )
    _set_tensors(m, holder, {"weight": w, "bias": b})
    return m if b is not None else None


def _rms_norm(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    shape = tuple(arg(n, 1, "normalized_shape"))
    w = _get(gm, arg(n, 2, "weight"))
    m = nn.RMSNorm(shape, eps=arg(n, 3, "eps"), elementwise_affine=w is not None, device="meta")
    _set_tensors(m, holder, {"weight": w})
    return m


def _fused_norm(gm: fx.GraphModule, n: fx.Node, holder: nn.Module) -> nn.Module | None:
    """``normswap::{rms,layer}_norm_fwd(x, weight, bias, eps, casting, weight_offset)`` -> a fused module."""
    from normswap.modules.fused import FusedLayerNorm, FusedRMSNorm

    w, b = _get(gm, arg(n, 1, "weight")), _get(gm, arg(n, 2, "bias"))
    if w is None:  # the normalized shape is the weight's
        return None
    cls = FusedRMSNorm if op_name(n) == "rms_norm_fwd" else FusedLayerNorm
    m = cls(
        tuple(w.shape),
        eps=float(arg(n, 3, "eps")),
        elementwise_affine=True,
        bias=b is not None,
        casting=str(arg(n, 4, "casting")),
        weight_offset=float(arg(n, 5, "weight_offset")),
        device="meta",
    )
    _set_tensors(m, holder, {"weight": w, "bias": b})
    return m


def _channel_wrap(node: fx.Node, output: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(input, back-permute, channel dim) when a norm op normalizes ``x.movedim(d, -1)`` and its only
    reader moves the dim back: the layout that timm's and torchvision's LayerNorm2d, and normswap's
    channel norms (fused or not), export to."""
    plain = op_name(node) in ("layer_norm", "rms_norm")
    if op_name(node) not in _TUPLE_OPS and not plain:
        return None
    if plain and len(arg(node, 1, "normalized_shape")) != 1:
        return None  # over C and more: no one channel dim
    moved, readers = node.args[0], list(output.users)
    if not isinstance(moved, fx.Node) or len(moved.users) != 1 or len(readers) != 1:
        return None
    perm, back = _as_permutation(moved), _as_permutation(readers[0])
    if perm is None or back is None:
        return None
    rank, dim = len(perm), perm[-1]
    if dim == rank - 1 or perm != [i for i in range(rank) if i != dim] + [dim]:
        return None
    if back != sorted(range(rank), key=perm.__getitem__):
        return None
    if plain and (rank, dim) != (4, 1):
        return None  # a plain norm: LayerNorm2d's NCHW only, the layout swaps read as channels first
    return moved.args[0], readers[0], dim - rank  # type: ignore[return-value]


def _as_permutation(node: fx.Node) -> list[int] | None:
    """The dims order of a ``permute`` or ``movedim`` node (its input's rank read from the graph)."""
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    rank = val.ndim
    if op_name(node) == "permute":
        dims = node.args[1] if isinstance(node.args[1], list | tuple) else node.args[1:]
        return [d % rank for d in dims]  # type: ignore[union-attr]
    if op_name(node) == "movedim" and all(isinstance(d, int) for d in node.args[1:3]):
        src, dst = node.args[1] % rank, node.args[2] % rank  # type: ignore[operator]
        order = [i for i in range(rank) if i != src]
        order.insert(dst, src)
        return order
    return None


def _channel_module(module: nn.Module, channel_dim: int) -> nn.Module:
    """``module`` (lifted from the op) over dim ``channel_dim``: a fused op's fused channel norm, torch's
    LayerNorm or RMSNorm as normswap's plain channel norm over the same Parameters."""
    from normswap.modules.fused import FusedChannelLayerNorm, FusedChannelRMSNorm, FusedNorm
    from normswap.modules.norms import ChannelLayerNorm, ChannelRMSNorm, RMSNorm

    if isinstance(module, FusedNorm):
        cls = FusedChannelRMSNorm if isinstance(module, RMSNorm) else FusedChannelLayerNorm
        return cls.from_channel_norm(module, None, channel_dim)
    plain: nn.Module
    if isinstance(module, nn.LayerNorm):
        plain = ChannelLayerNorm(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            module.bias is not None,
            device="meta",
        )
        plain.bias = module.bias
    else:
        assert isinstance(module, nn.RMSNorm)
        plain = ChannelRMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
    plain.weight, plain.channel_dim = module.weight, channel_dim
    return plain


def _normalized_output(node: fx.Node) -> fx.Node | None:
    """For an op returning ``(y, statistics...)``: the ``getitem(node, 0)`` node, if nothing else is read."""
    items = list(node.users)
    if not all(u.op == "call_function" and u.target is operator.getitem for u in items):
        return None
    if any(u.args[1] != 0 and u.users for u in items):
        return None  # statistics are read (a training graph): the module would not return them
    firsts = [u for u in items if u.args[1] == 0]
    return firsts[0] if len(firsts) == 1 else None


# ops that return (normalized, statistics...) rather than the normalized value alone
_TUPLE_OPS = frozenset({"rms_norm_fwd", "layer_norm_fwd"})
_NORM_OPS = frozenset({"batch_norm", "layer_norm", "group_norm", "rms_norm", *_TUPLE_OPS})

_BUILDERS: dict[str, Callable[[fx.GraphModule, fx.Node, nn.Module], nn.Module | None]] = {
    "conv1d": _layer,
    "conv2d": _layer,
    "conv3d": _layer,
    "linear": _layer,
    "embedding": _embedding,
    "addmm": _hf_conv1d,
    "batch_norm": _batch_norm,
    "layer_norm": _layer_norm,
    "group_norm": _group_norm,
    "rms_norm": _rms_norm,
    "rms_norm_fwd": _fused_norm,
    "layer_norm_fwd": _fused_norm,
}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are one tensor's values in one memory (a tied weight the program holds twice)."""
    if a.is_meta or b.is_meta or a.device != b.device or a.numel() == 0:
        return False  # a meta tensor has no memory to compare (nor an empty one): ties not known here
    return (a.dtype, a.shape, a.stride(), a.storage_offset()) == (
        b.dtype,
        b.shape,
        b.stride(),
        b.storage_offset(),
    ) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _read_tied_weights_by_owner(gm: fx.GraphModule) -> bool:
    """Each module's ops read a tied weight under that module's own name, which is made one tensor again.

    A program holds a tied weight once and reads it under one name in every module (an exported GPT-2's
    token embedding reads ``lm_head.weight``), while ``ExportedProgram.module()`` gives each name its own
    Parameter over the one memory. Passes see a module's weight by its name and ties by identity: the
    untie that recentring a GPT-2 needs gives the embedding its own centred weight and must not move the
    head's. So each use in a module that holds the same memory under its own name reads that name, and
    the two names hold one Parameter, as in the model that was exported. Whether anything changed.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or len(node.users) < 2:
            continue
        tensor = _get(gm, node)
        if not isinstance(tensor, torch.Tensor):
            continue
        owner, _, leaf = str(node.target).rpartition(".")
        for user in list(node.users):
            path = module_path(user)
            if path == owner or not path:
                continue
            try:
                holder = gm.get_submodule(path)
            except AttributeError:
                continue
            held = [*holder.named_parameters(recurse=False), *holder.named_buffers(recurse=False)]
            same = sorted((name != leaf, name) for name, t in held if _same_memory(t, tensor))
            if not same:
                continue
            name = same[0][1]
            if isinstance(tensor, nn.Parameter) and name in holder._parameters:
                holder._parameters[name] = tensor
            elif not isinstance(tensor, nn.Parameter) and name in holder._buffers:
                holder._buffers[name] = tensor
            else:
                continue
            with gm.graph.inserting_before(user):
                own = gm.graph.get_attr(f"{path}.{name}")
            own.meta = dict(node.meta)
            user.replace_input_with(node, own)
            changed = True
    return changed


def lift_exported_module(gm: nn.Module) -> nn.Module:
    """Replace op calls on parameters by calls of equivalent torch.nn modules, in place; returns ``gm``."""
    if not isinstance(gm, fx.GraphModule):
        return gm
    from normswap.graph.lift_weight_norm import lift_weight_normed_layers

    lifted = int(_read_tied_weights_by_owner(gm)) + lift_weight_normed_layers(gm)
    scopes: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            scopes.setdefault(module_path(node), []).append(node)
    for node in list(gm.graph.nodes):
        builder = _BUILDERS.get(op_name(node) or "") if node.op == "call_function" else None
        if builder is None:
            continue
        prefix = _owner_of(gm, node)
        if prefix is None or (op_name(node) in _NORM_OPS and _computes_more(scopes.get(prefix, []), node)):
            continue
        replaced = _normalized_output(node) if op_name(node) in _TUPLE_OPS else node
        if replaced is None:
            continue
        holder = gm.get_submodule(prefix)
        module = builder(gm, node, holder)
        if module is None or any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
            continue
        source, channel = _input_of(node), _channel_wrap(node, replaced)
        wrapped = None  # a view or move of the input that the module makes itself, erased with the op
        if channel is not None:
            # x.movedim(d, -1) -> fused op -> movedim back: one channel-norm module, as the model had
            source, replaced, module = channel[0], channel[1], _channel_module(module, channel[2])
            wrapped = node.args[0]
        elif op_name(node) == "addmm":
            io = _conv1d_io(node)
            if io is None:
                continue
            wrapped, (source, replaced) = node.args[1], io
        gm.set_submodule(prefix, module.eval())  # the program's op is inference's: so is the module
        attrs = _tensor_args(node)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(prefix, (source,))
        call.meta = dict(replaced.meta)
        replaced.replace_all_uses_with(call)
        if wrapped is not None:
            gm.graph.erase_node(replaced)
        for item in list(node.users):  # the (now unread) getitems of a tuple-returning op
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        if isinstance(wrapped, fx.Node) and not wrapped.users:
            gm.graph.erase_node(wrapped)
        for a in attrs:
            if not a.users:
                gm.graph.erase_node(a)
        lifted += 1
    if lifted:
        # get_attr nodes nobody reads (num_batches_tracked) would pin attributes a later pass may drop
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
    from normswap.graph.lift_patterns import lift_norm_patterns

    lift_norm_patterns(gm)  # norms written out as ops (an HF RMSNorm), each into a module of its own
    return gm
