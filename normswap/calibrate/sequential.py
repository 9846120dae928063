"""Calibrate swapped norms block by block, never holding the model: sequential onloading.

The model runs in a shell (:class:`normswap.verify.block_shell.BlockShell`: its config with one block,
whose block takes block ``i``'s weights in turn; embeddings, final norm and head real). Every
calibration batch is carried from block to block in three streams of hidden states (kept by an
:class:`~normswap.calibrate.activations.ActivationStore`, on disk past its budget):

- ``o``: the original model's;
- ``c``: the converted model's, every norm before it already calibrated;
- ``u``: the converted model's without calibration (for the "before" figures only).

For block ``i``: the original block runs on ``o`` (its norms' outputs are the targets); its norms are
swapped in place (each new norm built from the original's weights and its input on the example inputs);
the uncalibrated block runs on ``u``; each swapped norm, in execution order, is fitted on its inputs
when the block runs on ``c`` (:func:`normswap.calibrate.affine_fit.fit_site`: the closed-form
per-feature affine, BatchNorm statistics, S-curve scalars); the fitted block runs on ``c``; the block
is handed to ``on_block`` (which writes it) and its original norms are put back.

This is the in-memory fit (:func:`~normswap.calibrate.affine_fit.calibrate_swapped_norms`) computed in
another order: there, site ``k``'s inputs come from the whole converted model with the sites before it
calibrated and its targets from the whole original. A block's input depends only on the blocks before
it, so both routes feed every fit the same tensors (up to the order of float sums) and fit the same
parameters. Norms outside the blocks are fitted the same way: those that run before the first block
(an embedding LayerNorm) first, those after the last (a final norm) on the shell's head.

The batches are fed as the in-memory fit feeds them (:func:`normswap.calibrate.feeding.fed`, the one
rule): their keywords fitted to the model's forward, cast to its floating dtype, each change said once in
the report's ``notes``; and a batch the original cannot run on is the data's fault, said in the same
sentence (:func:`~normswap.calibrate.feeding.data_fault`), wherever in the model it fails.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.calibrate.activations import ActivationStore
from normswap.calibrate.affine_fit import SiteFit, call_order, fit_site, recording
from normswap.calibrate.data import ModelInputs
from normswap.calibrate.feeding import data_fault, fed
from normswap.verify.block_shell import BlockShell
from normswap.verify.blockwise import (
    block_hidden,
    block_inputs,
    first_output,
    head_output,
    with_hidden,
)
from normswap.verify.metrics import PooledSqnr, TensorComparison, compare_tensors

# (full module path, the original norm with its weights, its input on the example inputs) -> the new norm
Build = Callable[[str, nn.Module, torch.Tensor | None], nn.Module]


@dataclass
class BlockFit:
    """The hidden states after block ``block`` against the original's, worst calibration batch: the
    converted model without calibration (``before``) and calibrated up to this block (``after``)."""

    block: int
    sqnr_before_db: float
    sqnr_after_db: float


@dataclass
class SequentialCalibrationReport:
    batches: int
    blocks_path: str
    blocks: list[BlockFit] = field(default_factory=list)
    sites: list[SiteFit] = field(default_factory=list)
    # the model's output against the original's on the calibration data, worst batch
    model_sqnr_before_db: float | None = None
    model_sqnr_after_db: float | None = None
    # after calibration, on the example inputs (not among the calibration batches)
    example: TensorComparison | None = None
    activation_budget: int = 0
    activations_peak_held: int = 0
    activations_spilled: int = 0
    # what feeding the batches to the model changed in them (feeding's rule: the in-memory fit's notes)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def _swapped(model: nn.Module, modules: dict[str, nn.Module]) -> Iterator[None]:
    """``model`` with ``modules`` at their paths (in the old modules' mode), the old ones back on exit."""
    old = {path: model.get_submodule(path) for path in modules}
    for path, new in modules.items():
        new.train(old[path].training)
        model.set_submodule(path, new)
    try:
        yield
    finally:
        for path, module in old.items():
            model.set_submodule(path, module)


def _run_block(block: nn.Module, run: tuple[tuple, dict[str, Any]], hidden: torch.Tensor) -> torch.Tensor:
    args, kwargs = with_hidden(run[0], run[1], hidden)
    with torch.no_grad():
        return first_output(block(*args, **kwargs))


class _Calibration:
    """One sequential calibration's state: the shell, the streams, the batches' block inputs."""

    def __init__(
        self,
        shell: BlockShell,
        batches: list[ModelInputs],
        example: ModelInputs,
        store: ActivationStore,
        build: Build,
        report: SequentialCalibrationReport,
    ) -> None:
        self.shell = shell
        # the batches as the model takes them (feeding's one rule, as in memory: the same batches on both
        # routes); the example inputs last, as the config made them: index n, never fitted on
        self.inputs = [*(fed(shell.model, b, report.notes) for b in batches), example]
        self.n = len(batches)
        self.store = store
        self.build = build
        self.report = report
        # per batch, what the model hands its first block (masks, position embeddings), the hidden aside
        self.runs: list[tuple[tuple, dict[str, Any]]] = []

    def original(self, b: int) -> contextlib.AbstractContextManager[None]:
        """Around batch ``b``'s run through a part of the original (the in-memory fit's first run of each
        batch): a failure there is the data's. The example inputs are the config's: a failure is a bug."""
        if b == self.n:
            return contextlib.nullcontext()
        return data_fault(self.shell.model, self.inputs[b], f"calibration batch {b}")

    def fit(
        self, path: str, module: nn.Module, targets: list[torch.Tensor], run: Callable[[int], Any], name: str
    ) -> None:
        """Fit ``module`` (at ``path`` of the shell's model; ``name`` in the model) on its inputs while
        ``run(b)`` runs calibration batch ``b``."""
        with recording(self.shell.model, [path], "input") as seen:
            for b in range(self.n):
                run(b)
        fit = fit_site(module, seen[path], targets)
        if isinstance(fit, str):
            fit = SiteFit(name, type(module).__name__, math.nan, math.nan, note=fit)
        fit.site = name
        self.report.sites.append(fit)

    def embeddings(self, outside: list[str]) -> tuple[list[str], dict[str, nn.Module]]:
        """The streams' first hidden states, and the swapped norms that run before the first block (fitted);
        returns the outside norms that run after the last block, and the new pre-block norms."""
        shell, store = self.shell, self.store
        model = shell.model
        shell.take_block(0)
        with (
            recording(model, outside, "output") as targets,
            recording(model, outside, "input") as inputs,
            call_order(model, outside) as order,
        ):
            for b, batch in enumerate(self.inputs):
                with self.original(b):
                    args, kwargs = block_inputs(shell, batch.args, batch.kwargs)
                store.put(("o", b), block_hidden(args, kwargs))
                self.runs.append(with_hidden(args, kwargs, None))  # type: ignore[arg-type]
        pre = [p for p in order if targets[p]]
        news = {p: self.build(p, model.get_submodule(p), inputs[p][self.n]) for p in pre}
        del inputs

        def embed(b: int) -> torch.Tensor:
            batch = self.inputs[b]
            return block_hidden(*block_inputs(shell, batch.args, batch.kwargs))

        with _swapped(model, news):
            for b in range(self.n + 1):
                store.put(("u", b), embed(b) if news else store.get(("o", b)))
            for p in pre:
                self.fit(p, news[p], targets[p][: self.n], embed, p)
            for b in range(self.n + 1):
                store.put(("c", b), embed(b) if news else store.get(("o", b)))
        return [p for p in outside if p not in pre], news

    def block(self, index: int, inside: list[str], on_block: Callable[[int, nn.Module], None]) -> None:
        shell, store, n = self.shell, self.store, self.n
        block = shell.take_block(index)
        prefix = f"{shell.blocks}.0."  # the shell's block, seen from its model
        with recording(block, inside, "input") as inputs:  # the example inputs: each new norm's sample
            store.put(("o", n), _run_block(block, self.runs[n], store.get(("o", n))))
        with recording(block, inside, "output") as targets, call_order(block, inside) as order:
            for b in range(n):
                hidden = store.get(("o", b))
                with self.original(b):
                    hidden = _run_block(block, self.runs[b], hidden)
                store.put(("o", b), hidden)
        order += [p for p in inside if p not in order]
        full = {p: f"{shell.blocks}.{index}.{p}" for p in inside}
        news = {p: self.build(full[p], block.get_submodule(p), inputs[p][0]) for p in inside}
        del inputs
        with _swapped(block, news):
            before = PooledSqnr()
            for b in range(n):
                hidden = _run_block(block, self.runs[b], store.get(("u", b)))
                before.add(store.get(("o", b)), hidden)
                store.put(("u", b), hidden)
            for p in order:

                def run(b: int) -> None:
                    _run_block(block, self.runs[b], store.get(("c", b)))

                self.fit(prefix + p, news[p], targets[p], run, full[p])
            after = PooledSqnr()
            for b in range(n + 1):
                hidden = _run_block(block, self.runs[b], store.get(("c", b)))
                if b < n:
                    after.add(store.get(("o", b)), hidden)
                store.put(("c", b), hidden)
            # over the calibration batches together, as validate computes it
            self.report.blocks.append(BlockFit(index, before.db, after.db))
            on_block(index, block)

    def head(self, post: list[str], pre_news: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """The swapped norms after the last block fitted on the shell's head, and the model's output
        compared before and after; returns the new norms."""
        shell, store, n = self.shell, self.store, self.n
        model = shell.model

        def output(b: int, stream: str) -> torch.Tensor:
            batch = self.inputs[b]
            return head_output(shell, batch.args, batch.kwargs, store.get((stream, b)))

        with recording(model, post, "input") as inputs:
            store.put(("logits", n), output(n, "o"))
        with recording(model, post, "output") as targets, call_order(model, post) as order:
            for b in range(n):
                with self.original(b):
                    logits = output(b, "o")
                store.put(("logits", b), logits)
        order += [p for p in post if p not in order]
        news = {p: self.build(p, model.get_submodule(p), inputs[p][0] if inputs[p] else None) for p in post}
        del inputs
        with _swapped(model, {**pre_news, **news}):
            # over the calibration batches together, as validate computes it
            before, after = PooledSqnr(), PooledSqnr()
            for b in range(n):
                before.add(store.get(("logits", b)), output(b, "u"))
            for p in order:
                self.fit(p, news[p], targets[p], lambda b: output(b, "c"), p)
            for b in range(n):
                after.add(store.get(("logits", b)), output(b, "c"))
            example = compare_tensors("output", store.get(("logits", n)), output(n, "c"))
        self.report.model_sqnr_before_db = before.db
        self.report.model_sqnr_after_db = after.db
        self.report.example = example
        return news


def calibrate_blocks(
    shell: BlockShell,
    count: int,
    inside: list[str],
    outside: list[str],
    build: Build,
    batches: list[ModelInputs],
    example: ModelInputs,
    store: ActivationStore,
    on_block: Callable[[int, nn.Module], None],
    say: Callable[[str], None] | None = None,
) -> tuple[SequentialCalibrationReport, dict[str, nn.Module]]:
    """Swap and fit the norms at ``inside`` (paths within every block) and ``outside`` (paths of the
    model outside its blocks) block by block (see the module doc).

    ``shell`` holds the original model with one block; ``count`` blocks are taken in turn. ``build``
    makes each new norm; ``batches`` are the calibration data, ``example`` the inputs the result is
    also compared on. ``on_block(i, block)`` gets each fitted block (in the shell: write it before
    returning; its original norms are put back afterwards). Returns the report and the fitted norms
    outside the blocks, by path."""
    say = say or (lambda _: None)
    report = SequentialCalibrationReport(
        batches=len(batches), blocks_path=f"{shell.blocks} ({count} blocks)", activation_budget=store.budget
    )
    work = _Calibration(shell, batches, example, store, build, report)
    say("calibrating: embeddings")
    post, pre_news = work.embeddings(outside)
    for index in range(count):
        say(f"calibrating: block {index + 1}/{count}")
        work.block(index, inside, on_block)
    say("calibrating: head")
    post_news = work.head(post, pre_news)
    report.activations_peak_held = store.peak_held_bytes
    report.activations_spilled = store.spilled_bytes
    return report, {**pre_news, **post_news}
