"""Host side of the norm kernels (tier 1): tile configuration, argument preparation and launches.

:func:`norm_fwd` / :func:`norm_bwd` launch the kernels for RMSNorm (``kind="rms"``) and LayerNorm
(``"layer"``), with or without the residual add, on whatever device the tensors are on: CUDA, or CPU
under ``TRITON_INTERPRET=1``. No autograd and no dispatch here: most code wants
:func:`normswap.kernels.rms_norm` and friends. Nothing here imports triton at module import time, so
``import normswap.kernels`` works without it.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType

import torch

from normswap.kernels._direct import direct_kernel
from normswap.kernels._tiling import (
    TileConfig,
    bwd_config,
    bwd_programs,
    cdiv,
    fwd_config,
    interpreter_enabled,
    next_pow2,
)
from normswap.kernels.reference import CASTING_MODES, KernelNormKind

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (it is optional: the CPU reference path never needs it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_KERNEL_MODULES: dict[bool, ModuleType] = {}


def kernel_module(interpret: bool | None = None) -> ModuleType:
    """The module of jit kernels matching the interpreter setting at this moment.

    ``@triton.jit`` chooses between a compiled and an interpreted kernel when the decorator runs, i.e.
    when the module is imported, but the test suite may set ``TRITON_INTERPRET`` after something else
    imported triton or normswap. Loading a second copy of the kernel file when the setting differs from
    the one the regular import saw makes the choice per launch and independent of import order. (For
    the same reason the kernels use no jit function of triton's standard library, ``tl.sum`` and the
    like: those were fixed in one mode when triton was imported.)
    """
    if interpret is None:
        interpret = interpreter_enabled()
    module = _KERNEL_MODULES.get(interpret)
    if module is not None:
        return module
    if not triton_available():
        raise RuntimeError("normswap's fused norm kernels need triton, which is not installed")
    from triton.runtime.interpreter import InterpretedFunction

    from normswap.kernels import _kernels

    if isinstance(_kernels.norm_fwd_tile_kernel, InterpretedFunction) != interpret:
        name = f"normswap.kernels._kernels_{'interpreted' if interpret else 'compiled'}"
        spec = importlib.util.spec_from_file_location(name, _kernels.__file__)
        assert spec is not None and spec.loader is not None
        _kernels = importlib.util.module_from_spec(spec)
        # Triton reads the kernel source through the module: it must be findable by name.
        sys.modules[name] = _kernels
        spec.loader.exec_module(_kernels)
    _KERNEL_MODULES[interpret] = _kernels
    return _kernels


def output_dtype(
    x_dtype: torch.dtype, weight: torch.Tensor | None, bias: torch.Tensor | None, casting: str
) -> torch.dtype:
    """dtype of y: the input's, except in llama mode where the weight multiply and bias add promote."""
    if casting != "llama":
        return x_dtype
    dtype = x_dtype
    for t in (weight, bias):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _tl_dtype(dtype: torch.dtype):  # -> tl.dtype
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


# Rows assumed for the tiling when torch.compile traces with a symbolic row count: any count at least
# this large gets the same configuration, and masks make it correct for fewer rows.
_SYMBOLIC_ROWS = 1 << 16
# torch's count of active dispatch modes, bound once (a launch asks it every time)
_dispatch_stack_depth = torch._C._len_torch_dispatch_stack


def _concrete_rows(m: int | torch.SymInt) -> int:
    return m if isinstance(m, int) else _SYMBOLIC_ROWS


def _row_length(x: torch.Tensor) -> int:
    """The normalized dim's size as an int: the tiling is chosen per row length, so a symbolic one
    (torch.compile with ``dynamic=True``) is specialized, with a guard, rather than traced."""
    return int(x.shape[-1])


def _launcher(kernel, interpret: bool, x: torch.Tensor):
    """``kernel`` as the launch site calls it: through ``torch.library.wrap_triton`` while torch traces.

    Under torch.compile the ops are decomposed (they are ``triton_op``s) and traced with functional or
    fake tensors; ``wrap_triton`` records each launch as a node Inductor compiles into its own code.
    A plain tensor ``x`` outside any dispatch mode launches directly: the wrapper would cost a dispatch round
    trip per launch, and eager host time counts at a few rows; a kernel already compiled for the call's
    specialization skips Triton's binding too (:mod:`._direct`).
    """
    if interpret:
        return kernel
    if not _dispatch_stack_depth() and type(x) in (torch.Tensor, torch.nn.Parameter):
        return direct_kernel(kernel)
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as [M, n] with unit column stride; a view when the leading dims allow it (no copy)."""
    t2 = t if t.ndim == 2 else t.reshape(-1, n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.contiguous() if t is not None else None


def check_args(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    casting: str,
) -> None:
    if casting not in CASTING_MODES:
        raise ValueError(f"casting must be one of {CASTING_MODES}, got {casting!r}")
    if x.ndim == 0:
        raise ValueError("a norm needs at least one dimension to normalize over")
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},) to normalize the last dim, got {tuple(t.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            "the residual must have the input's shape and dtype, got "
            f"{tuple(residual.shape)} {residual.dtype} for input {tuple(x.shape)} {x.dtype}"
        )


def triton_supports(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels handle these dtypes (fp32/fp16/bf16); others go to the reference math."""
    # A loop, not all(<generator>): it runs several times per call, and at a few rows host time counts.
    for t in tensors:  # noqa: SIM110
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            return False
    return True


def norm_fwd(
    kind: KernelNormKind,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Launch the forward kernel: returns (y, h or None, mean or None, rstd).

    y and h have x's shape and are contiguous; mean and rstd are fp32 of shape x.shape[:-1].
    """
    check_args(x, residual, weight, bias, casting)
    if not triton_supports(x, weight, bias):
        raise TypeError(f"the Triton norm kernels take fp32/fp16/bf16 tensors, got {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError("cannot normalize over an empty last dimension")
    return launch_fwd(kind, x, residual, weight, bias, eps, casting, weight_offset, max_block_n)


@functools.lru_cache(maxsize=256)
def _fwd_switches(
    kind: str,
    has_residual: bool,
    has_w: bool,
    has_b: bool,
    llama: bool,
    has_offset: bool,
    prod: torch.dtype,
    interpret: bool,
) -> dict:
    """The forward kernels' compile-time switches (read-only: the launch unpacks a copy)."""
    return {
        "IS_RMS": kind == "rms",
        "HAS_RESIDUAL": has_residual,
        "HAS_W": has_w,
        "HAS_B": has_b,
        "LLAMA": llama,
        "HAS_OFFSET": has_offset,
        "PROD_DTYPE": _tl_dtype(prod),
        "RNE_BF16": interpret,
    }


def launch_fwd(
    kind: KernelNormKind,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    casting: str,
    weight_offset: float,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """:func:`norm_fwd` without its argument checks, for callers that made them (the eager path: at a
    few rows the host time of a call is its cost)."""
    n = _row_length(x)
    lead = x.shape[:-1]
    x2 = _rows(x, n)
    m = x2.shape[0]
    weight, bias = _contiguous(weight), _contiguous(bias)  # the kernels index them with unit stride
    device = x.device
    # Allocated in their final shapes: contiguous, so the kernels' row-major [M, N] indexing holds.
    y = torch.empty(x.shape, dtype=output_dtype(x.dtype, weight, bias, casting), device=device)
    rstd = torch.empty(lead, dtype=torch.float32, device=device)
    mean = torch.empty(lead, dtype=torch.float32, device=device) if kind == "layer" else None
    h = torch.empty(x.shape, dtype=x.dtype, device=device) if residual is not None else None
    r2 = _rows(residual, n) if residual is not None else None

    if m > 0:
        interpret = interpreter_enabled()  # read once: the environment lookup costs at a few rows
        ker = kernel_module(interpret)
        prod = torch.promote_types(x.dtype, weight.dtype) if weight is not None else x.dtype
        cfg = fwd_config(_concrete_rows(m), n, max_block_n, interpret)
        args = (
            x2,
            r2 if r2 is not None else x2,
            h if h is not None else x2,
            y,
            weight if weight is not None else x2,
            bias if bias is not None else x2,
            mean if mean is not None else rstd,
            rstd,
            x2.stride(0),
            r2.stride(0) if r2 is not None else 0,
        )
        consts = _fwd_switches(
            kind,
            residual is not None,
            weight is not None,
            bias is not None,
            casting == "llama",
            weight is not None and weight_offset != 0.0,
            prod,
            interpret,
        )
        # eps and the offset go in as Python floats: triton passes them as fp32 kernel arguments.
        if cfg.chunked:
            _launcher(ker.norm_fwd_chunked_kernel, interpret, x2)[(m,)](
                *args,
                n,
                float(eps),
                float(weight_offset),
                **consts,
                BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps,
            )
        else:
            grid = (cdiv(m, cfg.block_m),)
            _launcher(ker.norm_fwd_tile_kernel, interpret, x2)[grid](
                *args,
                m,
                n,
                float(eps),
                float(weight_offset),
                **consts,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps,
            )

    return y, h, mean, rstd


def norm_bwd(
    kind: KernelNormKind,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward: returns (dx, dweight or None, dbias or None).

    ``x`` is the tensor that was normalized (h for the residual-add variants), ``dh`` the gradient that
    reached h from its other readers (added to dx). dx has x's dtype, dweight and dbias their parameter's.
    """
    check_args(x, None, weight, bias, casting)
    for name, t in (("dy", dy), ("dh", dh)):
        if t is not None and t.shape != x.shape:
            raise ValueError(
                f"{name} must have the normalized tensor's shape {tuple(x.shape)}, got {tuple(t.shape)}"
            )
    if kind == "layer" and mean is None:
        raise ValueError("the LayerNorm backward needs the saved mean")
    if not triton_supports(dy, dh, x, weight, bias):
        raise TypeError("the Triton norm kernels take fp32/fp16/bf16 tensors")
    dx, dw, db = launch_bwd(kind, dy, dh, x, weight, bias, mean, rstd, casting, weight_offset, max_block_n)
    # The launcher sums both parameters' partials in one buffer (one op less at a few rows, where host
    # time counts), so its dw and db may share storage; the op's results may not alias each other.
    return dx, dw, db.clone() if dw is not None and db is not None else db


def launch_bwd(
    kind: KernelNormKind,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    casting: str,
    weight_offset: float,
    max_block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`norm_bwd` without its argument checks (the eager path's backward: its forward checked)."""
    n = _row_length(x)
    x2 = _rows(x, n)
    m = x2.shape[0]
    weight = _contiguous(weight)
    dy2 = _rows(dy, n)
    dh2 = _rows(dh, n) if dh is not None else None
    device = x.device
    dx = torch.empty(x.shape, dtype=x.dtype, device=device)
    rstd1 = rstd.reshape(m).float().contiguous()
    mean1 = mean.reshape(m).float().contiguous() if mean is not None else rstd1

    interpret = interpreter_enabled()
    cfg = bwd_config(_concrete_rows(m), n, max_block_n, interpret, kind)
    num_col_blocks = cdiv(n, cfg.block_n) if cfg.chunked else 1
    num_tiles = cdiv(m, cfg.block_m)
    target_programs = bwd_programs(device, cfg)
    wanted = target_programs // num_col_blocks
    if isinstance(num_tiles, int):  # plain ints: torch.sym_* would cost several µs per call
        grid_m = max(1, min(num_tiles, wanted))
    else:  # a symbolic row count (torch.compile with dynamic shapes)
        grid_m = torch.sym_max(1, torch.sym_min(num_tiles, wanted))
    # [grid_m, N] fp32 partial sums, one row per program: no atomics, deterministic dw/db. Weight and
    # bias share one buffer, summed and cast by one op each: at a few rows each op's host time counts.
    n_partials = (weight is not None) + (bias is not None)
    partials = (
        torch.empty((n_partials, grid_m, n), dtype=torch.float32, device=device) if n_partials else None
    )
    dw_partial = partials[0] if weight is not None else None
    db_partial = partials[-1] if bias is not None else None

    if m > 0:
        ker = kernel_module(interpret)
        w_arg = weight if weight is not None else x2
        c1 = c2 = rstd1
        # Compile-time switches both backward kernels take.
        flags = {
            "IS_RMS": kind == "rms",
            "HAS_W": weight is not None,
            "LLAMA": casting == "llama",
            "HAS_OFFSET": weight is not None and weight_offset != 0.0,
            "RNE_BF16": interpret,
        }
        if cfg.chunked:
            c1 = torch.empty((m,), dtype=torch.float32, device=device)
            c2 = torch.empty((m,), dtype=torch.float32, device=device) if kind == "layer" else c1
            # Only row sums here, so a longer chunk than the tile kernel's is cheap in registers.
            dots_block = min(next_pow2(n), 4 * cfg.block_n)
            _launcher(ker.norm_bwd_row_dots_kernel, interpret, x2)[(m,)](
                dy2,
                x2,
                w_arg,
                mean1,
                rstd1,
                c1,
                c2,
                dy2.stride(0),
                x2.stride(0),
                n,
                float(weight_offset),
                **flags,
                BLOCK_N=dots_block,
                num_warps=max(1, min(16, dots_block // 512)),
            )
        _launcher(ker.norm_bwd_tile_kernel, interpret, x2)[(grid_m, num_col_blocks)](
            dy2,
            dh2 if dh2 is not None else dy2,
            x2,
            w_arg,
            mean1,
            rstd1,
            c1,
            c2,
            dx,
            dw_partial if dw_partial is not None else rstd1,
            db_partial if db_partial is not None else rstd1,
            dy2.stride(0),
            dh2.stride(0) if dh2 is not None else 0,
            x2.stride(0),
            m,
            n,
            float(weight_offset),
            **flags,
            HAS_DH=dh is not None,
            HAS_B=bias is not None,
            DOTS_GIVEN=cfg.chunked,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
        )
    elif partials is not None:
        partials.zero_()  # no rows: the parameter gradients are zero, not an unwritten buffer's garbage

    if partials is None:
        return dx, None, None
    # One program's partial row is the sum itself (a view, no reduction launched); a symbolic count
    # (torch.compile) is not asked, which would guard on it
    sums = partials[:, 0] if isinstance(grid_m, int) and grid_m == 1 else partials.sum(1)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        return dx, sums[0].to(weight.dtype), sums[1].to(bias.dtype)
    sums = sums.to((weight if weight is not None else bias).dtype)
    return dx, sums[0] if weight is not None else None, sums[-1] if bias is not None else None


__all__ = [
    "SUPPORTED_DTYPES",
    "TileConfig",
    "bwd_config",
    "check_args",
    "fwd_config",
    "interpreter_enabled",
    "kernel_module",
    "launch_bwd",
    "launch_fwd",
    "norm_bwd",
    "norm_fwd",
    "output_dtype",
    "triton_available",
    "triton_supports",
]
