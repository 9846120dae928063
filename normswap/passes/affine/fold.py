"""Fold a norm's affine (gamma, beta) into the Linear layers that read it, leaving a weightless norm (exact).

The FlashNorm observation: a norm over the last dim ends with ``y = n(x) * g + b`` (g = 1 + w for
Gemma's offset weights; a missing g is 1, a missing b is 0). When every reader of ``y`` is a linear map
over that same dim, ``z = y W^T + c``, the per-channel scale and shift move into the reader:

    z = (n(x) * g + b) W^T + c = n(x) (W diag(g))^T + (c + W b)
    W' = W diag(g)    (column j of W scaled by g_j)
    c' = c + W b

computed in float64 and cast back to the reader's dtype; the norm becomes the same norm without
elementwise affine. Readers handled: ``nn.Linear`` (weight ``(out, in)``), HF ``Conv1D`` (GPT-2's,
weight ``(in, out)``: rows are scaled) and ``nn.MultiheadAttention`` used as self-attention (its packed
``in_proj_weight`` is a linear over the last dim). Ops that keep the last dim intact may sit between the
norm and a reader (selecting the class token, a reshape that keeps the last dim, eval-mode dropout),
since they commute with a per-channel scale and shift.

Legal only when the result computes the same function. Readers are read off the captured graph, never
from names; a site is refused, with the reason, when:
- the norm does not normalize the last dim alone (BatchNorm, GroupNorm, timm's LayerNorm2d normalize
  channels; a norm over several trailing dims has a gain a Linear cannot absorb);
- it is not a whole module (a functional or inline norm needs a graph rewrite), is called at more than
  one site, is in training mode, or has no affine to fold;
- any value derived from its output reaches something other than a supported reader: a residual add,
  attention without a projection, a model output, a slice of the normalized dim, a dtype cast;
- a reader is called at more than one site, reads other activations too, overrides ``forward``, has a
  parametrized weight (weight norm), or shares its weight with another module (tied embeddings): folding
  would change the other use.

Numerics: in fp32 the fold is exact up to rounding. Where the norm's weight multiply rounds in a low
precision dtype (HF Llama casts the normalized value to the input dtype and multiplies there), the
folded model rounds ``W diag(g)`` instead of ``g * n(x)``: a bf16 difference of the order of bf16's
resolution, judged against the bf16 row of the exact tolerance table.

A check's plan (:class:`AffinePlan`) holds the names and readers it found, so applying it re-reads no
graph; the written-out norm patterns a check may need are searched for once per run (the prepared
:class:`NormPatterns`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from normswap.discover import NormSite
from normswap.graph.analysis import GraphView, ModuleCall
from normswap.graph.ops import (
    CHECK_OPS,
    PASS_THROUGH_OPS,
    arg,
    op_name,
    rank,
    real_users,
    tensor_meta,
)
from normswap.graph.patterns import NormMatch, find_norm_patterns
from normswap.modules.norms import LayerNorm as RefLayerNorm
from normswap.modules.norms import RMSNorm as RefRMSNorm
from normswap.modules.norms import mark_folded_affine
from normswap.passes.affine.arithmetic import fold_edit
from normswap.passes.core.base import Change, Pass, PassContext, RewriteKind, replace_submodule
from normswap.passes.core.edits import apply_in_memory

_TORCH_NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
_VIEW_OPS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "expand"})
_NORM_OPS = frozenset({"layer_norm", "rms_norm"})


def _class(module: nn.Module | None) -> str:
    return type(module).__name__


# --- graph bookkeeping ------------------------------------------------------------------------------


@dataclass
class _Reader:
    """A layer that reads the norm's output, and the value (the output or a view of it) it reads."""

    path: str
    module: nn.Module
    value: fx.Node
    in_dim: int  # input-feature dim of the weight
    weight_name: str
    bias_name: str


def _hf_conv1d_class() -> type[nn.Module] | None:
    # Only look it up if transformers is already loaded: a model holding a Conv1D imported it.
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _reader_layout(module: nn.Module) -> tuple[int, str, str] | str | None:
    """``(in_dim, weight name, bias name)`` for a supported reader, a refusal reason, or None (no layer)."""
    conv1d = _hf_conv1d_class()
    if isinstance(module, nn.Linear):
        if type(module).forward is not nn.Linear.forward:
            return "overrides forward; its output is not a plain Linear of its input"
        return 1, "weight", "bias"
    if conv1d is not None and isinstance(module, conv1d):
        if type(module).forward is not conv1d.forward:
            return "overrides forward; its output is not a plain Conv1D of its input"
        return 0, "weight", "bias"
    if isinstance(module, nn.MultiheadAttention):
        if type(module).forward is not nn.MultiheadAttention.forward:
            return "overrides forward"
        if not module._qkv_same_embed_dim or module.in_proj_weight is None:
            return "has separate q/k/v projection weights (kdim/vdim differ from embed_dim)"
        return 1, "in_proj_weight", "in_proj_bias"
    return None


def _last_dim_preserved(view: GraphView, user: fx.Node, value: fx.Node) -> bool | str:
    """True when ``user`` hands ``value`` on with its last dim untouched (so a per-channel affine
    commutes with it); a reason string when it touches the last dim; False when it is no such op."""
    name = op_name(user)
    if not user.args or user.args[0] is not value:
        return False
    if name in PASS_THROUGH_OPS:
        return True
    if name == "dropout":
        p, train = arg(user, 1, "p"), arg(user, 2, "train")
        return train is False or p == 0
    r = rank(value)
    if name in ("select", "slice"):
        dim = arg(user, 1, "dim", 0)
        if not isinstance(dim, int) or r is None:
            return False
        if dim % r == r - 1:
            return f"{name} on the normalized (last) dim"
        return True
    if name in ("transpose", "permute"):
        dims = (
            [d for d in user.args[1:] if isinstance(d, int)] if name == "transpose" else arg(user, 1, "dims")
        )
        if r is None or not isinstance(dims, (list, tuple)):
            return False
        if name == "permute":
            return list(dims)[-1] % r == r - 1
        return all(d % r != r - 1 for d in dims)
    if name in _VIEW_OPS:
        before, after = tensor_meta(value), tensor_meta(user)
        if before is None or after is None or not after[0]:
            return False
        return before[0][-1] == after[0][-1]
    return False


def _find_readers(view: GraphView, modules: dict[str, nn.Module], output: fx.Node) -> list[_Reader] | str:
    """Every layer that reads ``output`` (directly or through last-dim-preserving ops), or a refusal."""
    readers: dict[str, _Reader] = {}
    pending = [output]
    seen: set[fx.Node] = set()
    while pending:
        value = pending.pop()
        if value in seen:
            continue
        seen.add(value)
        for user in real_users(value):
            if user.op == "output":
                return "output is returned by the model, not only read by Linear layers"
            path = view.innermost_path(user)
            layer = modules.get(path) if path else None
            layout = _reader_layout(layer) if layer is not None else None
            if isinstance(layout, str):
                return f"output is read by {path} ({_class(layer)}), which {layout}"
            if layout is not None:
                assert layer is not None
                known = readers.get(path)
                if known is not None and known.value is not value:
                    return f"{path} reads the output in two forms ({known.value.name}, {value.name})"
                readers[path] = _Reader(path, layer, value, *layout)
                continue
            passes = _last_dim_preserved(view, user, value)
            if isinstance(passes, str):
                return f"output is read only in part: {view.describe(user, modules)} is a {passes}"
            if passes:
                pending.append(user)
                continue
            what = view.describe(user, modules)
            owner = f" ({_class(layer)})" if layer is not None and path and what != path else ""
            return f"output is also read by {what}{owner}, which is not a Linear"
    if not readers:
        return "output has no reader"
    return list(readers.values())


def _tied_names(model: nn.Module, tensor: torch.Tensor) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is tensor]


def _check_reader(ctx: PassContext, reader: _Reader, width: int) -> str | None:
    assert ctx.view is not None
    calls = ctx.view.calls.get(reader.path, [])
    if len(calls) != 1:
        return f"{reader.path} is called at {len(calls)} sites; folding would change the others"
    inputs = calls[0].inputs(ctx.view)
    if inputs != [reader.value]:
        return f"{reader.path} ({_class(reader.module)}) also reads {_describe_others(ctx, inputs, reader.value)}"
    if parametrize.is_parametrized(reader.module, reader.weight_name):
        return f"{reader.path}.{reader.weight_name} is parametrized (e.g. weight norm): remove that first"
    weight = getattr(reader.module, reader.weight_name)
    if not isinstance(weight, nn.Parameter) or not weight.is_floating_point():
        return f"{reader.path}.{reader.weight_name} is not a floating-point parameter"
    tied = [n for n in _tied_names(ctx.model, weight) if n != f"{reader.path}.{reader.weight_name}"]
    if tied:
        return f"{reader.path}.{reader.weight_name} is tied to {tied[0]}: folding would change that use too"
    if not _param_used_only_by(ctx.view, f"{reader.path}.{reader.weight_name}", calls[0]):
        return f"{reader.path}.{reader.weight_name} is also read outside {reader.path}"
    if weight.shape[reader.in_dim] != width:
        return f"{reader.path} reads {weight.shape[reader.in_dim]} features, the norm gives {width}"
    return None


def _describe_others(ctx: PassContext, inputs: list[fx.Node], value: fx.Node) -> str:
    assert ctx.view is not None
    others = [ctx.view.describe(n, ctx.modules) for n in inputs if n is not value]
    return ", ".join(others) if others else "nothing else"


def _param_used_only_by(view: GraphView, name: str, call: ModuleCall) -> bool:
    inside = call.node_set
    for node in view.nodes:
        if view.param_name(node) == name:
            return all(u in inside or op_name(u) in CHECK_OPS for u in node.users)
    return True  # not lifted into the graph (fx keeps get_attr inside the module): nothing else reads it


@dataclass
class NormPatterns:
    """The pass's per-run state: the written-out norms of the captured graph, searched for at most once
    a run, and only when a norm of a class normswap does not know needs its gain and shift located."""

    view: GraphView | None
    _found: list[NormMatch] | None = None

    def matching(self, call: ModuleCall) -> NormMatch | None:
        """The written-out norm whose output is computed inside ``call``, if any."""
        assert self.view is not None
        if self._found is None:
            self._found = find_norm_patterns(self.view)
        inside = call.node_set
        return next((m for m in self._found if m.output in inside), None)


@dataclass(frozen=True)
class AffinePlan:
    """What folding one norm does: the names of its gain and shift, and the layers that absorb them."""

    site: NormSite
    weight_name: str | None
    bias_name: str | None
    readers: tuple[_Reader, ...]


def _affine(
    ctx: PassContext, patterns: NormPatterns, site: NormSite, call: ModuleCall
) -> tuple[str | None, str | None] | str:
    """Attribute names (relative to the norm module) of its gain and shift, or a refusal."""
    module = site.module
    assert module is not None and ctx.view is not None
    if isinstance(module, (*_TORCH_NORMS, RefLayerNorm, RefRMSNorm)):
        weight = "weight" if getattr(module, "weight", None) is not None else None
        bias = "bias" if getattr(module, "bias", None) is not None else None
        return weight, bias
    if not list(module.parameters(recurse=False)) and not list(module.buffers(recurse=False)):
        return None, None  # OLMo's LayerNorm: no affine of its own, so nothing to fold (said by the caller)
    match = patterns.matching(call)
    if match is None:
        return "the norm's weight and bias could not be located in the graph"
    names = []
    for node in (match.weight, match.bias):
        full = ctx.view.param_name(node) if node is not None else None
        if full is not None and not full.startswith(site.path + "."):
            return f"the norm's parameter {full} belongs to another module"
        names.append(full[len(site.path) + 1 :] if full is not None else None)
    return names[0], names[1]


def _weightless_norm(site: NormSite, module: nn.Module) -> nn.Module:
    """The same norm without elementwise affine: same class family, eps, casting and dims."""
    assert site.normalized_shape is not None
    params = list(module.parameters(recurse=False))
    factory: dict[str, Any] = {
        "device": params[0].device if params else None,
        "dtype": next((p.dtype for p in params if p.is_floating_point()), None),
    }
    if isinstance(module, (RefLayerNorm, RefRMSNorm)):
        # normswap's own modules (reference or fused) share a constructor: keep the class
        return type(module)(
            module.normalized_shape,
            eps=module.eps,
            elementwise_affine=False,
            bias=False,
            casting=module.casting,
            **factory,
        )
    if isinstance(module, nn.LayerNorm):
        return nn.LayerNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False, **factory)
    if hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm):
        # eps=None (the input dtype's epsilon at run time) carries over as it is
        return nn.RMSNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False, **factory)
    cls = RefRMSNorm if site.kind == "rms" else RefLayerNorm
    assert site.eps is not None
    return cls(
        site.normalized_shape,
        eps=site.eps,
        elementwise_affine=False,
        bias=False,
        casting=site.casting,
        **factory,
    )


# --- the pass ---------------------------------------------------------------------------------------


class FoldNormAffine(Pass[NormSite, AffinePlan, NormPatterns]):
    """Move every foldable norm's gain and bias into the Linear layers that read its output."""

    name = "fold_norm_affine"
    kind = RewriteKind.EXACT
    inside_changes = (
        "each folded norm's output is the normalized value without its gain and shift (they moved into "
        "the layers that read it): a hook on the norm, and a hidden state that is a norm's output (a "
        "Hugging Face model's last one, after its final norm), see other values; the outputs do not change"
    )

    def prepare(self, ctx: PassContext) -> NormPatterns:
        return NormPatterns(ctx.view)

    def candidates(self, ctx: PassContext, state: NormPatterns) -> list[NormSite]:
        return list(ctx.inventory)

    def apply(self, plan: AffinePlan, ctx: PassContext, state: NormPatterns) -> Change:
        site, weight_name, bias_name, readers = plan.site, plan.weight_name, plan.bias_name, plan.readers
        norm = site.module
        assert norm is not None
        # the group a stream writes, run on the model's own tensors (a reader gains a bias it needs)
        tensors = {name for name, _ in ctx.model.named_parameters(remove_duplicate=False)}
        tensors |= {name for name, _ in ctx.model.named_buffers(remove_duplicate=False)}
        edit = fold_edit(plan, tensors)
        assert not isinstance(edit, str), edit  # every tensor is the model's own, and biases may be made
        bias_added = [name.rpartition(".")[0] for name in apply_in_memory(ctx.model, edit)]
        into = [r.path for r in readers]
        moved = [what for what, n in (("gain", weight_name), ("bias", bias_name)) if n]
        new = _weightless_norm(site, norm)
        # the edit left the norm's own tensors at their neutral values: what a directory stores for them
        mark_folded_affine(new, {n: getattr(norm, n) for n in (weight_name, bias_name) if n})
        replace_submodule(ctx.model, site.path, new)
        removed = [n for n in (weight_name, bias_name) if n]
        return Change(
            self.name,
            site.path,
            self.kind,
            f"{' and '.join(moved)} folded into {', '.join(into)}; now {_class(new)} without affine",
            {
                "into": into,
                "reader_classes": [_class(r.module) for r in readers],
                "removed_parameters": [f"{site.path}.{n}" for n in removed],
                "bias_added": bias_added,
                "replacement": _class(new),
                "weight_offset": site.weight_offset,
                "casting": site.casting,
            },
        )

    def check(self, site: NormSite, ctx: PassContext, state: NormPatterns) -> AffinePlan | str:
        """What folding ``site`` would do, or the reason it must not."""
        if site.kind not in ("layer", "rms"):
            hint = (
                "; BatchNorm folds into the layer before it (fold_batchnorm)" if site.kind == "batch" else ""
            )
            return f"{site.kind} norm normalizes channels, not the last dim a Linear reads{hint}"
        if not site.is_module:
            return f"{site.source} norm {site.inside()}, not a module: folding it needs a graph rewrite"
        shape = site.normalized_shape or ()
        if len(shape) != 1:
            return f"normalizes the trailing dims {tuple(shape)}: a Linear can absorb a gain over the last dim only"
        if site.normalized_dims not in ((-1,), None):
            return f"normalizes dims {site.normalized_dims}, not the last dim (e.g. a channels-first LayerNorm2d)"
        module = site.module
        assert module is not None
        if module.training:
            return "norm is in training mode: folding is for inference (the optimizer would train W diag(g), not g); call model.eval()"
        if ctx.view is None:
            return f"no graph captured, so the readers of the norm output are unknown ({ctx.captured.reason})"
        calls = ctx.view.calls.get(site.path, [])
        if len(calls) != 1:
            return f"norm is called at {len(calls)} sites; folding needs exactly one"
        call = calls[0]
        affine = _affine(ctx, state, site, call)
        if isinstance(affine, str):
            return affine
        weight_name, bias_name = affine
        if weight_name is None and bias_name is None:
            return "norm has no elementwise affine: nothing to fold"
        outputs = call.outputs()
        if len(outputs) != 1:
            return f"norm call has {len(outputs)} outputs; folding needs one"
        readers = _find_readers(ctx.view, ctx.modules, outputs[0])
        if isinstance(readers, str):
            return readers
        for reader in readers:
            reason = _check_reader(ctx, reader, shape[0])
            if reason is not None:
                return reason
        return AffinePlan(site, weight_name, bias_name, tuple(readers))
