"""Data-driven rewrites: parameters re-estimated from data (BatchNorm statistics, distillation)."""

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

# The function stays at normswap.calibrate.distill.distill: exporting it here would shadow the submodule.
from normswap.calibrate.distill import DistillReport

__all__ = [
    "NORMALIZATIONS",
    "CalibrationData",
    "DistillReport",
    "LayerRecalibration",
    "ModelInputs",
    "RecalibrationReport",
    "as_model_inputs",
    "find_batchnorms",
    "load_calibration_data",
    "recalibrate_batchnorm",
]
