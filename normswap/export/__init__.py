"""Exporting rewritten models: ONNX translations of normswap's own ops (:mod:`.onnx_ops`).

Nothing is imported here, so ``import normswap.export`` does not pull in onnxscript.
"""
