"""Hand-written norms of a flat program put back into modules of their own, so that module rewrites reach them.

An HF Llama exported with plain ``torch.export`` computes its RMSNorm as ops in the root's graph
(``x * rsqrt(mean(x^2) + eps) * w``); ``ExportedProgram.module()`` keeps each norm's weight on a bare
holder module that nothing calls. Replacing that holder would change nothing the model computes, so
discovery sees such norms inside the root's forward and every module rewrite skips them. Here each such
norm whose tensors are all its holder's, and whose intermediate values nothing else reads, is cut out of
the root's graph into a ``GraphModule`` at the holder's path that runs exactly those nodes (the same ops
in the same order: the function does not change by one bit), and the root calls it. Discovery then finds a
module whose forward is exactly a norm (a ``structural`` site), which rewrites swap, fold or fuse like any
other. State-dict keys and tensor objects are unchanged.
"""

from __future__ import annotations

from torch import fx, nn

from normswap.graph.ops import CAST_OPS, CHECK_OPS, op_name


def _holder_path(gm: fx.GraphModule, attrs: list[fx.Node]) -> str | None:
    """The path of the bare module that holds exactly the tensors ``attrs`` read, all read by the norm."""
    prefixes = {str(a.target).rpartition(".")[0] for a in attrs}
    if len(prefixes) != 1 or not (prefix := prefixes.pop()):
        return None
    try:
        holder = gm.get_submodule(prefix)
    except AttributeError:
        return None
    held = {name for name, _ in holder.named_parameters(recurse=False)}
    held |= {name for name, _ in holder.named_buffers(recurse=False)}
    read = {str(a.target).rpartition(".")[2] for a in attrs}
    if type(holder) is not nn.Module or list(holder.children()) or held != read:
        return None
    return prefix


def _cut(gm: fx.GraphModule, match: object, moved: dict[fx.Node, fx.Node]) -> bool:
    """Move one matched norm into a GraphModule at its holder's path; False (nothing changed) when it
    cannot be cut out whole. ``moved``: the outputs of norms cut out before, and the calls now in their
    place (a norm that reads another's output reads the call)."""
    nodes: set[fx.Node] = set(match.nodes)  # type: ignore[attr-defined]
    output = match.output  # type: ignore[attr-defined]
    source = moved.get(match.input, match.input)  # type: ignore[attr-defined]  # a norm cut out before
    if not nodes | {source} <= set(gm.graph.nodes):
        return False  # overlaps a norm already cut out
    # a cast of the input that the graph also reads elsewhere (export shares HF's no-op .to(float32) with
    # the residual add) stays in the root: the module takes the cast value, the same ops run
    while True:
        shared = next(
            (
                n
                for n in nodes
                if op_name(n) in CAST_OPS and n.args and n.args[0] is source and len(n.users) > 1
            ),
            None,
        )
        if shared is None or shared is output:
            break
        nodes.discard(shared)
        source = shared
    attrs = [a for n in nodes for a in n.all_input_nodes if a.op == "get_attr"]
    if (
        not attrs
        or source in nodes
        or any(len(a.users) != 1 or next(iter(a.users)) not in nodes for a in attrs)
    ):
        return False
    prefix = _holder_path(gm, attrs)
    if prefix is None:
        return False
    # the checks torch put on intermediate values travel with them
    checks = {u for n in nodes for u in n.users if u not in nodes and op_name(u) in CHECK_OPS and not u.users}
    inside = nodes | checks | set(attrs)
    for n in nodes - {output}:
        if any(u not in inside for u in n.users):
            return False  # an intermediate value read elsewhere: not a norm alone
    for n in inside - set(attrs):
        if any(a not in inside and a is not source for a in n.all_input_nodes):
            return False  # reads something other than its input and its own tensors
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {source: graph.placeholder("x")}
    for n in gm.graph.nodes:  # graph order is an order the nodes can run in
        if n not in inside:
            continue
        if n.op == "get_attr":
            env[n] = graph.get_attr(str(n.target).rpartition(".")[2])
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[output])
    holder = gm.get_submodule(prefix)
    gm.set_submodule(prefix, fx.GraphModule(holder, graph, class_name="LiftedNorm"))
    with gm.graph.inserting_before(output):
        call = gm.graph.call_module(prefix, (source,))
    call.meta = dict(output.meta)
    output.replace_all_uses_with(call)
    moved[output] = call
    for n in reversed(list(gm.graph.nodes)):
        if n in inside:
            gm.graph.erase_node(n)
    return True


def lift_norm_patterns(gm: fx.GraphModule) -> int:
    """Cut every hand-written LayerNorm/RMSNorm of ``gm``'s root graph that reads only its own holder's
    tensors into a module at that holder's path (see the module docstring), in place; returns how many."""
    from normswap.graph.analysis import GraphView
    from normswap.graph.capture import CapturedGraph
    from normswap.graph.patterns import find_norm_patterns

    view = GraphView(CapturedGraph(graph=gm.graph, method="fx"))
    matches = [m for m in find_norm_patterns(view, gm) if m.kind in ("rms", "layer")]
    moved: dict[fx.Node, fx.Node] = {}  # a cut norm's output -> the call that replaced it
    lifted = sum(_cut(gm, match, moved) for match in matches)
    if lifted:
        gm.graph.lint()
        gm.recompile()
    return lifted
