"""Fused RMSNorm / LayerNorm / residual-add + norm: Triton kernels behind ``torch.library`` ops.

Three tiers, as in Liger-Kernel:

1. ``@triton.jit`` kernels (``_kernels``) and their host launchers (``_launch.norm_fwd`` /
   ``norm_bwd``, one pair for both norms and the residual-add variants), which run on whatever device
   their tensors are on (CUDA, or CPU under ``TRITON_INTERPRET=1``);
2. custom ops ``torch.ops.normswap.*`` (:mod:`.ops`) with fake and autograd registrations: Triton on
   CUDA, the reference math of :mod:`.reference` (the definition of the norms' semantics) elsewhere;
3. differentiable functions (:func:`rms_norm`, ...), which the modules of :mod:`normswap.modules.fused`
   call. An eager call on CUDA takes the kernel or torch's own ops, whichever was measured faster for
   its shape (:mod:`._routes`; :func:`kernel_route` forces one, :func:`route_rules` sets the rules).

:mod:`.onnx_translation` translates the ops to standard ONNX ops for the exporter; it imports onnxscript
and is imported only where ONNX is written.

Importing this package registers the ops (our own namespace only). Where triton is installed they are
``torch.library.triton_op``s, so that import imports triton (torch.compile then sees their kernels);
without it they are custom ops and nothing needs triton.
"""

from normswap.kernels._eager import triton_on_cpu
from normswap.kernels._launch import interpreter_enabled, triton_available
from normswap.kernels._routes import kernel_route, route_rules
from normswap.kernels.ops import (
    add_layer_norm,
    add_rms_norm,
    fused_norm,
    layer_norm,
    rms_norm,
)

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "fused_norm",
    "interpreter_enabled",
    "kernel_route",
    "layer_norm",
    "rms_norm",
    "route_rules",
    "triton_available",
    "triton_on_cpu",
]
