"""The one rule for the options that say how an output is written: an option the chosen output does not
use is refused (exit 2), naming the option and the outputs it applies to, on every command that takes it
(convert, recalibrate, distill; export writes .onnx only) and from Python alike. ``--opset 18`` with
``-o model.pt2`` or ``-o DIR`` was accepted and dropped, while ``--portable`` with such outputs was
refused: the user believed they had an opset-18 file.

- ``--portable``: a .pt2 program;
- ``--opset``: an .onnx file;
- ``--static-shapes``: a written program: a .pt2, an .onnx, or a .pt that holds an exported graph (a graph
  rewrite's result, a .pt2 loaded as a module); never a model directory (weights only).
"""

from __future__ import annotations

from pathlib import Path

_APPLIES = {
    "--portable": "a .pt2 output",
    "--opset": "an .onnx output",
    "--static-shapes": "a written program: a .pt2 or .onnx output, or a .pt of an exported graph",
}


def _kind(output: Path) -> str:
    from normswap.load.checkpoint_write import is_directory_output

    if is_directory_output(output):
        return "directory"
    return {".pt2": "pt2", ".onnx": "onnx", ".pt": "pickle", ".pth": "pickle"}.get(
        output.suffix.lower(), "other"
    )


def unused_output_option(
    output: str | Path | None,
    *,
    opset: int | None = None,
    static_shapes: bool = False,
    portable: bool = False,
    program: bool | None = None,
) -> str | None:
    """Why an output option given is not used by ``output`` (its sentence), or None when each is.
    ``program``: whether a .pt output will hold an exported graph (None: not known yet, so
    ``static_shapes`` is not judged for a .pt; the writer judges it on the model). No output: only
    ``portable`` is judged (its output is chosen with it); the others wait for the path to be given."""
    given = [
        name
        for name, on in (
            ("--portable", portable),
            ("--opset", opset is not None),
            ("--static-shapes", static_shapes),
        )
        if on
    ]
    if not given:
        return None
    kind = None if output is None else _kind(Path(output))
    for name in given:
        if kind is None and name != "--portable":
            continue
        if name == "--portable":
            used = kind == "pt2"
        elif name == "--opset":
            used = kind == "onnx"
        else:
            used = kind in ("pt2", "onnx") or (kind == "pickle" and program is not False)
        if not used:
            what = "no output" if output is None else output
            return f"{name} is for {_APPLIES[name]}, not {what}: drop it, or choose such an output"
    return None


def check_output_options(
    output: str | Path | None,
    *,
    opset: int | None = None,
    static_shapes: bool = False,
    portable: bool = False,
    program: bool | None = None,
) -> None:
    """BadInputError with :func:`unused_output_option`'s sentence, when it has one."""
    from normswap.errors import BadInputError

    problem = unused_output_option(
        output, opset=opset, static_shapes=static_shapes, portable=portable, program=program
    )
    if problem is not None:
        raise BadInputError(problem)
