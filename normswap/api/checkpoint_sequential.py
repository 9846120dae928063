"""``normswap convert DIR --to KIND --calibrate DATA -o OUTDIR`` for a model that does not fit in memory:
the norms swapped and calibrated block by block, each block written as it is done.

The swap is decided once, on a shell of the model with one block (its config with one layer; block 0's
weights), by the swap pass's own checks, and holds for every block: they are one class built from one
config. Each block is then swapped and fitted by :func:`normswap.calibrate.sequential.calibrate_blocks`
and its new norms written into the output shards, whose layout is fixed in advance from the input's
headers (the same files and order; each swapped norm's tensors where the old norm's were). Every other
tensor is copied as bytes by the kernel. Memory: one model's embeddings and head, one block, and the
activations up to their budget (past it they go to disk, in a hidden folder beside the output).

The output is a recorded directory (the new norm classes in ``normswap.json``), written into a hidden
temporary sibling and renamed once complete; an existing path is never written over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normswap.api.checkpoint import available_memory, copy_all, in_memory_shortfall
from normswap.api.config import ConvertConfig
from normswap.errors import BadInputError, CheckFailedError
from normswap.load.checkpoint_dir import (
    CheckpointDirectory,
    build_on_meta,
    parameter_names,
    read_checkpoint_directory,
    transformers_config,
)
from normswap.load.checkpoint_write import copy_side_files, finish_from_source, stored_headers, unrecordable
from normswap.load.config_inputs import example_inputs, made_inputs_notes
from normswap.load.paths import check_output
from normswap.load.safetensors_io import NAMES, shard_writers
from normswap.load.save import directory_output
from normswap.passes.core.base import Change, PassReport, Skip, build_context

if TYPE_CHECKING:
    from normswap.calibrate.sequential import SequentialCalibrationReport

# The activations' memory when none is given: this share of the available memory, at most the cap.
_ACTIVATION_SHARE, _ACTIVATION_CAP = 0.25, 4 * 1024**3


@dataclass
class SequentialConversion:
    """What :func:`convert_checkpoint_sequential` did: the swap's report (every block's sites), the
    calibration's (per block and per site, before and after; None when no norm could be swapped, the
    model then written as it was), and how the output was written."""

    path: Path
    report: PassReport
    calibration: SequentialCalibrationReport | None
    shards: list[str]
    copied_tensors: int
    written_tensors: int
    recorded_modules: dict[str, Any] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)
    not_copied: list[str] = field(default_factory=list)
    # why the weights are under normswap's names, which stock loaders do not read (None: stock names)
    stock_refused: str | None = None
    # what the example inputs made from the config turned off (made_inputs_notes), as in memory
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "route": "sequential",
            "stock_refused": self.stock_refused,
            "report": self.report.to_dict(),
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "shards": self.shards,
            "copied_tensors": self.copied_tensors,
            "written_tensors": self.written_tensors,
            "recorded_modules": sorted(self.recorded_modules),
            "copied_files": self.copied_files,
            "not_copied": self.not_copied,
            "config_changes": {},  # a swap block by block changes no config key
        }


def sequential_problem(config: ConvertConfig, custom_inputs: bool = False) -> str | None:
    """Why the block-by-block route cannot run this conversion, or None when it can."""
    if config.calibration_data is None:
        return "the sequential route calibrates swapped norms block by block: give --calibrate DATA"
    from normswap.modules.semantics import SWAP_TARGETS

    if config.to not in SWAP_TARGETS or config.to == "rmsnorm":
        what = "no --to" if config.to is None else f"--to {config.to}"
        return (
            f"{what}: the sequential route swaps norms for an architectural kind (layernorm, batchnorm, "
            "groupnorm, instancenorm, dyt, derf, identity); --to rmsnorm and crmsnorm recenter the residual "
            "stream, which rewrites the linears around the norms, and cosine rewrites the layers before "
            "them: neither is built block by block"
        )
    swap = f"--to {config.to}"
    other = [r for r in config.rewrites() if r != swap] + config.given("--exact", "--allow-lossy")
    other += ["--inputs/--input-shape"] if custom_inputs else []
    if other:
        return f"{', '.join(other)} is not part of the sequential route (the swap and its calibration only)"
    if config.dtype is not None:
        # every tensor the swap leaves is copied as its stored bytes, so the output keeps the input's
        # dtypes: refused, where it used to be dropped silently (the in-memory route casts and checks)
        return (
            f"--dtype {config.dtype}: the block-by-block route copies every tensor the swap leaves as its "
            "stored bytes, so it writes the model's own dtype; convert without --dtype, or in memory "
            "(without --sequential) where --dtype casts the result and checks the cast copy"
        )
    return None


def sequential_route(
    source: str | Path, config: ConvertConfig, *, asked: bool, custom_inputs: bool = False
) -> str | None:
    """How ``convert DIR --calibrate DATA -o OUTDIR`` runs: the note saying why it runs block by block,
    or None (in memory, or as :func:`normswap.api.checkpoint.directory_route` says). ``asked``: the user
    asked for it (``--sequential``); then a conversion it cannot run is a BadInputError, as is one
    that does not fit in memory and that only its ``dtype`` keeps from running block by block."""
    problem = sequential_problem(config, custom_inputs)
    if asked:
        if problem is not None:
            raise BadInputError(f"--sequential: {problem}")
        return "--sequential: calibrating block by block"
    shortfall = in_memory_shortfall(read_checkpoint_directory(source))
    if shortfall is None:
        return None
    if (
        problem is not None
        and config.dtype is not None
        and sequential_problem(replace(config, dtype=None), custom_inputs) is None
    ):
        # only --dtype keeps the block-by-block route from taking over: say so (the in-memory rule's
        # refusal would name the stream, which was never the route for a calibration)
        raise BadInputError(f"{source}: {shortfall}, and {problem}")
    return None if problem is not None else f"{shortfall}: calibrating block by block (--sequential)"


def _blocks(checkpoint: CheckpointDirectory, meta: nn.Module) -> tuple[str, int]:
    from normswap.verify.blockwise import find_blocks

    try:
        blocks, count = find_blocks(meta)
    except BadInputError:
        raise BadInputError(
            f"{checkpoint.path}: the model has no list of blocks of one class (a ModuleList) to calibrate "
            "block by block; convert it in memory (without --sequential)"
        ) from None
    layers = getattr(transformers_config(checkpoint), "num_hidden_layers", None)
    if layers != count:
        raise BadInputError(
            f"{checkpoint.path}: its blocks ({count} in {blocks}) are not the config's num_hidden_layers "
            f"({layers}), so no model with one of them can be built to run them in turn; convert it in memory "
            "(without --sequential)"
        )
    return blocks, count


@dataclass
class _Plan:
    """The swap decided on the shell: site path in the shell -> its NormSite, the new module's tensors
    (name, dtype name, shape) and recipe; and the skips with their reasons."""

    sites: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, list[tuple[str, str, tuple[int, ...]]]] = field(default_factory=dict)
    recipes: dict[str, Any] = field(default_factory=dict)
    skips: list[Skip] = field(default_factory=list)  # in the shell: a block's are block 0's


def _plan_swap(shell_model: nn.Module, config: ConvertConfig, args: tuple, kwargs: dict) -> tuple[Any, _Plan]:
    from normswap.modules.recipes import module_recipe
    from normswap.passes.swap.swap_norm import SwapNorm, build_layout_norm

    swap = next(p for p in config.passes() if isinstance(p, SwapNorm))
    ctx = build_context(shell_model, args, kwargs, fx_first=swap.fx_analysis)
    state = swap.prepare(ctx)
    plan = _Plan()
    for site, decided in swap.decide(ctx, state):
        if isinstance(decided, Skip):
            plan.skips.append(decided)
            continue
        assert site.module is not None  # the swap decides module sites only (as SwapNorm.apply asserts)
        prototype = build_layout_norm(swap.target_kind, site, site.module, decided.sample, swap.groups)
        recipe = module_recipe(prototype)
        if recipe is None:  # the in-memory route's sentence, found on the model with one block
            raise BadInputError(unrecordable(site.path, prototype))
        plan.sites[site.path] = site
        plan.recipes[site.path] = recipe
        plan.tensors[site.path] = [
            (name, NAMES[t.dtype], tuple(t.shape)) for name, t in prototype.state_dict().items()
        ]
    return swap, plan


def _layout(
    checkpoint: CheckpointDirectory,
    headers: dict[str, Any],
    new: dict[str, list[tuple[str, str, tuple[int, ...]]]],
    loaded: dict[str, str],
) -> tuple[dict[str, list[tuple[str, str, tuple[int, ...]]]], dict[str, str]]:
    """Output shard -> rows in file order: the input's tensors, a swapped norm's new tensors (``new``:
    module path -> rows) where its first old one was (at the end of the last shard when it had none); and
    each new tensor's model name -> the name it is stored under. ``loaded``: each stored name -> the
    model's (transformers' renamings): a new tensor is stored beside its old ones, under their module's
    stored name (ViT's ``vit.encoder.layer.0.layernorm_before``, the model's ``vit.layers.0...``)."""
    placed: set[str] = set()
    layout: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    as_stored: dict[str, str] = {}

    def rows_of(owner: str, stored_owner: str) -> list[tuple[str, str, tuple[int, ...]]]:
        as_stored.update({f"{owner}.{n}": f"{stored_owner}.{n}" for n, _, _ in new[owner]})
        return [(f"{stored_owner}.{n}", dtype, shape) for n, dtype, shape in new[owner]]

    for shard in checkpoint.shards:
        rows: list[tuple[str, str, tuple[int, ...]]] = []
        for name, entry in sorted(headers[shard][0].items(), key=lambda kv: kv[1].start):
            if checkpoint.weight_map.get(name) != shard:
                continue
            owner = loaded.get(name, name).rpartition(".")[0]
            if owner not in new:
                rows.append((name, entry.dtype, entry.shape))
            elif owner not in placed:
                placed.add(owner)
                rows += rows_of(owner, name.rpartition(".")[0])
        layout[shard] = rows
    last = checkpoint.shards[-1]
    for owner in new:
        if owner not in placed:
            layout[last] += rows_of(owner, owner)
    return layout, as_stored


def _check_written(written: CheckpointDirectory) -> None:
    """The written directory's model (built on meta, recorded modules in place) has every tensor the
    files hold, and the files every tensor it has (tied ones under one name), the files' names read as
    transformers' loader reads them (:func:`~normswap.verify.block_shell.shell_names`)."""
    from normswap.verify.block_shell import shell_names

    model = build_on_meta(written)
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    stored = set(shell_names(model, written))
    missing = [names[0] for names in groups.values() if not stored.intersection(names)]
    extra = stored - {n for names in groups.values() for n in names}
    if missing or extra:
        raise CheckFailedError(
            f"the written directory does not match its model ({len(missing)} tensors missing, e.g. "
            f"{missing[:1]}; {len(extra)} unexpected, e.g. {sorted(extra)[:1]}); nothing written"
        )


def convert_checkpoint_sequential(
    source: str | Path,
    config: ConvertConfig,
    *,
    activation_memory: int | None = None,
    on_step: Callable[[str], None] | None = None,
) -> SequentialConversion:
    """Swap the norms of the model directory ``source`` as ``config`` asks (``to``, ``from_kinds``,
    ``groups``), calibrate them on ``config.calibration_data`` block by block, and write the result into
    the new directory ``config.output`` (see the module doc). ``activation_memory``: bytes of activations
    held in memory before they go to disk (default: a quarter of the available memory, at most 4 GiB).

    The fitted parameters are those of the in-memory ``convert`` with the same calibration data (the same
    fit, fed the same tensors: the batches as :func:`normswap.calibrate.feeding.fed` makes them).
    BadInputError for a conversion or model the route cannot take (a model with no list of blocks of one
    class, flags other than the swap) or data it cannot be fed (in the in-memory route's words); nothing
    is written then, nor on any failure. A model with no norm to swap is written as it was (every tensor
    copied as bytes, nothing calibrated), as the in-memory route writes it."""
    from normswap.api.convert import calibration_batches
    from normswap.calibrate.activations import ActivationStore
    from normswap.calibrate.data import ModelInputs, as_model_inputs
    from normswap.calibrate.feeding import check_batch_fits
    from normswap.calibrate.sequential import calibrate_blocks
    from normswap.passes.swap.swap_norm import build_layout_norm
    from normswap.verify.block_shell import BlockShell, shell_names
    from normswap.verify.metrics import sqnr_db

    say = on_step or (lambda _: None)
    config.validate()
    problem = sequential_problem(config)
    if problem is not None:
        raise BadInputError(problem)
    output = config.output_path
    if output is None or output.suffix:
        raise BadInputError(
            "the sequential route writes a model directory: give an output path with no suffix"
        )
    checkpoint = read_checkpoint_directory(source)
    # the output rule (normswap.load.paths): an existing output only with overwrite, never a symlink
    check_output("-o", output, overwrite=config.overwrite, directory=True)
    meta = build_on_meta(checkpoint)
    blocks, count = _blocks(checkpoint, meta)
    # the stored names as the model reads them (transformers renames ViT's as it loads them); a model
    # whose loader merges tensors is refused here, before any work
    loaded = {stored: name for name, stored in shell_names(meta, checkpoint).items()}
    args, kwargs = example_inputs(meta, checkpoint.config, device="cpu")
    # the meta model's embedding size is all the token-id check reads
    batches = [as_model_inputs(b) for b in calibration_batches(config, meta, args, kwargs)]
    parameters = parameter_names(meta, checkpoint)
    del meta
    say("building a model with one block (embeddings and head real)")
    shell = BlockShell(checkpoint, blocks)
    if hasattr(shell.model.config, "use_cache"):
        shell.model.config.use_cache = False  # no key/value cache: nothing carried from one block to the next
    shell.take_block(0)
    # data the model cannot be fed is refused before any work, in the in-memory route's sentence (feeding)
    check_batch_fits(shell.model, batches[0], "calibration batch 0")
    say("deciding the swap on the model with one block")
    swap, plan = _plan_swap(shell.model, config, args, kwargs)
    shell_block = f"{blocks}.0."
    inside = [p[len(shell_block) :] for p in plan.sites if p.startswith(shell_block)]
    outside = [p for p in plan.sites if not p.startswith(shell_block)]

    def full_paths(path: str) -> list[str]:
        local = path[len(shell_block) :] if path.startswith(shell_block) else None
        return [path] if local is None else [f"{blocks}.{i}.{local}" for i in range(count)]

    new_tensors = {full: plan.tensors[p] for p in plan.sites for full in full_paths(p)}
    recorded = {**checkpoint.replaced_modules}
    recorded.update({full: plan.recipes[p] for p in plan.sites for full in full_paths(p)})
    report = swap.new_report()
    report.skips = [replace(skip, site=full) for skip in plan.skips for full in full_paths(skip.site)]

    def build(path: str, old: nn.Module, sample: torch.Tensor | None) -> nn.Module:
        # a block's norm: the shell's site of the same local path (model.layers.7.x -> model.layers.0.x)
        in_shell = path if path in plan.sites else shell_block + path[len(blocks) + 1 :].split(".", 1)[1]
        site = plan.sites[in_shell]
        new = build_layout_norm(swap.target_kind, site, old, sample, swap.groups)
        details: dict[str, Any] = {"from_class": type(old).__name__, "to_class": type(new).__name__}
        if sample is not None:
            with torch.no_grad():
                details["site_sqnr_db"] = sqnr_db(old(sample), new(sample))
        report.changes.append(
            Change(swap.name, path, swap.kind, f"{type(old).__name__} -> {type(new).__name__}", details)
        )
        return new

    headers = stored_headers(checkpoint)
    layout, as_stored = _layout(checkpoint, headers, new_tensors, loaded)
    where = {name: shard for shard, rows in layout.items() for name, _, _ in rows}
    written_names = set(as_stored.values())
    budget = activation_memory
    if budget is None:
        available = available_memory() or 4 * _ACTIVATION_CAP
        budget = min(_ACTIVATION_CAP, int(_ACTIVATION_SHARE * available))
    store = ActivationStore(budget, destination=output)
    try:
        with directory_output(output, overwrite=config.overwrite) as temp:
            metadata = {shard: headers[shard][1] for shard in layout}
            with shard_writers(temp, layout, metadata, parameters) as writers:
                jobs = [
                    (writers[shard], name, checkpoint.path / shard, headers[shard][0][name])
                    for shard, rows in layout.items()
                    for name, _, _ in rows
                    if name not in written_names
                ]

                def write(prefix: str, module: nn.Module) -> None:
                    for name, tensor in module.state_dict().items():
                        stored = as_stored[f"{prefix}.{name}"]
                        writers[where[stored]].write(stored, tensor)

                def write_block(index: int, block: nn.Module) -> None:
                    for local in inside:
                        write(f"{blocks}.{index}.{local}", block.get_submodule(local))

                stop = threading.Event()
                calibration = None
                with ThreadPoolExecutor(max_workers=1, thread_name_prefix="normswap-copy") as pool:
                    copying = pool.submit(copy_all, jobs, stop)
                    try:
                        if plan.sites:  # otherwise the model is written as it was: nothing to calibrate
                            calibration, outside_news = calibrate_blocks(
                                shell, count, inside, outside, build, batches, ModelInputs(args, kwargs),
                                store, write_block, say,
                            )  # fmt: skip
                            for path, module in outside_news.items():
                                write(path, module)
                        say("waiting for the byte copies of the untouched tensors")
                        copying.result()
                    except BaseException:
                        stop.set()
                        raise
            shards = sorted(layout)
            stock_refused = finish_from_source(checkpoint, temp, shards, config_changes={}, recorded=recorded)
            say("checking the written directory")
            written = read_checkpoint_directory(temp)
            _check_written(written)
            shards = list(written.shards)
            copied_files, not_copied = copy_side_files(checkpoint, temp)
    finally:
        store.close()
    return SequentialConversion(
        path=output,
        report=report,
        calibration=calibration,
        shards=shards,
        copied_tensors=len(jobs),
        written_tensors=len(written_names),
        recorded_modules=recorded,
        copied_files=copied_files,
        not_copied=not_copied,
        stock_refused=stock_refused,
        notes=made_inputs_notes(kwargs),
    )
