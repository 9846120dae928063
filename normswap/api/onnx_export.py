"""What ``normswap export MODEL -o OUT.onnx`` does, as a library call: ONNX written atomically once
onnxruntime agrees with PyTorch on it.

::

    saved = normswap.api.export_onnx("model.pt2", Path("model.onnx"), opset=23)
    print(saved.onnx.op_counts)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from normswap.api.sources import check_inputs_fit, check_run_paths, load_for_inference, never_written
from normswap.errors import BadInputError
from normswap.load.inputs import require_inputs

if TYPE_CHECKING:
    from normswap.api.save import SavedOutput


def export_onnx(
    model: str,
    output: str | Path,
    *,
    opset: int | None = None,
    static_shapes: bool = False,
    dtype: str | None = None,
    target: str = "standard",
    weights: str | Path | None = None,
    trust_pickle: bool = False,
    inputs: str | Path | None = None,
    input_shapes: list[str] | None = None,
    overwrite: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> SavedOutput:
    """Export ``model`` (a spec, loaded in inference mode) to the .onnx file ``output`` and check it in
    onnxruntime against PyTorch on the example inputs before it is written (never over the model's own
    file; an existing ``output`` only with ``overwrite``).

    ``target``: "standard" (ONNX's own ops) or "onnxruntime" (norms as onnxruntime's fused ops);
    The file takes any batch and sequence length the model leaves free (``static_shapes``: the example's
    only) and is compared with the model on the example and on the variants the model accepts
    (``saved.shapes`` says which it takes). ``dtype`` ("float32", "float16"): the model and its inputs
    cast to it first (a bf16 checkpoint exports as float32: onnxruntime's CPU build cannot check bf16,
    which is refused before the export). The suffix, the target and the ONNX packages are checked
    before the model is loaded or run; a disagreement raises :class:`~normswap.errors.CheckFailedError`
    and writes nothing.
    """
    from normswap.api.save import refuse_overflowing_cast, save
    from normswap.export.onnx import check_target
    from normswap.load import check_writable
    from normswap.util.dtypes import cast_floating, output_dtype

    output = Path(output)  # a str, as every path parameter takes one
    if output.suffix.lower() != ".onnx":
        raise BadInputError(f"-o {output}: an ONNX export is written to a .onnx file")
    check_target(target)  # before the model is loaded
    # the output rule every command checks first (an existing output, one that is an input), as the CLI
    check_run_paths({"MODEL": model, "--weights": weights, "--inputs": inputs}, {"-o": output}, overwrite)
    cast = None if dtype is None else output_dtype(dtype)  # an unknown name, before the model is read
    loaded = load_for_inference(model, weights, trust_pickle)
    # the ONNX packages and a dtype onnxruntime can check (the one the file is cast to), before the model runs
    check_writable(loaded.model, output, None, dtype=cast)
    args, kwargs = require_inputs(loaded, inputs_file=inputs, input_shapes=input_shapes)
    check_inputs_fit(loaded.model, args, kwargs)  # the user's model, in its own dtype
    if cast is not None:
        loaded.model.to(cast)  # normswap's own copy, read from the file a moment ago
        args, kwargs = cast_floating((args, kwargs), cast)
        refuse_overflowing_cast(loaded.model, args, kwargs, cast)
    if on_step is not None:
        on_step(f"exporting {output} to ONNX and checking it in onnxruntime")
    return save(
        loaded.model,
        output,
        args,
        kwargs,
        opset=opset,
        static_shapes=static_shapes,
        refuse_path=never_written(model),
        target=target,
        overwrite=overwrite,
    )
