"""Models from torch.export archives (.pt2): read safely (:mod:`.archive` checks the archive before
torch loads it), rebuilt into a module whose norms are lifted back to ``torch.nn`` modules, with the
example inputs the archive stored, or synthesized from its recorded shapes when it stored none."""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from normswap.errors import BadInputError, describe
from normswap.load.program_weights import NotReadable, ProgramWeights


def _concrete_size(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        # Without a recorded example size, 2 avoids the 0/1 values that export specializes on.
        return int(hint) if hint is not None else 2
    return int(size)


def _synthesize_example_inputs(ep: torch.export.ExportedProgram) -> tuple[tuple, dict] | None:
    """Build inputs matching the traced shapes/dtypes when the archive stored no example inputs."""
    from torch.utils import _pytree as pytree

    user_inputs = set(ep.graph_signature.user_inputs)
    generator = torch.Generator().manual_seed(0)
    leaves = []
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = [_concrete_size(s) for s in val.shape]
            if val.dtype.is_floating_point or val.dtype.is_complex:
                leaves.append(torch.randn(shape, generator=generator).to(val.dtype))
            else:
                leaves.append(torch.zeros(shape, dtype=val.dtype))
        elif isinstance(val, torch.SymInt):
            leaves.append(_concrete_size(val))
        else:
            leaves.append(val)
    try:
        args, kwargs = pytree.tree_unflatten(leaves, ep.call_spec.in_spec)
    except Exception:
        return None
    return tuple(args), dict(kwargs)


def _lift(gm: nn.Module) -> nn.Module:
    """Turn the exported graph module's aten norm calls back into nn modules, which is what the passes
    rewrite (:func:`normswap.graph.lift.lift_exported_module`)."""
    from normswap.graph.lift import lift_exported_module

    return lift_exported_module(gm)


# Packages whose output classes a .pt2 may name in its pytree specs; importing one of them registers
# those classes for deserialization (Hugging Face's ModelOutput subclasses register themselves).
# Only these are imported on the archive's word: an archive must not choose what code runs.
_OUTPUT_TYPE_PACKAGES = ("transformers.", "diffusers.", "timm.")
_UNREGISTERED_TYPE = re.compile(r"Deserializing ([\w.]+) in pytree is not registered")


# torch.export.load logs under both: torch.export (the loader) and torch._export (the deserializer, which
# reports its fallback to the full unpickler there).
_EXPORT_LOGGERS = ("torch.export", "torch._export")


def _log_text(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except (TypeError, ValueError):  # torch's own format strings sometimes lack an argument
        return f"{record.msg} {record.args}"


class _Collect(logging.Handler):
    """Keeps torch.export's log records of one load attempt, to read what failed and pass the rest on."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        parts = []
        for record in self.records:
            parts.append(_log_text(record))
            if record.exc_info and record.exc_info[1] is not None:
                parts.append("".join(traceback.format_exception(record.exc_info[1])))
        return " ".join(parts)


@contextlib.contextmanager
def _listening() -> Iterator[_Collect]:
    """torch.export's log records go to a collector instead of torch's handlers, for one load attempt."""
    collect = _Collect()
    saved = []
    # torch's logging setup attaches handlers to each of its module loggers, not only to the parents
    names = [
        name
        for name in list(logging.root.manager.loggerDict)
        if any(name == top or name.startswith(top + ".") for top in _EXPORT_LOGGERS)
    ]
    for name in sorted({*_EXPORT_LOGGERS, *names}):
        log = logging.getLogger(name)
        saved.append((log, log.handlers[:], log.propagate))
        log.handlers, log.propagate = [collect], False
    try:
        yield collect
    finally:
        for log, handlers, propagate in saved:
            log.handlers, log.propagate = handlers, propagate


def _registering_module(failure: str) -> str | None:
    """The module to import so that a failed ``torch.export.load`` can succeed, if it is one we trust:
    normswap's own ops (a fused model's graph calls them), or the output classes' module of a library in
    :data:`_OUTPUT_TYPE_PACKAGES`."""
    if "torch.ops.normswap." in failure:
        return "normswap.kernels.ops"
    found = _UNREGISTERED_TYPE.search(failure)
    name = found.group(1) if found else ""
    return name.rpartition(".")[0] if name.startswith(_OUTPUT_TYPE_PACKAGES) else None


def _pass_on(records: list[logging.LogRecord]) -> None:
    """Hand the warnings of the load that succeeded (a legacy layout, a fallback to the full unpickler
    under --trust-pickle) to torch's loggers as if we had not listened: the user should see what torch
    says. One line each: an exception torch attaches is reduced to its first line."""
    for record in records:
        if record.levelno < logging.WARNING:
            continue
        text = _log_text(record)
        if record.exc_info and record.exc_info[1] is not None:
            text = f"{text} ({describe(record.exc_info[1])})"
        record.msg, record.args, record.exc_info, record.exc_text = text, None, None, None
        logging.getLogger(record.name).handle(record)


def _read_exported_program(
    path: Path, *, trust_pickle: bool, read: Callable[[IO[bytes]], Any] = torch.export.load
) -> Any:
    """``read`` (``torch.export.load``, or what returns (program, ...) like it) of an archive that
    :func:`~normswap.load.archive.check_pt2_archive` passed, registering what the archive needs (see
    :func:`_registering_module`) and retrying; only archives that need it pay for those imports. The
    program's calls are checked before it is returned."""
    from normswap.load.archive import check_program_calls, check_pt2_archive

    imported: set[str] = set()
    # An open file avoids torch's suffix check, so a .pt2 archive saved as model.pt still loads; the
    # scan and the load read the same open file.
    with path.open("rb") as f:
        check_pt2_archive(path, f, trust_pickle=trust_pickle)
        while True:
            # torch names what is missing only in a warning it logs, not in the exception it raises;
            # torch's handlers are set aside while an attempt may still fail and be retried, and what a
            # successful attempt logged is passed on to them afterwards
            with _listening() as collect:
                try:
                    f.seek(0)
                    result = read(f)
                except NotReadable:
                    raise
                except Exception as exc:
                    module = _registering_module(" ".join([collect.text(), str(exc)]))
                    if module is None or module in imported:
                        raise
                    try:
                        importlib.import_module(module)
                    except ImportError:
                        raise exc from None
                    imported.add(module)
                    continue
            _pass_on(collect.records)
            check_program_calls(path, result[0] if isinstance(result, tuple) else result)
            return result


def is_args_kwargs_pair(value: Any) -> bool:
    """Whether ``value`` has the layout of ``ExportedProgram.example_inputs``: (args tuple, kwargs dict)."""
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], (tuple, list))
        and isinstance(value[1], Mapping)
        and all(isinstance(k, str) for k in value[1])
    )


def _example_inputs_of(ep: torch.export.ExportedProgram) -> tuple[tuple, dict] | None:
    """The archive's stored example inputs, if they have the (args, kwargs) form torch writes."""
    examples = ep.example_inputs
    if examples is not None and is_args_kwargs_pair(examples):
        return tuple(examples[0]), dict(examples[1])
    return None


def load_program(path: Path, *, trust_pickle: bool) -> tuple[nn.Module, tuple | None, dict | None]:
    """(module, example args, example kwargs) of the torch.export archive at ``path``.

    Nothing in it is unpickled except through the ``weights_only`` loader unless ``trust_pickle``."""
    from normswap.load.archive import UnsafeArchiveError

    try:
        ep = _read_exported_program(path, trust_pickle=trust_pickle)
    except UnsafeArchiveError:
        raise
    except Exception as exc:
        raise BadInputError(f"cannot load torch.export archive {path}: {describe(exc)}") from None
    return program_module(path, ep)


def load_program_on_meta(
    path: Path, *, trust_pickle: bool, unflattened: bool = False
) -> tuple[nn.Module, tuple | None, dict | None, ProgramWeights] | None:
    """Like :func:`load_program`, but the weights are not read: the module holds them on the meta device,
    and the result says where each lies in the archive (by the module's state-dict names), for a process
    to read its part (:mod:`normswap.load.program_weights`). None for an archive this cannot read (another
    layout than torch writes today): load it whole, which reads it or says why. An unsafe archive is
    refused here as there.

    ``unflattened``: the module is ``torch.export.unflatten``'s, whose submodules are called as the
    original model's were (a list of blocks that FSDP2 can shard block by block), not the flat graph with
    its norms lifted to modules that the rewrites take."""
    from normswap.load.archive import UnsafeArchiveError
    from normswap.load.program_weights import read_program_on_meta, weights_of_module

    try:
        ep, stored, state = _read_exported_program(
            path, trust_pickle=trust_pickle, read=lambda f: read_program_on_meta(f, path)
        )
    except UnsafeArchiveError:
        raise
    except Exception:  # another layout (or torch's internals moved): the whole load reads it, or says why
        return None
    if unflattened:
        examples = _example_inputs_of(ep) or _synthesize_example_inputs(ep)
        args, kwargs = examples if examples is not None else (None, None)
        try:
            module: nn.Module = torch.export.unflatten(ep)
        except Exception:  # a program unflatten cannot rebuild: the flat graph, blocks or not
            module, args, kwargs = program_module(path, ep)
    else:
        module, args, kwargs = program_module(path, ep)
    located = weights_of_module(module, state, stored)
    return None if located is None else (module, args, kwargs, located)


def program_module(path: Path, ep: Any) -> tuple[nn.Module, tuple | None, dict | None]:
    """(module, example args, example kwargs) of the program ``ep`` read from ``path``: what a ``.pt2``
    and a graph rewrite's ``.pt`` (its program pickled) are loaded as, the norms lifted to modules."""
    examples = _example_inputs_of(ep) or _synthesize_example_inputs(ep)
    args, kwargs = examples if examples is not None else (None, None)
    try:
        module = ep.module()
    except Exception as exc:
        # a program torch deserialized but cannot rebuild into modules: its internals were edited
        raise BadInputError(
            f"cannot rebuild the program of torch.export archive {path} into a module: {describe(exc)}"
        ) from None
    return _lift(module), args, kwargs
