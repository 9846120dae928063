"""Convert a Hugging Face model directory without holding the model: analysis on the meta device, the
rewrite streamed shard by shard, one group of tensors at a time.

:func:`plan_checkpoint` reads the directory's config and shard headers, builds the model on the meta
device and lets the pass decide every site on its captured graph (:mod:`normswap.passes.core.edits`);
:func:`write_checkpoint` lays every output shard out from the input's (same files, same tensors, same
dtypes; an untied copy goes beside its source), then copies each untouched tensor as bytes and computes each edit group in
float64 from the input files, writing its tensors into their ranges. Peak memory is the largest group
(a norm and the linears that read it, or one residual writer), whatever the model's size.

The output is written into a hidden temporary sibling and renamed once complete; an existing path is
never written over. ``config.json`` carries the changes (``tie_word_embeddings: false`` when a writer
was untied), ``normswap.json`` the recipes of modules whose class changed, and the other files of the
input directory are copied (not other weight formats or folders).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.api.checkpoint_checks import check_rewritten_layers, verify_blocks
from normswap.api.config import ConvertConfig
from normswap.errors import BadInputError, CheckFailedError
from normswap.load.checkpoint_dir import (
    CheckpointDirectory,
    build_on_meta,
    parameter_names,
    read_checkpoint_directory,
    stored_tensor_reader,
)
from normswap.load.checkpoint_write import copy_side_files, finish_from_source, stored_headers
from normswap.load.config_inputs import example_inputs, made_inputs_notes
from normswap.load.paths import check_output
from normswap.load.safetensors_io import ShardWriter, TensorEntry, read_model_tensor, shard_writers
from normswap.load.save import directory_output
from normswap.passes.batchnorm.stream import refuse_broken_batchnorms
from normswap.passes.core.base import PassReport
from normswap.passes.core.edits import EditPlan, TensorEdit
from normswap.passes.streaming import plan_edits
from normswap.passes.weightnorm.layers import RemoveWeightNorm
from normswap.passes.weightnorm.stream import WeightNormValueError
from normswap.rewrites import BY_OPTION, streamed_options
from normswap.verify.blockwise import BlockwiseReport
from normswap.verify.metrics import TensorComparison


@dataclass
class StreamedConversion:
    """What :func:`write_checkpoint` did: the pass's report, the output's shards, how many tensors were
    copied as bytes and how many computed, the largest group's bytes, and the files copied."""

    path: Path
    report: PassReport
    shards: list[str]
    copied_tensors: int
    edited_tensors: int
    largest_group_bytes: int
    recorded_modules: dict[str, Any] = field(default_factory=dict)
    config_changes: dict[str, Any] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)
    not_copied: list[str] = field(default_factory=list)
    verification: list[BlockwiseReport] = field(default_factory=list)
    # --fold-bn: each folded layer against the BatchNorm and layer it replaces, on random inputs
    fold_checks: list[TensorComparison] = field(default_factory=list)
    # why the weights are under normswap's names, which stock loaders do not read (None: stock names)
    stock_refused: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "report": self.report.to_dict(),
            "shards": self.shards,
            "copied_tensors": self.copied_tensors,
            "edited_tensors": self.edited_tensors,
            "largest_group_bytes": self.largest_group_bytes,
            "recorded_modules": sorted(self.recorded_modules),
            "config_changes": self.config_changes,
            "copied_files": self.copied_files,
            "not_copied": self.not_copied,
            "verification": [report.to_dict() for report in self.verification],
            "fold_checks": [asdict(check) for check in self.fold_checks],
            "stock_refused": self.stock_refused,
        }


def _layout(
    checkpoint: CheckpointDirectory,
    headers: dict[str, tuple[dict[str, TensorEntry], dict[str, str]]],
    plan: EditPlan,
) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
    """Output shard -> (name, dtype, shape) in file order: the input's tensors where they were (those the
    index lists), and each new tensor after the tensor it copies."""
    new_after: dict[str, list[tuple[str, tuple[int, ...] | None]]] = {}
    for edit in plan.edits:
        for name, source in edit.new.items():
            new_after.setdefault(source, []).append((name, None))
        for name, (anchor, shape) in edit.creates.items():
            new_after.setdefault(anchor, []).append((name, shape))
    dropped = plan.drops
    layout: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for shard in checkpoint.shards:
        entries = headers[shard][0]
        rows = []
        for name, entry in sorted(entries.items(), key=lambda kv: kv[1].start):
            if checkpoint.weight_map.get(name) != shard:
                continue  # a tensor the index does not list is not part of the model
            if name not in dropped:
                rows.append((name, entry.dtype, entry.shape))
            # new tensors go where the tensor they follow was, also when it leaves the output
            rows += [
                (new, entry.dtype, entry.shape if shape is None else shape)
                for new, shape in new_after.get(name, [])
            ]
        layout[shard] = rows
    return layout


def copy_all(jobs: list[tuple[ShardWriter, str, Path, TensorEntry]], stop: threading.Event) -> int:
    """Byte copies of tensors that no edit computes (kernel copies: no trip through this process)."""
    for done, (writer, name, source, entry) in enumerate(jobs):
        if stop.is_set():
            return done
        writer.copy_bytes(name, source, entry)
    return len(jobs)


def _stream(
    checkpoint: CheckpointDirectory,
    headers: dict[str, tuple[dict[str, TensorEntry], dict[str, str]]],
    plan: EditPlan,
    temp: Path,
    parameters: frozenset[str],
) -> tuple[list[str], int, int, int]:
    """Write every output shard. Three things run at once (file I/O and torch's kernels release the GIL):
    untouched tensors are copied as bytes in one thread; edit groups are read ahead, computed here and
    written by pool threads, in order; the groups in flight (read, computed or being written) hold at
    most twice the largest group's bytes, so memory stays bounded by the largest group whatever the
    model's size, and a group's reading overlaps the previous one's computing and writing. Every tensor
    read or copied is held to the NaN/Inf rule of :mod:`normswap.util.finite` (``parameters``: the stored
    names that are parameters)."""
    layout = _layout(checkpoint, headers, plan)
    where = {name: shard for shard, rows in layout.items() for name, _, _ in rows}
    metadata = {shard: headers[shard][1] for shard in layout}
    with shard_writers(temp, layout, metadata, parameters) as writers:
        edited, byte_copies = plan.writes, plan.copies
        jobs = [
            (writers[shard], name, checkpoint.path / shard, headers[shard][0][name])
            for shard, rows in layout.items()
            for name, _, _ in rows
            if name not in edited and name in headers[shard][0]
        ]
        untouched = len(jobs)
        for name, source in byte_copies.items():  # an untied tensor: its source's input bytes
            shard = checkpoint.weight_map[source]
            jobs.append((writers[where[name]], name, checkpoint.path / shard, headers[shard][0][source]))

        def entry(name: str) -> TensorEntry:
            return headers[checkpoint.weight_map[name]][0][name]

        def read_group(edit: TensorEdit) -> dict[str, torch.Tensor]:
            return {
                n: read_model_tensor(
                    checkpoint.path / checkpoint.weight_map[n], n, entry(n), buffer=n not in parameters
                )
                for n in edit.reads
            }

        def write_group(outputs: dict[str, torch.Tensor]) -> None:
            for name, value in outputs.items():
                writers[where[name]].write(name, value)

        edits = plan.edits
        sizes = [sum(entry(n).nbytes for n in edit.reads) for edit in edits]
        budget = 2 * max(sizes, default=0)
        stop = threading.Event()
        largest = 0
        with ThreadPoolExecutor(max_workers=3, thread_name_prefix="normswap-io") as pool:
            copying = pool.submit(copy_all, jobs, stop)
            writing: deque[tuple[Future[None], int]] = deque()
            in_flight = 0  # bytes of the groups read and not yet written

            def room_for(size: int, wait: bool) -> bool:
                nonlocal in_flight
                while in_flight + size > budget and writing and (wait or writing[0][0].done()):
                    done, freed = writing.popleft()
                    done.result()
                    in_flight -= freed
                return in_flight + size <= budget

            try:
                ahead: Future[dict[str, torch.Tensor]] | None = None
                if edits:
                    in_flight += sizes[0]
                    ahead = pool.submit(read_group, edits[0])
                for i, edit in enumerate(edits):
                    assert ahead is not None
                    inputs = ahead.result()
                    following = i + 1 < len(edits)
                    ahead = None
                    if following and room_for(sizes[i + 1], wait=False):
                        in_flight += sizes[i + 1]
                        ahead = pool.submit(read_group, edits[i + 1])
                    with torch.no_grad():
                        outputs = edit.compute(inputs)
                    if set(outputs) != set(edit.writes):
                        raise RuntimeError(
                            f"{edit.label}: wrote {sorted(outputs)}, planned {sorted(edit.writes)}"
                        )
                    # the group's memory: what it read, and what it wrote into new memory
                    held = {t.untyped_storage().data_ptr(): t for t in (*inputs.values(), *outputs.values())}
                    largest = max(largest, sum(t.untyped_storage().nbytes() for t in held.values()))
                    writing.append((pool.submit(write_group, outputs), sizes[i]))
                    del inputs, outputs, held
                    if following and ahead is None:
                        room_for(sizes[i + 1], wait=True)
                        in_flight += sizes[i + 1]
                        ahead = pool.submit(read_group, edits[i + 1])
                while writing:
                    writing.popleft()[0].result()
                copying.result()
            except BaseException:
                stop.set()  # the copies stop at their next tensor; the pool waits for what runs
                raise
    return sorted(layout), untouched, len(edited) + len(byte_copies), largest


@dataclass
class PlannedStream:
    """A model directory's rewrite decided on the meta device, before anything is written: the pass's
    report says every change and skip, as the in-memory route's does."""

    checkpoint: CheckpointDirectory
    headers: dict[str, tuple[dict[str, TensorEntry], dict[str, str]]]
    model: nn.Module
    plan: EditPlan
    # what the example inputs made from the config turned off (made_inputs_notes), as in memory
    notes: list[str] = field(default_factory=list)

    @property
    def report(self) -> PassReport:
        assert self.plan.report is not None
        return self.plan.report


def plan_checkpoint(
    source: str | Path | CheckpointDirectory,
    config: ConvertConfig,
    on_step: Callable[[str], None] | None = None,
) -> PlannedStream:
    """Decide ``config``'s one exact rewrite of the model directory ``source`` (a path, or the directory
    as read already) as per-tensor edits, on a model built on the meta device (no weight read but the
    BatchNorm statistics a fold checks)."""
    say = on_step or (lambda _: None)
    why = stream_problem(config)
    if why is not None:
        raise BadInputError(f"cannot stream this conversion: {why}")
    checkpoint = source if isinstance(source, CheckpointDirectory) else read_checkpoint_directory(source)
    headers = stored_headers(checkpoint)
    say("analyzing the model built on the meta device (no weights read)")
    model = build_on_meta(checkpoint)
    weight_norm = (
        RemoveWeightNorm()
        if config.remove_weight_norm
        else config.weight_norm_pass()
        if config.add_weight_norm is not None
        else None
    )
    # a weight-norm pass reads parameters only: no graph, so no inputs (an audio model's are not made)
    args, kwargs = ((), {}) if weight_norm is not None else example_inputs(model, checkpoint.config)
    read = stored_tensor_reader(checkpoint, parameter_names(model, checkpoint))
    refuse_broken_batchnorms(model, set(checkpoint.weight_map), read)
    plan = plan_edits(
        model,
        args,
        kwargs,
        set(checkpoint.weight_map),
        config.rewrites()[0],
        read=read,
        weight_norm=weight_norm,
    )
    return PlannedStream(checkpoint, headers, model, plan, made_inputs_notes(kwargs))


def write_checkpoint(
    planned: PlannedStream, config: ConvertConfig, on_step: Callable[[str], None] | None = None
) -> StreamedConversion:
    """Stream ``planned`` into ``config.output`` and verify it against the source before it takes its
    name: block by block, or each rewritten layer against what it replaces (a BatchNorm fold, weight
    norm: the convolutional and speech models that hold them have no list of blocks of one class).
    CheckFailedError when the verification fails; nothing is written then, nor on any failure. Memory:
    the largest edit group plus the meta model; the verification holds one block's worth."""
    say = on_step or (lambda _: None)
    checkpoint, headers, plan = planned.checkpoint, planned.headers, planned.plan
    output = config.output_path
    assert output is not None
    # the output rule (normswap.load.paths): an existing output only with overwrite, never a symlink
    check_output("-o", output, overwrite=config.overwrite, directory=True)
    try:
        with directory_output(output, overwrite=config.overwrite) as temp:
            say(f"streaming {len(plan.edits)} edit groups into {len(checkpoint.shards)} shards")
            parameters = parameter_names(planned.model, checkpoint)
            shards, copied, edited, largest = _stream(checkpoint, headers, plan, temp, parameters)
            stock_refused = finish_from_source(
                checkpoint, temp, shards, config_changes=plan.config_changes, recorded=plan.recorded
            )
            written = read_checkpoint_directory(temp)
            shards = list(written.shards)
            verification: list[BlockwiseReport] = []
            fold_checks: list[TensorComparison] = []
            if not plan.edits:
                say(
                    "nothing to rewrite: every tensor copied as bytes"
                )  # the input's bytes: nothing to verify
            elif plan.checks:
                say(f"verifying {len(plan.checks)} rewritten layers against the originals")
                fold_checks = check_rewritten_layers(checkpoint, written, plan)
            else:
                say("verifying block by block against the original")
                assert plan.report is not None
                changed = [change.site for change in plan.report.changes]
                verification = verify_blocks(checkpoint, written, planned.model, config.to, say, changed)
            copied_files, not_copied = copy_side_files(checkpoint, temp)
    except WeightNormValueError as exc:  # a layer's values, found when its group was read
        raise CheckFailedError(f"--add-weight-norm: {exc}; nothing written") from None
    return StreamedConversion(
        path=output,
        report=planned.report,
        shards=shards,
        copied_tensors=copied,
        edited_tensors=edited,
        largest_group_bytes=largest,
        recorded_modules={**checkpoint.replaced_modules, **plan.recorded},
        config_changes=plan.config_changes,
        copied_files=copied_files,
        not_copied=not_copied,
        verification=verification,
        fold_checks=fold_checks,
        stock_refused=stock_refused,
    )


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def format_gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def stream_problem(config: ConvertConfig, custom_inputs: bool = False) -> str | None:
    """Why ``config`` cannot be streamed (None when it can): a stream runs exactly one rewrite that
    streams (:func:`normswap.rewrites.streamed_options`), ``--to rmsnorm`` only under ``--exact`` (its
    lossy fallback does not stream), and none of the options no stream takes."""
    other = config.given("--calibrate", "--from", "--allow-lossy", "--dtype") + (
        ["--inputs/--input-shape"] if custom_inputs else []
    )
    asked = config.rewrites()
    other += [option for option in asked if not BY_OPTION[option].streams]
    if other:
        return f"{', '.join(other)} does not stream yet"
    if len(asked) != 1:
        return f"a stream runs one rewrite: {streamed_options()}"
    if asked == ["--to rmsnorm"] and not config.exact:
        return "--to rmsnorm without --exact may fall back to a lossy swap, which does not stream"
    return None


def directory_route(
    source: str | Path, config: ConvertConfig, custom_inputs: bool = False
) -> tuple[str | None, CheckpointDirectory]:
    """How a model directory converted into a model directory runs, and the directory as read (once, for
    the route that follows): None when it streams (:func:`plan_checkpoint`), else the message saying
    why it runs in memory; BadInputError when it cannot stream and the model would not fit in memory
    (weights about three times: the model, the converted copy, temporaries)."""
    checkpoint = read_checkpoint_directory(source)
    why = stream_problem(config, custom_inputs)
    if why is None and not checkpoint.stored_as_loaded:
        # a stream edits stored tensors by the model's names
        why = "its files store tensors under other names than the model's (transformers renames them on load)"
    if why is None:
        return None, checkpoint
    return in_memory_instead(source, checkpoint, why), checkpoint


def in_memory_shortfall(checkpoint: CheckpointDirectory) -> str | None:
    """The one rule of whether a model directory converts in memory: None when it fits (or the available
    memory is unknown), else what it needs against what there is (weights about three times: the model,
    the converted copy, temporaries). Read by the in-memory route, which refuses, and by the block-by-block
    route, which takes over."""
    need, available = 3 * checkpoint.total_bytes, available_memory()
    if available is None or need <= available:
        return None
    return f"converting in memory needs about {format_gb(need)} ({format_gb(available)} available)"


def in_memory_instead(source: str | Path, checkpoint: CheckpointDirectory, why: str) -> str:
    """The note of a directory converted in memory because it cannot stream (``why``); BadInputError when
    the model would not fit in memory (:func:`in_memory_shortfall`)."""
    shortfall = in_memory_shortfall(checkpoint)
    if shortfall is not None:
        raise BadInputError(f"{source}: {why}, and {shortfall}; streamed rewrites: {streamed_options()}")
    return f"{why}: converting in memory ({format_gb(checkpoint.total_bytes)} of weights)"


def unverifiable(planned: PlannedStream) -> str | None:
    """Why a planned stream would not do what the in-memory route does (None when it would): the model
    could not be captured on the meta device, so no site could be judged (wav2vec2's forward makes a CPU
    tensor beside the meta weights), or edits checked block by block (no layer-local checks) on a model
    whose blocks the verification cannot run (:func:`normswap.verify.blockwise.blockwise_problem`)."""
    from normswap.verify.blockwise import blockwise_problem

    report = planned.report
    if report.graph_error and report.graph_method is None:
        return f"the model cannot be captured on the meta device ({report.graph_error})"
    if not planned.plan.edits or planned.plan.checks:
        return None
    return blockwise_problem(planned.model)
