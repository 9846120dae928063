"""The library calls behind the command line: ``convert`` what ``normswap convert`` does, ``save`` what it
writes. The CLI parses options into a :class:`ConvertConfig`, calls these and renders the result.
Every other command is one call here too, returning one typed result: ``inspect``, ``validate``,
``export_onnx``, ``recalibrate``, ``distill``; with what every command shares (``load_for_inference``,
``check_run_paths``, ``write_report``) and what a renderer words a result with (``SAVE_FORMATS``,
``onnx_tolerance``, ``format_shapes``)."""

from normswap.api.comparison import ComparisonVerdict, Validation, validate
from normswap.api.config import ConvertConfig
from normswap.api.convert import Calibration, ConversionResult, Verdict, convert
from normswap.api.inventory import Inspection, inspect
from normswap.api.onnx_export import export_onnx
from normswap.api.report import jsonable, to_json
from normswap.api.save import SavedOutput, save
from normswap.api.sources import check_run_paths, load_for_inference, write_report
from normswap.api.training import SHARDED_SUFFIX, TrainingRun, distill, recalibrate
from normswap.load import SAVE_FORMATS
from normswap.util.tolerance import onnx_tolerance
from normswap.verify.variants import format_shapes

__all__ = [
    "SAVE_FORMATS",
    "SHARDED_SUFFIX",
    "Calibration",
    "ComparisonVerdict",
    "ConversionResult",
    "ConvertConfig",
    "Inspection",
    "SavedOutput",
    "TrainingRun",
    "Validation",
    "Verdict",
    "check_run_paths",
    "convert",
    "distill",
    "export_onnx",
    "format_shapes",
    "inspect",
    "jsonable",
    "load_for_inference",
    "onnx_tolerance",
    "recalibrate",
    "save",
    "to_json",
    "validate",
    "write_report",
]
