"""Numerical checks: how far a rewrite moved a model's outputs."""

from normswap.validate.compare import ModelComparison, compare_models, compare_outputs, run_model
from normswap.validate.metrics import (
    EXACT_TOLERANCE,
    TensorComparison,
    compare_tensors,
    exact_tolerance,
    sqnr_db,
)

__all__ = [
    "EXACT_TOLERANCE",
    "ModelComparison",
    "TensorComparison",
    "compare_models",
    "compare_outputs",
    "compare_tensors",
    "exact_tolerance",
    "run_model",
    "sqnr_db",
]
