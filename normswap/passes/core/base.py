"""The pass protocol: one driver for every rewrite, so that what a pass promises holds by construction.

Every pass, whether it edits the module tree (fold BatchNorm, swap a norm), only a layer's parameters
(add/remove weight norm) or an exported graph (fuse an add into a norm), is the same four steps:

1. **prepare** what the whole run shares (recorded module inputs, the residual-stream plan, the norm
   patterns of the graph), once, into a dataclass of the pass's own (:meth:`Pass.prepare`);
2. list the **candidate** sites (:meth:`Pass.candidates`);
3. **check** each into a typed plan, or a :class:`Refusal` (or a plain reason) that the report shows;
4. **apply** each plan, which returns the :class:`Change`.

Steps 2 and 3 are run by one driver, :meth:`Pass.decide`, for every route: :meth:`Pass.__call__`
applies its plans to a module, the streamed route (:mod:`normswap.passes.core.edits`) turns them into
per-tensor edits, the block-by-block route into a shell block's norms; a refusal keeps its typed cause
on every route. Only :meth:`Pass.__call__` decides what a pass may not decide for itself in memory:
copying vs in-place, the context a pass is given (``needs``), and the report. That is why a
pass cannot mutate its input unless asked, cannot forget a skip, and cannot leave state behind: state
between check and apply travels in the plan (typed, built by ``check``), state shared by sites in the
prepared object (typed, built once per run), never in string-keyed caches or by recomputing it.

A pass declares its kind (exact, architectural, data-driven; DESIGN.md) and what context it needs
(:class:`Needs`): a captured graph with the norm inventory, the parameters alone (nothing is
captured), or an exported graph that the pass edits and that becomes the result. Whether a graph the
caller already captured can serve the pass follows from that (:attr:`Pass.reuses_capture`); whether it
still describes the model after the pass is :attr:`Pass.keeps_capture`. With both,
:class:`~normswap.passes.core.pipeline.Pipeline` captures once per graph state, not once per pass.

``inplace=True`` and a new root. Module edits are made on the model itself; the returned model is the
one to use. A change no module edit can express needs a new root (a ``torch.fx.GraphModule``): graph
passes export the model and edit only that export (the input is never touched, the export shares its
parameter tensors), and FoldBatchNorm removes an ``F.batch_norm`` call from the root's forward by
building the new root beside the input, with its own folded copy of the layer, after every module edit
of the run. So the model passed in stays a consistent model (its module edits applied, its own
forward as it was), never a half-rewritten one; no method of a live object is rebound.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch import fx, nn

from normswap.discover import NormInventory, find_norms
from normswap.graph.analysis import GraphView, view_of
from normswap.graph.capture import CapturedGraph, capture_graph, export_module
from normswap.modules.copying import copy_model
from normswap.passes.core.graph_rewrite import finish_graph
from normswap.verify.metrics import record_module_inputs


class RewriteKind(str, Enum):
    EXACT = "exact"
    ARCHITECTURAL = "architectural"
    DATA_DRIVEN = "data-driven"


class Needs(str, Enum):
    """The context a pass works in, which the driver builds.

    ``graph``: a captured graph of the model (export, else fx) and the norm inventory read off it; the
    pass edits the module tree. ``parameters``: the modules alone, nothing captured (a pass that reads
    and writes parameters only). ``exported graph``: a GraphModule exported from the model on the example
    inputs; the pass edits its graph and, when it changed anything, that GraphModule is the result.
    """

    GRAPH = "graph"
    PARAMETERS = "parameters"
    EXPORTED_GRAPH = "exported graph"


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
    # What the rewrite changes inside the model while keeping its outputs (Pass.inside_changes), said
    # on every route whenever the pass changed a site; "" when nothing inside moves.
    inside_changes: str = ""
    # Why the graph this pass rewrote was exported at the example's shapes only (never silent: the
    # rewritten graph, and any program written from it, take those shapes alone).
    graph_fallbacks: list[str] = field(default_factory=list)

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
    """What a pass knows about the model while it works on it; built by the driver for every run.

    For a ``parameters`` pass the inventory is empty and nothing is captured; for an ``exported
    graph`` pass ``model`` is the exported GraphModule and ``view`` its graph."""

    model: nn.Module
    inventory: NormInventory
    captured: CapturedGraph
    view: GraphView | None
    modules: dict[str, nn.Module]
    example_args: tuple | None = None
    example_kwargs: dict[str, Any] | None = None

    @property
    def has_inputs(self) -> bool:
        return self.example_args is not None or bool(self.example_kwargs)

    def replace_model(self, model: nn.Module) -> None:
        """Make ``model`` the one the pass returns (a rewrite of the root's own forward gives a new root);
        its submodules are the old root's, so the inventory and module index stay valid."""
        self.model = model
        self.modules = {**self.modules, "": model}


class RecordedInputs:
    """The input each of some modules sees when the model runs on the example inputs: state a pass's
    sites share, so one forward records them all (at the first question, before any check has let a
    site be applied, so before any of them is replaced). Without example inputs every answer is None."""

    def __init__(self, ctx: PassContext, modules: Sequence[nn.Module]) -> None:
        self._ctx = ctx
        self._modules = list(modules)  # chosen now, while the module tree is the one analyzed
        self._seen: dict[int, torch.Tensor] | None = None

    def of(self, module: nn.Module) -> torch.Tensor | None:
        ctx = self._ctx
        if not ctx.has_inputs:
            return None
        if self._seen is None:
            self._seen = record_module_inputs(ctx.model, self._modules, ctx.example_args, ctx.example_kwargs)
        return self._seen.get(id(module))


class Site(Protocol):
    """What every candidate site has: the name the report shows for it."""

    @property
    def path(self) -> str: ...


SiteT = TypeVar("SiteT", bound=Site)
PlanT = TypeVar("PlanT")
StateT = TypeVar("StateT")

# The site of a refusal that concerns the whole model (no graph to edit).
WHOLE_MODEL = "<model>"


class Pass(ABC, Generic[SiteT, PlanT, StateT]):
    """Base of every pass; see the module doc. Subclasses set ``name``, ``kind`` and ``needs`` and
    implement :meth:`candidates`, :meth:`check` and :meth:`apply` (and :meth:`prepare` when sites share
    per-run state). A plan is a dataclass of the pass's own, never a string (a string is a refusal)."""

    name: ClassVar[str]
    kind: ClassVar[RewriteKind]
    needs: ClassVar[Needs] = Needs.GRAPH
    # True when a graph captured before this pass still describes the model after it, for discovery and
    # every later pass: its edits only replace norm modules by norms whose class says their semantics,
    # at the same call sites, and change parameter values. A pass that removes a module (a folded BN
    # becomes an Identity the stale graph would still show normalizing) or restructures one leaves it False.
    keeps_capture: ClassVar[bool] = False
    # True when the pass reads only module-level facts of a graph (which module feeds which, call counts,
    # shared weights): a faithful fx graph then serves it as well as torch.export's, at a fraction of the
    # cost (normswap.graph.fx_capture). Passes that read op patterns or residual streams leave it False.
    fx_analysis: ClassVar[bool] = False
    # for an exported-graph pass: what it does, in "no example inputs: <doing> needs a captured graph"
    doing: ClassVar[str] = "this pass"
    # An exact pass keeps the model's outputs, not necessarily every value inside it: what a reader of
    # the model's insides (output_hidden_states=True, a forward hook) sees change, in one sentence.
    inside_changes: ClassVar[str] = ""

    @property
    def reuses_capture(self) -> bool:
        """Whether a graph captured of the model as given, on the same inputs, can be this pass's context
        (a parameters-only pass captures nothing; an exported-graph pass edits its own export)."""
        return self.needs is Needs.GRAPH

    def decide(self, ctx: PassContext, state: StateT) -> Iterator[tuple[SiteT, PlanT | Skip]]:
        """The pass's decision, the one driver every route runs (in memory, streamed, block by block):
        each candidate site with its plan, or the :class:`Skip` that refuses it, with its typed cause
        when :meth:`check` gave one. A route turns plans into its own edits; none repeats this loop."""
        for site in self.candidates(ctx, state):
            plan = self.check(site, ctx, state)
            if isinstance(plan, Refusal):
                yield site, Skip(self.name, site.path, plan.reason, plan.cause)
            elif isinstance(plan, str):
                yield site, Skip(self.name, site.path, plan)
            else:
                yield site, plan

    def new_report(self) -> PassReport:
        """An empty report of this pass, for every route that runs its decision (in memory, streamed)."""
        return PassReport(self.name, self.kind, inside_changes=self.inside_changes)

    def __call__(
        self,
        model: nn.Module,
        example_args: tuple | None = None,
        example_kwargs: dict[str, Any] | None = None,
        *,
        inplace: bool = False,
        captured: CapturedGraph | None = None,
    ) -> tuple[nn.Module, PassReport]:
        """Run the pass: ``(model, report)``. The input is left as it was unless ``inplace``; the
        returned model is the one to use either way. ``captured``: a graph already captured of
        ``model`` (or of a model of the same structure) on these inputs, used instead of capturing one
        again when the pass :attr:`reuses_capture`."""
        report = self.new_report()
        ctx = self._context(model, example_args, example_kwargs, inplace, captured, report)
        if ctx is None:
            return model, report
        state = self.prepare(ctx)
        for _site, decided in self.decide(ctx, state):
            if isinstance(decided, Skip):
                report.skips.append(decided)
            else:
                report.changes.append(self.apply(decided, ctx, state))
        if self.needs is not Needs.EXPORTED_GRAPH:
            return ctx.model, report
        if not report.changes:
            return model, report  # nothing fused: the model as it came, not its export
        assert isinstance(ctx.model, fx.GraphModule)
        result = finish_graph(ctx.model, model)
        # the export shares the input's parameter tensors; a result that is not in place owns its own
        return (result if inplace else copy_model(result)), report

    def _context(
        self,
        model: nn.Module,
        example_args: tuple | None,
        example_kwargs: dict[str, Any] | None,
        inplace: bool,
        captured: CapturedGraph | None,
        report: PassReport,
    ) -> PassContext | None:
        """The context ``needs`` asks for, with the report's graph fields filled; None (and the reason
        recorded as a skip of the whole model) when an exported graph cannot be had."""
        if self.needs is Needs.PARAMETERS:
            target = model if inplace else copy_model(model)
            return parameters_context(target, example_args, example_kwargs)
        if self.needs is Needs.GRAPH:
            target = model if inplace else copy_model(model)
            ctx = build_context(
                target, example_args, example_kwargs, captured=captured, fx_first=self.fx_analysis
            )
            report.graph_method = ctx.captured.method
            report.graph_error = ctx.captured.reason
            report.graph_notes = list(ctx.captured.notes)
            return ctx
        if example_args is None and not example_kwargs:
            reason = f"no example inputs: {self.doing} needs a captured graph"
        else:
            # never the input itself that is edited: its export is (see the module doc)
            exported = export_module(model, example_args, example_kwargs, report.graph_fallbacks)
            if not isinstance(exported, str):
                report.graph_method = "export"
                graph = CapturedGraph(exported.graph, "export")
                return PassContext(
                    exported,
                    NormInventory([], graph),
                    graph,
                    GraphView(graph),
                    dict(exported.named_modules()),
                    example_args,
                    example_kwargs,
                )
            reason = exported
        report.graph_error = reason
        report.skips.append(Skip(self.name, WHOLE_MODEL, reason, SkipCause.CAPTURE))
        return None

    def prepare(self, ctx: PassContext) -> StateT:
        """What the sites of one run share, computed once (the default: nothing)."""
        return None  # type: ignore[return-value]

    @abstractmethod
    def candidates(self, ctx: PassContext, state: StateT) -> Sequence[SiteT]:
        """The sites this pass considers; each will either change or be skipped with a reason."""

    @abstractmethod
    def check(self, site: SiteT, ctx: PassContext, state: StateT) -> PlanT | Refusal | str:
        """The plan that rewrites ``site``, or why it must not be rewritten, for a person to read (a
        :class:`Refusal` when the pass knows the cause)."""

    @abstractmethod
    def apply(self, plan: PlanT, ctx: PassContext, state: StateT) -> Change:
        """Carry out one checked plan on ``ctx.model`` and describe the change."""


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


def parameters_context(
    model: nn.Module, example_args: tuple | None = None, example_kwargs: dict[str, Any] | None = None
) -> PassContext:
    """The context of a ``parameters`` pass: the model's modules, no graph and no norm inventory."""
    nothing = CapturedGraph(graph=None, method=None)
    return PassContext(
        model,
        NormInventory([], nothing),
        nothing,
        None,
        dict(model.named_modules()),
        example_args,
        example_kwargs,
    )


def build_context(
    model: nn.Module,
    example_args: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    captured: CapturedGraph | None = None,
    fx_first: bool = False,
) -> PassContext:
    """The context of a ``graph`` pass: a capture of ``model`` (or ``captured``) and its norms.
    ``fx_first``: the pass reads module-level facts only (:attr:`Pass.fx_analysis`)."""
    captured = usable_capture(model, example_args, example_kwargs, captured, fx_first=fx_first)
    inventory = find_norms(model, example_args, example_kwargs, captured=captured)
    view = view_of(captured) if captured.ok else None
    return PassContext(
        model, inventory, captured, view, dict(model.named_modules()), example_args, example_kwargs
    )


def usable_capture(
    model: nn.Module,
    example_args: tuple | None,
    example_kwargs: dict[str, Any] | None,
    captured: CapturedGraph | None,
    *,
    fx_first: bool,
) -> CapturedGraph:
    """``captured`` when it can serve a pass (``fx_first``: one that reads module-level facts only), else
    a new capture of ``model``: an fx graph taken for such a pass is no graph for one that reads op
    patterns, which gets torch.export's."""
    if captured is not None and (fx_first or not captured.ran):
        return captured
    return capture_graph(model, example_args, example_kwargs, fx_first=fx_first)


def replace_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path``, keeping the old module's train/eval mode."""
    old = model.get_submodule(path)
    new.train(old.training)
    model.set_submodule(path, new)
