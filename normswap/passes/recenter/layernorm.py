"""LayerNorm -> RMSNorm without changing the function, by recentering the residual stream (exact).

In a pre-LN transformer every reader of the residual stream is a LayerNorm over the hidden dim, which
ignores the stream's mean. Centering every parameter that writes into the stream (embedding rows,
positional embeddings, class tokens, the output projections of attention and MLP, a patch-embedding
conv: ``W' = W - mean_out(W)``, ``b' = b - mean(b)``) makes the stream zero-mean everywhere, and on a
zero-mean input ``LayerNorm(x) = RMSNorm(x)`` with the same eps, weight and bias. See
:mod:`normswap.graph.stream` for how streams, writers and readers are found on the captured graph.

Refused, per stream and with the reason: a stream value read by anything that sees its mean (post-LN
models such as BERT feed a LayerNorm's output straight into attention), a writer that is not a linear
map with parameter weights (a graph input, a nonlinearity, a per-feature LayerScale), a LayerNorm over
more than the last dim. A token embedding whose matrix something outside the stream also reads (GPT-2's
LM head) keeps its matrix, still tied, and centres the rows it looks up
(:class:`~normswap.modules.centered.CenteredEmbedding`); any other centered weight that something
outside the stream reads is untied: the writer gets a centered copy, the other reader keeps the
original, and a Hugging Face config's ``tie_word_embeddings`` is set to False so that a save/load round
trip does not tie them again (:mod:`.writers` states these edits for every route).

Each refusal carries its cause (:class:`~normswap.passes.core.base.SkipCause`): "architecture" when the
graph shows the stream cannot be recentered or the LayerNorm is not over the last dim (a post-LN model:
the lossy swap is then the only route), "capture" when no graph with shapes could be captured, and
"unsupported" when normswap could not do it here (a functional layer_norm, an unknown eps, a centered
weight that cannot be untied, a stream the analysis cannot judge: an unknown shape, an op it does not
model such as a ``torch.roll`` on the stream, ``Stream.limit``). A skip of the last two kinds could
have been exact.

Streams are shared by many LayerNorms (every block of a pre-LN model reads the same one), so the stream
analysis runs once per pass run, as the pass's prepared :class:`StreamPlan`; a site's plan is the ids of
the streams it reads, and applying it centers each stream the first time a site needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from normswap.discover import NormSite
from normswap.graph.ops import CAST_OPS, op_name
from normswap.graph.stream import close_stream
from normswap.graph.stream_params import Stream
from normswap.modules.centered import CenteredEmbedding
from normswap.passes.core.base import (
    Change,
    Pass,
    PassContext,
    PassReport,
    Refusal,
    RewriteKind,
    Skip,
    SkipCause,
    capture_refusal,
    replace_submodule,
)
from normswap.passes.recenter.writers import (
    WriterEdit,
    center_along,
    named_tensors,
    output_centring,
    stream_edits,
    tensor_aliases,
    untie_problem,
)
from normswap.passes.swap.swap_norm import build_norm


class StreamPlan:
    """Streams of one model, computed once per pass run from the captured graph (the pass's prepared
    state: every site reads it, and applying a site records which streams are centered already)."""

    def __init__(self, ctx: PassContext) -> None:
        assert ctx.view is not None
        self.streams: list[Stream] = []
        self.stream_of: dict[fx.Node, int] = {}
        self.applied: set[int] = set()
        self.centered: set[str] = set()
        self.aliases = tensor_aliases(ctx.model)
        # tied token embeddings that centre their output instead of their matrix (writers.output_centring)
        self.center_outputs: set[str] = set()
        calls = {path: len(found) for path, found in ctx.view.calls.items()}
        # streams refused for a limitation of normswap rather than the model's graph
        self.unsupported: set[int] = set()
        mean_blind = _mean_blind_nodes(ctx)
        self.site_streams: dict[str, list[int]] = {}
        for site in ctx.inventory:
            if site.kind != "layer" or not site.is_module or site.normalized_dims != (-1,):
                continue
            ids = []
            for call in ctx.view.calls.get(site.path, []):
                for seed in call.inputs(ctx.view):
                    if seed not in self.stream_of:
                        stream = close_stream(ctx.view, seed, mean_blind, ctx.modules)
                        if stream.ok:
                            centred = output_centring(stream, ctx.modules, calls, self.aliases)
                            self.center_outputs |= centred
                            stream.reason = untie_problem(ctx.model, stream, centred)
                            if stream.reason is not None:
                                self.unsupported.add(len(self.streams))
                        elif stream.limit:  # the analysis could not tell, the graph did not show it
                            self.unsupported.add(len(self.streams))
                        self.streams.append(stream)
                        for node in (seed, *stream.nodes):  # a refused stream may hold no nodes
                            self.stream_of.setdefault(node, len(self.streams) - 1)
                    ids.append(self.stream_of[seed])
            self.site_streams[site.path] = ids


def _mean_blind_nodes(ctx: PassContext) -> set[fx.Node]:
    """Graph nodes that read a value without seeing its mean over the last dim: LayerNorms over it."""
    assert ctx.view is not None
    nodes: set[fx.Node] = set()
    for site in ctx.inventory:
        if site.kind == "layer" and site.is_module and site.normalized_dims == (-1,):
            for call in ctx.view.calls.get(site.path, []):
                # a cast inside the call (LayerNormFp32's x.float()) passes the value on: export routes
                # later readers of x through it, so it is part of the stream, not a mean-blind reader
                nodes.update(n for n in call.nodes if op_name(n) not in CAST_OPS)
    for node in ctx.view.nodes:
        if op_name(node) == "layer_norm" and node.op == "call_function":
            shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
            if isinstance(shape, (list, tuple)) and len(shape) == 1:
                nodes.add(node)
        elif node.op == "call_module":
            module = ctx.modules.get(str(node.target))
            if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
                nodes.add(node)
    return nodes


def _apply(model: nn.Module, edits: list[WriterEdit]) -> dict[str, list[str]]:
    """Run a stream's edits on ``model``'s own tensors; returns what was changed, for the report."""
    centered, untied = [], []
    # read once: untying only re-points the names of a tensor that is then done, so the rest stay valid
    tensors = dict(named_tensors(model))
    for edit in edits:
        tensor, param = tensors[edit.name], edit.param
        centered.append(edit.describe())
        if edit.center_output:
            assert param is not None
            embedding = model.get_submodule(param.module_path)
            replace_submodule(model, param.module_path, CenteredEmbedding.sharing(embedding))
        elif param is None:
            with torch.no_grad():
                tensor.fill_(1.0)
        elif not edit.keep_original:
            # in place: a large writer (an embedding) is not held twice
            center_along(tensor, param.dim, tensors[param.scale] if param.scale else None, out=tensor)
        else:
            value = center_along(tensor, param.dim, tensors[param.scale] if param.scale else None)
            if isinstance(tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=tensor.requires_grad)
            for holder in edit.rewritten:
                owner, _, attr = holder.rpartition(".")
                setattr(model.get_submodule(owner), attr, value)
                untied.append(f"{holder} (kept the original for {', '.join(edit.keep_original)})")
    config = getattr(model, "config", None)
    if untied and config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False  # else a Hugging Face save/load round trip ties them again
    return {"centered": centered, "untied": untied}


@dataclass(frozen=True)
class RecenterPlan:
    """A LayerNorm whose input streams can all be recentered: the ids of those streams."""

    site: NormSite
    streams: tuple[int, ...]


class RecenterLayerNorm(Pass[NormSite, RecenterPlan, StreamPlan | None]):
    """Replace LayerNorms that read a recenterable residual stream by RMSNorms, exactly."""

    name = "recenter_layernorm"
    kind = RewriteKind.EXACT
    inside_changes = (
        "the residual stream is recentred (each token's mean over the hidden dim removed): hidden states "
        "read from inside the model (output_hidden_states=True, hooks on its blocks or embeddings) differ "
        "from the original's; the model's outputs do not"
    )
    keeps_capture = True  # norms become normswap's own norm classes; weights change value only

    def prepare(self, ctx: PassContext) -> StreamPlan | None:
        # the stream analysis reads shapes, which only torch.export records
        if ctx.view is None or ctx.captured.method != "export":
            return None
        return StreamPlan(ctx)

    def candidates(self, ctx: PassContext, state: StreamPlan | None) -> list[NormSite]:
        return [s for s in ctx.inventory if s.kind == "layer"]

    def check(self, site: NormSite, ctx: PassContext, state: StreamPlan | None) -> RecenterPlan | Refusal:
        unsupported = SkipCause.UNSUPPORTED
        if not site.is_module:
            return Refusal(
                f"{site.source} layer_norm {site.inside()}, not a module: replacing it needs a graph rewrite",
                unsupported,
            )
        if site.normalized_dims != (-1,):
            return Refusal(
                f"normalizes dims {site.normalized_dims}; only a LayerNorm over the last dim equals RMSNorm "
                "on a centered input",
                SkipCause.ARCHITECTURE,
            )
        if site.normalized_shape is None or site.eps is None:
            return Refusal("its normalized shape or eps could not be determined", unsupported)
        if state is None:
            return capture_refusal(ctx, "the residual stream")
        ids = state.site_streams.get(site.path, [])
        if not ids:
            return Refusal("its input could not be found in the captured graph", unsupported)
        for i in ids:
            reason = state.streams[i].reason
            if reason is not None:
                cause = unsupported if i in state.unsupported else SkipCause.ARCHITECTURE
                return Refusal(f"input stream cannot be recentered: {reason}", cause)
        return RecenterPlan(site, tuple(ids))

    def apply(self, plan: RecenterPlan, ctx: PassContext, state: StreamPlan | None) -> Change:
        site, streams = plan.site, state
        assert streams is not None
        details: dict[str, Any] = {"streams": list(plan.streams), "centered": [], "untied": []}
        for i in plan.streams:
            if i not in streams.applied:
                streams.applied.add(i)
                done = _apply(
                    ctx.model,
                    stream_edits(
                        streams.streams[i], streams.aliases, streams.centered, streams.center_outputs
                    ),
                )
                details["centered"] += done["centered"]
                details["untied"] += done["untied"]
        old = site.module
        assert old is not None
        new = build_norm("rms", site, old)
        replace_submodule(ctx.model, site.path, new)
        details.update(from_class=type(old).__name__, to_class=type(new).__name__)
        what = f"{type(old).__name__} -> {type(new).__name__}, exact on the recentered stream"
        if details["centered"]:
            what += f" (centered {len(details['centered'])} writers"
            what += f", untied {len(details['untied'])})" if details["untied"] else ")"
        return Change(self.name, site.path, self.kind, what, details)


def lossy_after_failure(reports: list[PassReport]) -> list[Skip]:
    """The LayerNorms this pass skipped for a failure (cause "capture" or "unsupported": they might have
    been exact) that a later pass of the same run then changed anyway: a lossy result the user did not
    get by the model's architecture. ``reports`` are a pipeline's pass reports, in order."""
    failed: dict[str, Skip] = {}
    lossy: list[Skip] = []
    for report in reports:
        if report.pass_name == RecenterLayerNorm.name:
            causes = (SkipCause.CAPTURE, SkipCause.UNSUPPORTED)
            failed.update({s.site: s for s in report.skips if s.cause in causes})
        elif report.kind is not RewriteKind.EXACT:
            lossy += [failed.pop(c.site) for c in report.changes if c.site in failed]
    return lossy
