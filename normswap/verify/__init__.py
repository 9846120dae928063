"""Numerical checks: how far a rewrite moved a model's outputs."""

from normswap.verify.compare import ModelComparison, compare_models, compare_outputs, run_model
from normswap.verify.metrics import TensorComparison, compare_tensors, sqnr_db

__all__ = [
    "ModelComparison",
    "TensorComparison",
    "compare_models",
    "compare_outputs",
    "compare_tensors",
    "run_model",
    "sqnr_db",
]
