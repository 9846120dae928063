"""Getting models in and out: model files and factories, example inputs, atomic saving."""

from normswap.load.inputs import (
    InputSpec,
    load_inputs_file,
    make_inputs,
    parse_input_shape,
    require_inputs,
    resolve_inputs,
)
from normswap.load.model_file import (
    LoadedModel,
    ModelFormat,
    detect_format,
    load_model,
    load_weights,
    read_tensor_file,
)
from normswap.load.save import SAVE_FORMATS, atomic_write, check_writable, save_model

__all__ = [
    "SAVE_FORMATS",
    "InputSpec",
    "LoadedModel",
    "ModelFormat",
    "atomic_write",
    "check_writable",
    "detect_format",
    "load_inputs_file",
    "load_model",
    "load_weights",
    "make_inputs",
    "parse_input_shape",
    "read_tensor_file",
    "require_inputs",
    "resolve_inputs",
    "save_model",
]
