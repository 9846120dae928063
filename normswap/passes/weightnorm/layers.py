"""Add weight normalization to Conv/ConvTranspose/Linear layers, or fold it back into a plain weight (exact).

Weight norm (Salimans & Kingma, 2016) stores a layer's weight as a direction ``v`` and a magnitude ``g``:

    w = g * v / ||v||      with ||v|| taken over every weight dim except ``dim``

Both passes keep the function: adding sets ``v = w`` and ``g = ||w||`` (so ``w`` is recovered up to
one rounding), removing computes ``w`` once, in float64, and stores it as the plain ``weight`` again.
They change what is trained and what is stored, not what the model computes.

AddWeightNorm wraps the chosen layers with ``torch.nn.utils.parametrizations.weight_norm``. ``dim`` is
per output channel by default: weight dim 0 for Conv and Linear, dim 1 for ConvTranspose (its weight is
``(in, out / groups, *kernel)``). A grouped ConvTranspose has no weight dim that is one output channel
(dim 1 indexes channels within a group), so it needs an explicit ``dim``. Refused, with the reason: a
layer that already has weight norm (either API) or another parametrization, a lazy or non-float weight,
a weight tied to another module (weight norm would untie it), and a slice of the weight that is all
zeros (``v / ||v||`` would be 0 / 0).

RemoveWeightNorm finds every weight norm, in the parametrization form (``parametrizations.weight.
original0/1`` in the state_dict) and in the deprecated hook form of ``torch.nn.utils.weight_norm``
(``weight_g``/``weight_v``), on any tensor name (an LSTM's ``weight_hh_l0`` too), and leaves the plain
class with a ``weight`` parameter, so the state_dict loads into the model built without weight norm, and
without the load_state_dict pre-hook that ``parametrizations.weight_norm`` registers and torch's removal
leaves behind (a local function: the module would not pickle). A weight with other parametrizations
stacked on the weight norm is refused: removing them would bake those in too.

These are not norm sites: candidates are layers (:class:`LayerSite`), and the passes declare
``Needs.PARAMETERS``, so the one pass driver (:mod:`normswap.passes.core.base`) captures no graph for them
and builds no norm inventory; everything else (copying, the report, refusals) is the driver's, as for
every pass. A check's plan carries what it decided (the weight-norm dim), so applying it decides nothing
again.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.utils import parametrize

from normswap.errors import BadInputError
from normswap.modules.copying import weight_norm_hooks
from normswap.passes.core.base import Change, Needs, Pass, PassContext, RewriteKind
from normswap.util.tolerance import exact_tolerance

CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
WEIGHT_NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    *CONV_TRANSPOSE,
    nn.Linear,
)
_LAYER_NAMES = "Conv1d/2d/3d, ConvTranspose1d/2d/3d or Linear"

# None: every supported layer; paths: exactly those modules; a class or classes; or filter_fn(module, path).
Targets = (
    Sequence[str] | Callable[[nn.Module, str], bool] | type[nn.Module] | tuple[type[nn.Module], ...] | None
)
WeightNormDim = int | Literal["output"] | None


@dataclass
class LayerSite:
    """One tensor of one layer a weight-norm pass considers; ``path`` is what reports show."""

    path: str
    module_path: str
    module: nn.Module
    name: str = "weight"
    # a bare holder of a program's weight-norm tensors that no layer computes from (not lifted to a layer)
    unlifted: bool = False


# --- the math ---------------------------------------------------------------------------------------


def weight_norm_magnitude(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """``g = ||w||`` over every dim except ``dim`` (torch's convention: ``dim=-1`` is the whole tensor),
    shaped like torch's weight norm stores it; float64."""
    return torch.norm_except_dim(weight.detach().double(), 2, dim)


def weight_from_weight_norm(g: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    """``w = g * v / ||v||`` computed in float64 and cast to ``v``'s dtype."""
    return torch._weight_norm(v.detach().double(), g.detach().double(), dim).to(v.dtype)


def weight_norm_problem(weight: torch.Tensor, dim: int) -> str | None:
    """Why weight norm along ``dim`` cannot take over ``weight`` exactly (None when it can): an all-zero
    slice (``v / ||v||`` divides by zero), or ``g * v / ||v||`` in the weight's dtype missing it."""
    g = weight_norm_magnitude(weight, dim)
    zeros = int((g == 0).sum())
    if zeros:
        what = (
            "the whole weight is" if g.numel() == 1 else f"{zeros} of {g.numel()} slices along dim {dim} are"
        )
        return f"{what} all zeros: v / ||v|| would divide by zero"
    # what the parametrization will compute on every forward, in the weight's own dtype
    rebuilt = torch._weight_norm(weight.detach(), g.to(weight.dtype), dim)
    rel = _max_rel(rebuilt, weight)
    if rel > exact_tolerance(weight.dtype):
        return f"g * v / ||v|| misses the weight by {rel:.3g} x max|w| in {weight.dtype}"
    return None


# --- finding weight norms ---------------------------------------------------------------------------


def _parametrization_names(module: nn.Module, name: str) -> list[str]:
    if not parametrize.is_parametrized(module, name):
        return []
    return [type(p).__name__ for p in module.parametrizations[name]]


def _is_weight_norm(parametrization: nn.Module) -> bool:
    # torch's private class; recognized by name and the dim it carries so a rename cannot mislead us
    return type(parametrization).__name__ == "_WeightNorm" and hasattr(parametrization, "dim")


def _tied_names(model: nn.Module, tensor: torch.Tensor) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is tensor]


def _matches(targets: Targets, module: nn.Module, path: str) -> bool:
    if targets is None:
        return True
    if isinstance(targets, type) or (
        isinstance(targets, tuple) and all(isinstance(t, type) for t in targets)
    ):
        return isinstance(module, targets)
    if callable(targets):
        return bool(targets(module, path))
    return path in targets


def _named_paths(targets: Targets, modules: dict[str, nn.Module], pass_name: str) -> list[str] | None:
    """The explicit paths in ``targets`` (None when targets is a filter); unknown paths are an error."""
    if targets is None or callable(targets):  # a class is callable too
        return None
    if isinstance(targets, str):
        raise BadInputError(
            f"{pass_name}: targets must be a list of module paths, not the string {targets!r}"
        )
    items = list(targets)
    if items and all(isinstance(t, type) for t in items):
        return None
    for path in items:
        if not isinstance(path, str) or not path or path not in modules:
            close = difflib.get_close_matches(str(path), [p for p in modules if p], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise BadInputError(f"{pass_name}: no module at path {path!r} in the model{hint}")
    return items


@dataclass(frozen=True)
class AddPlan:
    """A layer whose weight weight norm can take over, along torch's ``dim`` (-1: the whole weight)."""

    site: LayerSite
    dim: int


@dataclass(frozen=True)
class RemovePlan:
    """A weight norm (the only parametrization of its tensor, or a hook) to fold into a plain tensor."""

    site: LayerSite


# --- adding -----------------------------------------------------------------------------------------


class AddWeightNorm(Pass[LayerSite, AddPlan, None]):
    """Wrap chosen Conv/ConvTranspose/Linear layers with ``parametrizations.weight_norm`` (exact).

    ``targets``: None (every supported layer), a list of module paths (each must exist), a class or
    tuple of classes, or ``filter_fn(module, path) -> bool``. ``dim``: ``"output"`` (per output
    channel: 0, or 1 for ConvTranspose), an int passed to torch as is, or None for one norm over the
    whole weight.
    """

    name = "add_weight_norm"
    kind = RewriteKind.EXACT
    needs = Needs.PARAMETERS

    def __init__(self, targets: Targets = None, dim: WeightNormDim = "output") -> None:
        if not (
            dim is None
            or dim == "output"
            or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0)
        ):
            # torch reads dim=-1 as "the whole tensor", not "the last dim": negative dims are refused
            raise ValueError(f"dim must be 'output', a weight dim >= 0, or None (whole weight); got {dim!r}")
        self.targets = targets
        self.dim = dim

    def candidates(self, ctx: PassContext, state: None) -> list[LayerSite]:
        named = _named_paths(self.targets, ctx.modules, self.name)
        if named is not None:
            return [LayerSite(p, p, ctx.modules[p]) for p in named]
        return [
            LayerSite(p, p, m)
            for p, m in ctx.modules.items()
            if p and isinstance(m, WEIGHT_NORM_LAYERS) and _matches(self.targets, m, p)
        ]

    def _dim(self, layer: nn.Module) -> int | str:
        """The torch ``dim`` for ``layer``, or why there is none."""
        if self.dim is None:
            return -1  # torch's encoding of "norm over the whole tensor"
        if isinstance(self.dim, int):
            if self.dim >= layer.weight.ndim:
                return f"dim {self.dim} is out of range for a {layer.weight.ndim}-D weight"
            return self.dim
        if isinstance(layer, CONV_TRANSPOSE):
            if layer.groups != 1:
                return (
                    f"grouped ConvTranspose (groups={layer.groups}): weight dim 1 indexes channels within "
                    "a group, so no weight dim is one output channel; pass an explicit dim"
                )
            return 1
        return 0

    def check(self, site: LayerSite, ctx: PassContext, state: None) -> AddPlan | str:
        layer = site.module
        if not isinstance(layer, WEIGHT_NORM_LAYERS):
            return f"{type(layer).__name__}, not a {_LAYER_NAMES}"
        if any(_is_weight_norm(p) for p in _parametrizations(layer, "weight")) or weight_norm_hooks(layer):
            return "already has weight norm"
        if parametrize.is_parametrized(layer, "weight"):
            names = ", ".join(_parametrization_names(layer, "weight"))
            return f"weight already has parametrizations ({names}); weight norm would stack on them"
        if "weight_orig" in layer._parameters:
            return "weight has a spectral_norm hook (weight_orig); weight norm would stack on it"
        weight = layer.weight
        if isinstance(weight, nn.parameter.UninitializedParameter):
            return "weight is uninitialized (lazy module): run the model once first"
        if not isinstance(weight, nn.Parameter) or not weight.is_floating_point():
            return "weight is not a floating-point parameter"
        tied = [n for n in _tied_names(ctx.model, weight) if n != f"{site.module_path}.weight"]
        if tied:
            return f"weight is tied to {tied[0]}: weight norm would untie them"
        dim = self._dim(layer)
        if isinstance(dim, str):
            return dim
        if weight.is_meta:
            return AddPlan(site, dim)  # a streamed checkpoint: its stream checks the values
        problem = weight_norm_problem(weight, dim)
        return problem if problem is not None else AddPlan(site, dim)

    def apply(self, plan: AddPlan, ctx: PassContext, state: None) -> Change:
        site, dim = plan.site, plan.dim
        layer = site.module
        before = layer.weight.detach().clone()
        _own_parametrized_class(layer)
        nn.utils.parametrizations.weight_norm(layer, "weight", dim=None if dim == -1 else dim)
        with torch.no_grad():
            # torch computes g in the weight's dtype; fp64 then one rounding is closer to ||w||
            magnitude = layer.parametrizations.weight.original0
            magnitude.copy_(weight_norm_magnitude(before, dim).to(magnitude.dtype).reshape(magnitude.shape))
            rel = _max_rel(layer.weight, before)
        base = f"{site.module_path}.parametrizations.weight"
        return Change(
            self.name,
            site.path,
            self.kind,
            f"weight -> g * v / ||v|| (dim {'all' if dim == -1 else dim})",
            {
                "layer_class": type(layer).__name__.removeprefix("Parametrized"),
                "dim": None if dim == -1 else dim,
                "state_dict_keys": [f"{base}.original0", f"{base}.original1"],
                "weight_max_rel": rel,
            },
        )


# --- removing ---------------------------------------------------------------------------------------


class RemoveWeightNorm(Pass[LayerSite, RemovePlan, None]):
    """Fold every weight norm (parametrization or hook form) back into a plain parameter (exact).

    ``targets`` selects layers as in :class:`AddWeightNorm` (default: every weight-normed layer).
    """

    name = "remove_weight_norm"
    kind = RewriteKind.EXACT
    needs = Needs.PARAMETERS

    def __init__(self, targets: Targets = None) -> None:
        self.targets = targets

    def candidates(self, ctx: PassContext, state: None) -> list[LayerSite]:
        named = _named_paths(self.targets, ctx.modules, self.name)
        sites: list[LayerSite] = []
        for path, module in ctx.modules.items():
            if named is not None and path not in named:
                continue
            if named is None and not _matches(self.targets, module, path):
                continue
            names = [h.name for _, h in weight_norm_hooks(module)]
            if parametrize.is_parametrized(module):
                names += [
                    n
                    for n in module.parametrizations
                    if any(_is_weight_norm(p) for p in module.parametrizations[n])
                ]
            elif type(module) is nn.Module and _holds_weight_norm_tensors(module):
                sites.append(LayerSite(path, path, module, "weight", unlifted=True))
                continue
            if not names and named is not None:
                sites.append(LayerSite(path, path, module, ""))
            for n in names:
                sites.append(LayerSite(path if n == "weight" else f"{path}.{n}", path, module, n))
        return sites

    def check(self, site: LayerSite, ctx: PassContext, state: None) -> RemovePlan | str:
        if site.unlifted:
            return (
                "the program computes this weight norm with ops normswap does not lift back into a layer "
                "(a ConvTranspose, a layer called twice, a decomposed program): convert the model it was "
                "exported from"
            )
        if not site.name:
            return f"{type(site.module).__name__} has no weight norm"
        stacked = _parametrization_names(site.module, site.name)
        if len(stacked) > 1:
            return (
                f"{site.name} has parametrizations {', '.join(stacked)}: removing the weight norm "
                "would bake the others in too"
            )
        return RemovePlan(site)

    def apply(self, plan: RemovePlan, ctx: PassContext, state: None) -> Change:
        site = plan.site
        module, name = site.module, site.name
        hooks = [(k, h) for k, h in weight_norm_hooks(module) if h.name == name]
        if hooks:
            key, hook = hooks[0]
            g, v = getattr(module, f"{name}_g"), getattr(module, f"{name}_v")
            dim, form = hook.dim, "hook"
            removed = [f"{site.module_path}.{name}_g", f"{site.module_path}.{name}_v"]
            before = hook.compute_weight(module).detach()
            weight = weight_from_weight_norm(g, v, dim)
            requires_grad = v.requires_grad
            hook.remove(module)
            del module._forward_pre_hooks[key]
        else:
            plist = module.parametrizations[name]
            g, v = plist.original0, plist.original1
            dim, form = plist[0].dim, "parametrization"
            removed = [
                f"{site.module_path}.parametrizations.{name}.original0",
                f"{site.module_path}.parametrizations.{name}.original1",
            ]
            before = getattr(module, name).detach()
            weight = weight_from_weight_norm(g, v, dim)
            requires_grad = v.requires_grad
            _own_parametrized_class(module)
            parametrize.remove_parametrizations(module, name, leave_parametrized=True)
            _remove_compat_hook(module, name)
        # the weight torch left behind was computed in the parameter dtype; store the fp64 result
        setattr(module, name, nn.Parameter(weight, requires_grad=requires_grad))
        if name == "weight":
            # torch layers register weight before bias; keep the state_dict in the order a plain layer has
            params = module._parameters
            module._parameters = type(params)([(name, params.pop(name)), *params.items()])
        return Change(
            self.name,
            site.path,
            self.kind,
            f"g * v / ||v|| folded into a plain {name} ({form} form, dim {'all' if dim == -1 else dim})",
            {
                "layer_class": type(module).__name__,
                "form": form,
                "dim": None if dim == -1 else dim,
                "removed_state_dict_keys": removed,
                "state_dict_key": f"{site.module_path}.{name}",
                "weight_max_rel": _max_rel(weight, before),
            },
        )


def _own_parametrized_class(module: nn.Module) -> None:
    """Give a parametrized module a class of its own before its parametrizations change.

    torch keeps each parametrized tensor as a property on a class made for the module, and edits that
    class when a parametrization is added or removed; ``copy.deepcopy`` shares the class between the
    copy and the original, so removing weight norm from a copy would break the original's ``weight``.
    """
    cls = type(module)
    if not parametrize.is_parametrized(module):
        return
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    module.__class__ = type(cls.__name__, cls.__bases__, namespace)


def _remove_compat_hook(module: nn.Module, name: str) -> None:
    """Remove the load_state_dict pre-hook ``parametrizations.weight_norm`` registered for ``name``.

    The hook renames old ``{name}_g``/``{name}_v`` keys to the parametrization's on load; torch's
    ``remove_parametrizations`` leaves it behind, where it is a local function (the module no longer
    pickles) and would rename keys the plain module does not have. Only that hook, for that name, goes.
    """
    for key, wrapped in list(module._load_state_dict_pre_hooks.items()):
        hook = getattr(wrapped, "hook", wrapped)  # torch wraps it in a _WrappedHook
        if (
            getattr(hook, "__module__", None) == "torch.nn.utils.parametrizations"
            and getattr(hook, "__qualname__", None) == "weight_norm.<locals>._weight_norm_compat_hook"
            and _closure_value(hook, "name") == name
        ):
            del module._load_state_dict_pre_hooks[key]


def _closure_value(function: Any, var: str) -> Any:
    """The value a nested ``function`` closes over as ``var`` (None if it has no such variable)."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    for cell_name, cell in zip(names, cells, strict=False):
        if cell_name == var:
            try:
                return cell.cell_contents
            except ValueError:  # an empty cell
                return None
    return None


def _holds_weight_norm_tensors(module: nn.Module) -> bool:
    """Whether a bare module holds a program's weight-norm tensors: ``parametrizations.*.original0/1``
    or ``*_g``/``*_v`` pairs, under the names torch's two forms give them."""
    names = {n for n, _ in module.named_parameters()}
    pairs = [n.removesuffix("_g") for n in names if n.endswith("_g") and "." not in n]
    if any(f"{p}_v" in names for p in pairs):
        return True
    return any(n.startswith("parametrizations.") and n.endswith(".original0") for n in names)


def _parametrizations(module: nn.Module, name: str) -> list[nn.Module]:
    return list(module.parametrizations[name]) if parametrize.is_parametrized(module, name) else []


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    scale = float(b64.abs().max()) if b64.numel() else 0.0
    diff = float((a64 - b64).abs().max()) if a64.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
