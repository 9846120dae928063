"""The one rule for the options that say how an output is written: an option the chosen output does not
use is refused (exit 2), naming the option and the outputs it applies to, on every command that takes it
(convert, recalibrate, distill; export writes .onnx only) and from Python alike. ``--opset 18`` with
``-o model.pt2`` or ``-o DIR`` was accepted and dropped, while ``--portable`` with such outputs was
refused: the user believed they had an opset-18 file.

- ``--portable``: a .pt2 program;
- ``--opset``: an .onnx file;
- ``--static-shapes``: a written program: a .pt2, an .onnx, or a .pt (which holds one when the model is
  an exported graph; a plain module's .pt has no shapes to fix, so the option changes nothing there);
  never a model directory (weights only).

Every one is judged from the output's path alone, so every route and command refuses it before any work.
"""

from __future__ import annotations

from pathlib import Path

_APPLIES = {
    "--portable": ("a .pt2 output", ("pt2",)),
    "--opset": ("an .onnx output", ("onnx",)),
    "--static-shapes": ("a written program: a .pt2, .onnx or .pt output", ("pt2", "onnx", "pickle")),
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
) -> str | None:
    """Why an output option given is not used by ``output`` (its sentence), or None when each is. No
    output: only ``portable`` is judged (its output is chosen with it); the others wait for the path."""
    given = {"--portable": portable, "--opset": opset is not None, "--static-shapes": static_shapes}
    for name, on in given.items():
        if not on or (output is None and name != "--portable"):
            continue
        applies, kinds = _APPLIES[name]
        if output is None:
            return f"{name} is for {applies}, and no output is given: give one, or drop it"
        if _kind(Path(output)) not in kinds:
            return f"{name} is for {applies}, not {output}: drop it, or choose such an output"
    return None


def check_output_options(
    output: str | Path | None,
    *,
    opset: int | None = None,
    static_shapes: bool = False,
    portable: bool = False,
) -> None:
    """BadInputError with :func:`unused_output_option`'s sentence, when it has one."""
    from normswap.errors import BadInputError

    problem = unused_output_option(output, opset=opset, static_shapes=static_shapes, portable=portable)
    if problem is not None:
        raise BadInputError(problem)
