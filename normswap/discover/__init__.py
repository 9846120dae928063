"""Norm discovery: which normalizations a model has, and how they are wired."""

from normswap.discover.find import NormInventory, find_norms, probe_module
from normswap.discover.site import NORM_KINDS, NormSite

__all__ = ["NORM_KINDS", "NormInventory", "NormSite", "find_norms", "probe_module"]
