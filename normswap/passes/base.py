"""The pass framework: a pass finds candidate sites, checks each, rewrites or skips it with a reason.

A pass declares its kind (exact, architectural, data-driven; DESIGN.md), never mutates its input unless
``inplace=True`` (then the returned model is the one to use: a pass may replace the root), keeps no state
between sites (everything a site needs travels in a :class:`PassContext`), and returns
``(model, PassReport)``. Reports are plain data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar

from torch import nn

from normswap.discover import NormInventory, NormSite, find_norms
from normswap.graph.analysis import GraphView
from normswap.graph.capture import CapturedGraph, capture_graph
from normswap.modules.copying import copy_model


class RewriteKind(str, Enum):
    EXACT = "exact"
    ARCHITECTURAL = "architectural"
    DATA_DRIVEN = "data-driven"


@dataclass
class Change:
    """One site a pass rewrote."""

    pass_name: str
    site: str
    kind: RewriteKind
    description: str
    details: dict[str, Any] = field(default_factory=dict)


class SkipCause(str, Enum):
    """Why a site was left alone, for decisions that must not parse the reason's text.

    ``architecture``: what the model computes rules the rewrite out (a post-LN residual stream that a
    mean-seeing reader reads); ``capture``: no usable graph of the model could be captured, so the
    rewrite could not be judged; ``unsupported``: normswap cannot do it here yet (a form it does not
    rewrite, a fact it could not determine). A skip of the last two kinds might have been a change.
    """

    ARCHITECTURE = "architecture"
    CAPTURE = "capture"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Refusal:
    """What :meth:`Pass.check` returns to refuse a site with a known cause (a plain string leaves the
    cause unstated)."""

    reason: str
    cause: SkipCause


@dataclass
class Skip:
    """One candidate site a pass left alone, and why."""

    pass_name: str
    site: str
    reason: str
    cause: SkipCause | None = None


@dataclass
class PassReport:
    pass_name: str
    kind: RewriteKind
    changes: list[Change] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    graph_method: str | None = None
    graph_error: str = ""
    # Settings turned off for the graph capture, e.g. "use_cache=False" (normswap.graph.capture).
    graph_notes: list[str] = field(default_factory=list)
    # Filled by the pipeline when example inputs are available: how far this pass moved the outputs.
    validation: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        for change in data["changes"]:
            change["kind"] = change["kind"].value if isinstance(change["kind"], Enum) else change["kind"]
        for skip in data["skips"]:
            skip["cause"] = skip["cause"].value if isinstance(skip["cause"], Enum) else skip["cause"]
        return data


@dataclass
class PassContext:
    """What a pass knows about the model while it works on it; rebuilt for every pass run."""

    model: nn.Module
    inventory: NormInventory
    captured: CapturedGraph
    view: GraphView | None
    modules: dict[str, nn.Module]
    example_args: tuple | None = None
    example_kwargs: dict[str, Any] | None = None
    # Values a pass computes once per run and reads at several sites (e.g. recorded activations).
    cache: dict[str, Any] = field(default_factory=dict)

    def replace_model(self, model: nn.Module) -> None:
        """Make ``model`` the one the pass returns (a rewrite of the root's own forward gives a new root);
        its submodules are the old root's, so the inventory and module index stay valid."""
        self.model = model
        self.modules = {**self.modules, "": model}


class Pass(ABC):
    """Base of every pass. Subclasses implement :meth:`candidates`, :meth:`check` and :meth:`rewrite`."""

    name: ClassVar[str]
    kind: ClassVar[RewriteKind]

    def __call__(
        self,
        model: nn.Module,
        example_args: tuple | None = None,
        example_kwargs: dict[str, Any] | None = None,
        *,
        inplace: bool = False,
        captured: CapturedGraph | None = None,
    ) -> tuple[nn.Module, PassReport]:
        """``captured``: a graph already captured of ``model`` (or of a model of the same structure) on
        these inputs, to use instead of capturing one again."""
        target = model if inplace else copy_model(model)
        ctx = build_context(target, example_args, example_kwargs, captured=captured)
        report = PassReport(
            self.name,
            self.kind,
            graph_method=ctx.captured.method,
            graph_error=ctx.captured.reason,
            graph_notes=list(ctx.captured.notes),
        )
        for site in self.candidates(ctx):
            refused = self.check(site, ctx)
            if isinstance(refused, Refusal):
                report.skips.append(Skip(self.name, site.path, refused.reason, refused.cause))
                continue
            if refused is not None:
                report.skips.append(Skip(self.name, site.path, refused))
                continue
            report.changes.append(self.rewrite(site, ctx))
        if ctx.model is not target and inplace:
            _consumed(target, self.name)
        return ctx.model, report

    @abstractmethod
    def candidates(self, ctx: PassContext) -> list[NormSite]:
        """The sites this pass considers; each will either change or be skipped with a reason."""

    @abstractmethod
    def check(self, site: NormSite, ctx: PassContext) -> str | Refusal | None:
        """None when ``site`` can be rewritten, else the reason it cannot, for a person to read (a
        :class:`Refusal` when the pass knows the cause)."""

    @abstractmethod
    def rewrite(self, site: NormSite, ctx: PassContext) -> Change:
        """Rewrite one checked site of ``ctx.model`` in place and describe the change."""


def _consumed(model: nn.Module, pass_name: str) -> None:
    """Make a model that an in-place pass replaced (its root became a GraphModule) refuse to run: it
    shares edited submodules with the replacement, so running it would silently compute something else."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"this model was rewritten in place by {pass_name}, which returned a new root module: use the "
            "model the pass returned"
        )

    model.forward = forward  # type: ignore[method-assign]


def capture_refusal(ctx: PassContext, unknown: str) -> Refusal:
    """The refusal of a site that needs a graph with shapes (one torch.export captures) when there is
    none: ``unknown`` says what the graph would have told ("the residual stream")."""
    how = (
        "no graph captured"
        if ctx.view is None
        else "the graph was captured by fx tracing, which records no shapes"
    )
    errors = f" ({ctx.captured.reason})" if ctx.captured.reason else ""
    advice = f": {ctx.captured.advice}" if ctx.captured.advice else ""
    return Refusal(f"{how}{errors}, so {unknown} is unknown{advice}", SkipCause.CAPTURE)


def build_context(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    captured: CapturedGraph | None = None,
) -> PassContext:
    if captured is None:
        captured = capture_graph(model, example_args, example_kwargs)
    inventory = find_norms(model, example_args, example_kwargs, captured=captured)
    view = GraphView(captured) if captured.ok else None
    return PassContext(
        model, inventory, captured, view, dict(model.named_modules()), example_args, example_kwargs
    )


def replace_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path``, keeping the old module's train/eval mode."""
    old = model.get_submodule(path)
    new.train(old.training)
    model.set_submodule(path, new)
