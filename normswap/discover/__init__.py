"""Norm discovery: which normalizations a model has, what each computes, and how they are wired."""

from normswap.discover.find import NormInventory, find_norms, probe_module
from normswap.discover.site import NORM_KINDS, NormKind, NormSemantics, NormSite

__all__ = [
    "NORM_KINDS",
    "NormInventory",
    "NormKind",
    "NormSemantics",
    "NormSite",
    "find_norms",
    "probe_module",
]
