"""Verify a rewritten model directory against its original block by block, never holding either model.

Each model is run in a *shell*: the model its config builds with one block (embeddings, final norm, head
and the buffers computed at construction, such as rotary frequencies, all real), whose one block takes
the weights of block ``i`` in turn. The original runs through all its blocks first, keeping their inputs
and outputs; then the converted model's shell replaces it. So memory is one model's embeddings, head and
block, and the activations, whatever the number of blocks.

The check, with ``relate`` the map from an original activation to the converted model's (the identity
for folds; centering over the hidden dim for a recentered residual stream):

1. the inputs of block 0 (hidden states, and everything else the model hands its blocks: masks,
   position embeddings) are recorded in both shells: ``relate(h0)`` against the converted ``h0'``;
2. block ``i`` runs on the original's activation ``h`` in the original shell and on ``relate(h)`` in the
   converted one: ``relate(block(h))`` against ``block'(relate(h))``; the next block takes the
   original's output, so an error does not carry over and the first diverging block is named;
3. the head (final norm, LM head) runs on the last activation in both: logits against logits;
4. asked ``end_to_end`` (``validate``, whose SQNR threshold is judged on outputs as for the whole
   model), the converted model also runs through its own blocks from its own embeddings, and its
   output is compared with the original's: the figure the whole-model comparison gives.

Every comparison is held to the exact tolerance of the dtype (:mod:`normswap.util.tolerance`); a NaN or
Inf in the converted model's activation fails its stage and says where, one in the original's refuses
the original as broken (:mod:`normswap.util.finite`). Blocks are the children of the model's largest
list of same-class modules (``model.layers``, ``transformer.h``). A block runs in the shell's block 0:
layers configured by index (alternating sliding windows) run as block 0 is, in both models alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError
from normswap.load.checkpoint_dir import CheckpointDirectory, build_on_meta, stored_tensor_reader
from normswap.util.shapes import format_shapes, input_shapes
from normswap.verify.block_shell import BlockShell, shell_names
from normswap.verify.finite import refuse_nonfinite_outputs
from normswap.verify.metrics import PooledSqnr, TensorComparison, compare_tensors

Relate = Callable[[torch.Tensor], torch.Tensor]


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def centered(x: torch.Tensor) -> torch.Tensor:
    """The residual stream as a recentered model carries it: minus its mean over the hidden dim."""
    mean = x.double().mean(dim=-1, keepdim=True)
    return (x.double() - mean).to(x.dtype)


@dataclass
class BlockwiseReport:
    """Per stage (``embeddings``, ``block 0``..., ``head``), the comparison of the converted model with
    the original; ``first_divergent`` names the first stage outside the tolerance (None: all within)."""

    stages: list[tuple[str, TensorComparison]] = field(default_factory=list)
    blocks_path: str = ""
    # end to end (when asked): the converted model run through its own blocks, against the original's
    # output, as the whole-model comparison measures it; its signal and noise pool over inputs
    output: TensorComparison | None = None
    output_sqnr: PooledSqnr | None = None

    @property
    def ok(self) -> bool:
        return bool(self.stages) and all(c.within_tolerance for _, c in self.stages)

    @property
    def first_divergent(self) -> str | None:
        return next((stage for stage, c in self.stages if not c.within_tolerance), None)

    @property
    def failure(self) -> str | None:
        """The first stage outside the tolerance, and how far (or where it holds a NaN or Inf)."""
        stage = next(((s, c) for s, c in self.stages if not c.within_tolerance), None)
        if stage is None:
            return None if self.stages else "no stage was compared"
        name, c = stage
        if c.nonfinite:
            return f"{name}: {c.nonfinite}"
        return f"{name}: {c.max_rel:.3g} x max|ref| (tolerance {c.tolerance:g})"

    @property
    def worst_rel(self) -> float:
        """The largest max_abs / max|ref| of the stages; NaN when a stage holds a NaN or Inf."""
        if any(c.nonfinite for _, c in self.stages):
            return float("nan")
        return max((c.max_rel for _, c in self.stages), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "blocks": self.blocks_path,
            "first_divergent": self.first_divergent,
            "failure": self.failure,
            "stages": [
                {
                    "stage": s,
                    "max_rel": c.max_rel,
                    "sqnr_db": c.sqnr_db,
                    "within_tolerance": c.within_tolerance,
                    "nonfinite": c.nonfinite,
                }
                for s, c in self.stages
            ],
            "output": None
            if self.output is None
            else {
                "max_rel": self.output.max_rel,
                "sqnr_db": self.output.sqnr_db,
                "cosine": self.output.cosine,
                "nonfinite": self.output.nonfinite,
            },
        }


def _layout(module: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(p.shape)) for name, p in module.named_parameters()]


def block_list(module: nn.Module) -> list[nn.Module]:
    """The items of a ModuleList, or of what ``torch.export.unflatten`` rebuilds a ModuleList as (its own
    module class, children named 0, 1, ... in order, which all have one class there): those count as one
    list of blocks when the children hold the same parameters (names and shapes), as blocks of one class
    do. Empty for anything else (an nn.Sequential: a stage of layers, not a list of blocks)."""
    if isinstance(module, nn.ModuleList):
        return list(module)
    named = list(module.named_children())
    unflattened = type(module).__module__ == "torch.export.unflatten"
    if unflattened and named and [name for name, _ in named] == [str(i) for i in range(len(named))]:
        children = [child for _, child in named]
        if _layout(children[0]) and all(_layout(c) == _layout(children[0]) for c in children):
            return children
    return []


def find_blocks(model: nn.Module) -> tuple[str, int]:
    """The path of the model's blocks (the largest ModuleList of one class, by parameter count) and their
    number; BadInputError when it has none."""
    best: tuple[int, str, int] | None = None
    for name, module in model.named_modules():
        children = block_list(module)
        if not children or len({type(child) for child in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, len(children))
    if best is None:
        raise BadInputError("the model has no list of blocks (a ModuleList of one module class) to verify by")
    return best[1], best[2]


def blockwise_problem(model: nn.Module) -> str | None:
    """Why ``model`` (a transformers model, on the meta device is enough) cannot be verified block by
    block (None when it can): the shell is the model its config builds with ``num_hidden_layers = 1``,
    whose block 0 takes each block's weights in turn, so the blocks must be what that setting counts and
    all of one shape (ConvNext's stages are neither: their widths grow)."""
    try:
        blocks, count = find_blocks(model)
    except BadInputError as exc:
        return str(exc)
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if layers != count:
        return f"the block-by-block verification builds a one-block model from the config, whose num_hidden_layers ({layers}) does not count the {count} blocks of {blocks}"
    children = list(model.get_submodule(blocks))
    shapes = [{k: tuple(v.shape) for k, v in child.state_dict().items()} for child in children]
    if any(s != shapes[0] for s in shapes[1:]):
        return f"the block-by-block verification runs every block in one slot, and the blocks of {blocks} differ in shape"
    return None


class _Resident:
    """A model held in memory, seen as a shell: its blocks are its own (no weight is copied), the head
    reads its last block."""

    def __init__(self, model: nn.Module, blocks: str, count: int) -> None:
        self.model = model
        self.blocks = blocks
        self.last_block = f"{blocks}.{count - 1}"

    def take_block(self, index: int) -> nn.Module:
        return self.model.get_submodule(f"{self.blocks}.{index}")


Shell = BlockShell | _Resident


class _Stop(Exception):
    pass


# What a block may be handed as a key/value cache: each call appends to it, so memory would grow with
# every block and input, and a block would attend to the keys the blocks run before it left there.
# transformers names a block's cache past_key_value(s) (4.x), cache (5.x), cache_params (Mamba), GPT-2's
# layer_past; the object is a transformers Cache whatever its name
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache", "cache_params")


def _is_cache(value: Any) -> bool:
    return any(cls.__name__.endswith("Cache") for cls in type(value).__mro__)


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A block's keyword inputs with no key/value cache: each block run alone, as in one forward (a cache
    kept across the runs grows: the second block would attend over the first block's keys too)."""
    return {k: None if k in _CACHE_KWARGS or _is_cache(v) else v for k, v in kwargs.items()}


def block_inputs(shell: Shell, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """What the model hands its first block: recorded by a hook that stops the forward there."""
    seen: dict[str, Any] = {}

    def record(module: nn.Module, block_args: tuple, block_kwargs: dict[str, Any]) -> None:
        seen["args"], seen["kwargs"] = block_args, block_kwargs
        raise _Stop

    block = shell.model.get_submodule(f"{shell.blocks}.0")
    handle = block.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            shell.model(*args, **kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise BadInputError("the model's forward never reached its first block")
    return seen["args"], without_cache(seen["kwargs"])


def block_hidden(block_args: tuple, block_kwargs: dict[str, Any]) -> torch.Tensor:
    if block_args:
        return block_args[0]
    return block_kwargs["hidden_states"]


def with_hidden(block_args: tuple, block_kwargs: dict[str, Any], hidden: torch.Tensor) -> tuple[tuple, dict]:
    if block_args:
        return (hidden, *block_args[1:]), block_kwargs
    return block_args, {**block_kwargs, "hidden_states": hidden}


def first_output(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def head_output(shell: Shell, args: tuple, kwargs: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
    """The model's output when its last block's output is ``hidden``: the shell's block is made to return
    it (same structure as the block's own output)."""

    def replace(module: nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return hidden
        return (hidden, *output[1:])

    block = shell.model.get_submodule(shell.last_block)
    handle = block.register_forward_hook(replace)
    try:
        with torch.no_grad():
            out = shell.model(*args, **kwargs)
    finally:
        handle.remove()
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = getattr(out, "last_hidden_state", None)
    if logits is None:
        logits = first_output(out)
    return logits


def _run_original(
    shell: Shell, count: int, inputs: list[tuple[tuple, dict[str, Any]]], say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every block's input and output, and the model's output, of the original on each input; an
    original whose block computes NaN/Inf is refused as broken, as the in-memory route refuses it."""
    shell.take_block(0)
    runs = []
    for args, kwargs in inputs:
        block_args, block_kwargs = block_inputs(shell, args, kwargs)
        runs.append(
            {"args": block_args, "kwargs": block_kwargs, "hidden": [block_hidden(block_args, block_kwargs)]}
        )
    for index in range(count):
        say(f"verifying: original block {index + 1}/{count}")
        block = shell.take_block(index)
        for run, (args, kwargs) in zip(runs, inputs, strict=True):
            in_args, in_kwargs = with_hidden(run["args"], run["kwargs"], run["hidden"][-1])
            with torch.no_grad():
                run["hidden"].append(first_output(block(*in_args, **in_kwargs)))
            refuse_nonfinite_outputs(run["hidden"][-1], _shapes(args, kwargs), prefix=f"block {index} output")
    for run, (args, kwargs) in zip(runs, inputs, strict=True):
        run["output"] = head_output(shell, args, kwargs, run["hidden"][-1])
        refuse_nonfinite_outputs(run["output"], _shapes(args, kwargs))
    return runs


def _shapes(args: tuple, kwargs: dict[str, Any]) -> str:
    return f"the inputs {format_shapes(input_shapes(args, kwargs))}"


def verify_blockwise(
    original: CheckpointDirectory,
    converted: CheckpointDirectory,
    inputs: list[tuple[tuple, dict[str, Any]]],
    relate: Relate = identity,
    on_block: Callable[[str], None] | None = None,
    changed: list[str] | None = None,
    user_names: tuple[str, str] | None = None,
    end_to_end: bool = False,
) -> list[BlockwiseReport]:
    """Compare ``converted`` with ``original`` stage by stage on each of ``inputs`` (``(args, kwargs)``
    pairs), one report per input (see the module doc). ``user_names``: both are the user's (``validate``),
    held to the broken-model rule under those names; else the converted is our output, whose NaN fails
    the comparison. ``changed``: the modules the rewrite changed; one inside the last block whose change
    reaches past it (a post-LN model's last norm folded into the head) moves that block's output by
    design, so a changed last block is checked through the head (its output fed to the converted head).

    The original runs first, through all its blocks, keeping each block's input and output (activations
    are small beside weights); its shell is then dropped and the converted model runs block by block on
    those inputs. So one model's shell is in memory at a time, and each block is read once."""
    ours, theirs = build_on_meta(original), build_on_meta(converted)
    blocks, count = _same_blocks(find_blocks(ours), find_blocks(theirs))
    last = f"{blocks}.{count - 1}."
    if changed is None:  # a comparison of two directories (validate): the last block's stored tensors say
        names = shell_names(ours, original), shell_names(theirs, converted)
        changed = _changed_tensors(original, converted, last, names)
    return _compare(
        lambda: BlockShell(original, blocks, checked=user_names[0] if user_names else "the model"),
        lambda: BlockShell(converted, blocks, checked=user_names[1] if user_names else None),
        count,
        inputs,
        relate,
        on_block,
        chain_last=any(name.startswith(last) for name in changed or ()),
        end_to_end=end_to_end,
    )


def _changed_tensors(
    original: CheckpointDirectory,
    converted: CheckpointDirectory,
    prefix: str,
    names: tuple[dict[str, str], dict[str, str]],
) -> list[str]:
    """The model's tensors under ``prefix`` (one block) that the two directories store differently, each
    read under the name its directory stores it by (``names``: :func:`shell_names` of each)."""
    ours, theirs = (
        stored_tensor_reader(original, checked=False),
        stored_tensor_reader(converted, checked=False),
    )
    found = []
    for name, stored in names[0].items():
        if not name.startswith(prefix):
            continue
        if name not in names[1]:
            found.append(name)
            continue
        a, b = ours(stored), theirs(names[1][name])
        if a.shape != b.shape or not torch.equal(a, b):
            found.append(name)
    return found


def verify_blockwise_models(
    original: nn.Module,
    converted: nn.Module,
    inputs: list[tuple[tuple, dict[str, Any]]],
    relate: Relate = identity,
    on_block: Callable[[str], None] | None = None,
    end_to_end: bool = False,
) -> list[BlockwiseReport]:
    """:func:`verify_blockwise` for two models in memory (the same model class, or the same list of
    blocks): every block of ``converted`` runs on the original's activation of that block, so the first
    block outside the exact tolerance is named, and an error does not carry over to later blocks
    (``end_to_end`` as there)."""
    blocks, count = _same_blocks(find_blocks(original), find_blocks(converted))
    return _compare(
        lambda: _Resident(original, blocks, count),
        lambda: _Resident(converted, blocks, count),
        count,
        inputs,
        relate,
        on_block,
        end_to_end=end_to_end,
    )


def _same_blocks(ours: tuple[str, int], theirs: tuple[str, int]) -> tuple[str, int]:
    """The blocks (path, count) of both models; a block of one cannot run on the other's activations."""
    if theirs == ours:
        return ours
    what = f"ORIGINAL has {ours[1]} in {ours[0]}, CONVERTED {theirs[1]} in {theirs[0]}"
    raise BadInputError(f"the models' blocks differ: {what}")


def _compare(
    make_original: Callable[[], Shell],
    make_converted: Callable[[], Shell],
    count: int,
    inputs: list[tuple[tuple, dict[str, Any]]],
    relate: Relate,
    on_block: Callable[[str], None] | None,
    chain_last: bool = False,
    end_to_end: bool = False,
) -> list[BlockwiseReport]:
    say = on_block or (lambda _: None)
    shell = make_original()
    blocks = shell.blocks
    runs = _run_original(shell, count, inputs, say)
    del shell
    shell = make_converted()
    shell.take_block(0)
    reports = []
    for run, (args, kwargs) in zip(runs, inputs, strict=True):
        report = BlockwiseReport(blocks_path=f"{blocks} ({count} blocks)")
        run["c_args"], run["c_kwargs"] = block_inputs(shell, args, kwargs)
        theirs = block_hidden(run["c_args"], run["c_kwargs"])
        report.stages.append(("embeddings", compare_tensors("embeddings", relate(run["hidden"][0]), theirs)))
        run["own"] = theirs  # end to end: the converted model's own activation, block after block
        reports.append(report)
    for index in range(count):
        say(f"verifying: converted block {index + 1}/{count}")
        block = shell.take_block(index)
        for report, run in zip(reports, runs, strict=True):
            in_args, in_kwargs = with_hidden(run["c_args"], run["c_kwargs"], relate(run["hidden"][index]))
            with torch.no_grad():
                out = first_output(block(*in_args, **in_kwargs))
            if end_to_end:
                own_args, own_kwargs = with_hidden(run["c_args"], run["c_kwargs"], run["own"])
                with torch.no_grad():
                    run["own"] = first_output(block(*own_args, **own_kwargs))
            want = relate(run["hidden"][index + 1])
            compared = compare_tensors(f"block {index}", want, out)
            if chain_last and index == count - 1 and not compared.within_tolerance:
                run["last"] = (out, compared)  # its output may move by design: tried through the head
                continue
            report.stages.append((f"block {index}", compared))
    for report, run, (args, kwargs) in zip(reports, runs, inputs, strict=True):
        if end_to_end:
            own = head_output(shell, args, kwargs, run["own"])
            report.output = compare_tensors("output", run["output"], own)
            report.output_sqnr = PooledSqnr()
            report.output_sqnr.add(run["output"], own)
        if "last" in run:
            out, alone = run["last"]
            stage = f"block {count - 1} + head"
            through = compare_tensors(stage, run["output"], head_output(shell, args, kwargs, out))
            if through.within_tolerance:  # the function is the original's: the block's output moved
                report.stages.append((stage, through))
                continue
            report.stages.append((f"block {count - 1}", alone))  # a divergence, named where it is
        logits = head_output(shell, args, kwargs, relate(run["hidden"][-1]))
        report.stages.append(("head", compare_tensors("head", run["output"], logits)))
    return reports
