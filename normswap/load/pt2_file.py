"""Writing a .pt2 (torch.export's archive) so that every failure is one line and nothing aborts.

Two failures come from torch itself, after minutes of work: a program whose graph torch's serializer has
no form for (a Python ``round()`` of an ``.item()``: SerializeError), found by :func:`pt2_problem` on the
graph alone; and a write error (a full disk), which torch's C++ zip writer turns into an abort of the
interpreter when it meets it in its destructor, kept by :class:`_KeptWriteError` and raised as the
OSError it is.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError, describe


class _KeptWriteError(io.RawIOBase):
    """A sequential file writer for ``torch.export.save`` that keeps the first write error instead of
    raising it. torch's zip writer (C++) raises on a failed write and raises again from its destructor,
    which aborts the interpreter (a full disk was exit 134); so the writer is told every write succeeded
    and the error is raised here once torch is done."""

    def __init__(self, file: io.BufferedWriter) -> None:
        super().__init__()
        self._file = file
        self._position = 0
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:  # torch asks, and seeks to 0 once the archive is complete
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        return offset

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        size = memoryview(data).nbytes
        if self.error is None:
            try:
                self._file.write(data)
            except OSError as exc:
                self.error = exc
        self._position += size
        return size

    def flush(self) -> None:
        if self.error is None:
            try:
                self._file.flush()
            except OSError as exc:
                self.error = exc


def pt2_problem(program: torch.export.ExportedProgram) -> str | None:
    """Why ``program`` cannot be written to a .pt2 (a node torch's serializer has no form for, e.g. a
    Python ``round()`` of an ``.item()``), in one line; None when it can. Only the graph is serialized:
    no weight is copied."""
    from torch._export.serde.serialize import ExportedProgramSerializer

    try:
        ExportedProgramSerializer().serialize(
            program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
        )
    except Exception as exc:  # SerializeError, or an AssertionError from deep inside the serializer
        text = str(exc).strip().splitlines()
        return text[0][:200] if text else type(exc).__name__
    return None


def pt2_refusal(path: Path, problem: str) -> BadInputError:
    return BadInputError(
        f"-o {path}: the model cannot be written to a .pt2 ({problem}); save as .onnx, or as .pt with "
        "--trust-pickle to load it"
    )


def write_pt2(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict | None,
    temp: Path,
    path: Path,
    *,
    portable: bool = False,
    fallbacks: list[str] | None = None,
    static_shapes: bool = False,
) -> list[str]:
    """Export ``model`` and write the program to ``temp``; what loading it needs besides torch
    (:func:`program_needs`). ``portable``: a program that needs nothing else (:func:`portable_program`).
    ``fallbacks`` hears why the program is fixed at the example's shapes, if it is; ``static_shapes``
    fixes it there."""
    from normswap.graph.capture import export_program

    try:
        if portable:
            ep = portable_program(model, example_args, example_kwargs, fallbacks, static_shapes)
        else:
            ep = export_program(
                model,
                example_args,
                example_kwargs,
                grow_unit_dims=True,
                fallbacks=fallbacks,
                dynamic=not static_shapes,
            )
    except Exception as exc:
        raise BadInputError(
            f"torch.export could not trace the model for .pt2 output ({describe(exc)}); save as .pt instead"
        ) from None
    problem = pt2_problem(ep)
    if problem is not None:
        raise pt2_refusal(path, problem)
    with open(temp, "wb") as file:
        writer = _KeptWriteError(file)
        torch.export.save(ep, writer)
        writer.flush()
    if writer.error is not None:
        raise writer.error
    return program_needs(ep)


def program_needs(program: torch.export.ExportedProgram) -> list[str]:
    """What ``torch.export.load`` of ``program`` needs imported besides torch: the packages whose
    operators its graph calls (normswap's fused norms) and whose classes its inputs and outputs are
    (a Hugging Face model's output class), each as the import that provides it."""
    needs: set[str] = set()
    for node in program.graph.nodes:
        namespace = getattr(node.target, "namespace", None)
        if node.op == "call_function" and namespace == "normswap":
            needs.add("normswap.kernels")
    for spec in (program.call_spec.in_spec, program.call_spec.out_spec):
        stack = [spec] if spec is not None else []
        while stack:
            node = stack.pop()
            module = getattr(node.type, "__module__", "") or ""
            if node.type is not None and module.split(".")[0] not in ("builtins", "torch", "collections"):
                needs.add(module)
            # children() where torch has it (children_specs is deprecated there), else the attribute
            stack.extend(node.children() if hasattr(node, "children") else node.children_specs)
    return sorted(needs)


class _PlainOutputs(nn.Module):
    """``model`` returning its outputs as plain dicts, tuples and lists (a Hugging Face ``ModelOutput``
    becomes the dict of its fields), so a program of it names no class of the model's library."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _plain(self.model(*args, **kwargs))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):  # ModelOutput is an OrderedDict of its set fields
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return (
            type(value)(_plain(v) for v in value)
            if type(value) in (tuple, list)
            else tuple(map(_plain, value))
        )
    return value


def portable_program(
    model: nn.Module,
    example_args: tuple,
    example_kwargs: dict | None,
    fallbacks: list[str] | None = None,
    static_shapes: bool = False,
) -> torch.export.ExportedProgram:
    """The program of ``model`` that loads with plain ``torch.export.load``: its outputs plain
    containers, normswap's fused-norm ops replaced by the same math in torch's operators (the reference
    forward: no fused kernel, the numbers as the reference computes them)."""
    from normswap.graph.capture import export_program
    from normswap.kernels.ops import reference_decompositions

    program = export_program(
        _PlainOutputs(model),
        example_args,
        example_kwargs,
        grow_unit_dims=True,
        fallbacks=fallbacks,
        dynamic=not static_shapes,
    )
    return program.run_decompositions(reference_decompositions())


def captured_pt2_problem(graph: torch.fx.Graph) -> str | None:
    """:func:`pt2_problem` before the work, on the torch.export capture normswap took of the model: a
    Python-level op in the graph (not an aten op) that torch's serializer has no form for, e.g. the
    ``round`` of ``round(x.max().item())``. None when there is none or it cannot be judged here (the
    program is checked again, whole, when it is written)."""
    import operator

    try:
        from torch._export.serde.serialize import GraphModuleSerializer

        serializer = GraphModuleSerializer(None, [])  # type: ignore[arg-type]
    except Exception:  # torch's private serializer moved: judged when written
        return None
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            continue
        try:
            serializer.handle_call_function(node)
        except Exception as exc:
            name = getattr(node.target, "__name__", str(node.target))
            text = str(exc).strip().splitlines()
            return (
                f"torch cannot serialize the Python op {name}() in its graph: {text[0][:120] if text else ''}"
            )
    return None
