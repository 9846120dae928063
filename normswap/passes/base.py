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


@dataclass
class Skip:
    """One candidate site a pass left alone, and why."""

    pass_name: str
    site: str
    reason: str


@dataclass
class PassReport:
    pass_name: str
    kind: RewriteKind
    changes: list[Change] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    graph_method: str | None = None
    graph_error: str = ""
    # Filled by the pipeline when example inputs are available: how far this pass moved the outputs.
    validation: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        for change in data["changes"]:
            change["kind"] = change["kind"].value if isinstance(change["kind"], Enum) else change["kind"]
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
    ) -> tuple[nn.Module, PassReport]:
        target = model if inplace else copy_model(model)
        ctx = build_context(target, example_args, example_kwargs)
        report = PassReport(
            self.name, self.kind, graph_method=ctx.captured.method, graph_error=ctx.captured.reason
        )
        for site in self.candidates(ctx):
            reason = self.check(site, ctx)
            if reason is not None:
                report.skips.append(Skip(self.name, site.path, reason))
                continue
            report.changes.append(self.rewrite(site, ctx))
        if ctx.model is not target and inplace:
            _consumed(target, self.name)
        return ctx.model, report

    @abstractmethod
    def candidates(self, ctx: PassContext) -> list[NormSite]:
        """The sites this pass considers; each will either change or be skipped with a reason."""

    @abstractmethod
    def check(self, site: NormSite, ctx: PassContext) -> str | None:
        """None when ``site`` can be rewritten, else the reason it cannot, for a person to read."""

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


def build_context(
    model: nn.Module, example_args: tuple | None = None, example_kwargs: dict[str, Any] | None = None
) -> PassContext:
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
