"""Exporting rewritten models to ONNX with a check in onnxruntime (:mod:`.onnx`). The translations of
normswap's own ops to standard ONNX ops live with the ops, in :mod:`normswap.kernels.onnx_translation`.

Nothing is imported here, so ``import normswap.export`` does not pull in onnxscript.
"""
