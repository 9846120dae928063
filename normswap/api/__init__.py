"""The library calls behind the command line: ``convert`` what ``normswap convert`` does, ``save`` what it
writes. The CLI parses options into a :class:`ConvertConfig`, calls these and renders the result."""

from normswap.api.config import ConvertConfig
from normswap.api.convert import Calibration, ConversionResult, Verdict, convert
from normswap.api.report import jsonable, to_json
from normswap.api.save import SavedOutput, save

__all__ = [
    "Calibration",
    "ConversionResult",
    "ConvertConfig",
    "SavedOutput",
    "Verdict",
    "convert",
    "jsonable",
    "save",
    "to_json",
]
