"""Data-driven rewrites: parameters re-estimated from calibration data (BatchNorm statistics)."""

from normswap.calibrate.batchnorm import (
    LayerRecalibration,
    RecalibrationReport,
    find_batchnorms,
    recalibrate_batchnorm,
)
from normswap.calibrate.data import (
    NORMALIZATIONS,
    CalibrationData,
    ModelInputs,
    as_model_inputs,
    load_calibration_data,
)

__all__ = [
    "NORMALIZATIONS",
    "CalibrationData",
    "LayerRecalibration",
    "ModelInputs",
    "RecalibrationReport",
    "as_model_inputs",
    "find_batchnorms",
    "load_calibration_data",
    "recalibrate_batchnorm",
]
