"""Fold a LayerScale into the layer that writes what it scales (exact): :mod:`.fold`."""
