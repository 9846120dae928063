"""Triton kernels for RMSNorm / LayerNorm, with and without a fused residual add.

Never import this module directly: :func:`normswap.kernels._launch.kernel_module` loads it, because
``@triton.jit`` decides between compiled and interpreted kernels when it runs (at import), and the
launcher has to pick per launch (see that function).

Math, over one row of N elements (x is the row, or h = x + residual rounded to x's dtype):

    RMSNorm:   rstd = 1 / sqrt(mean(x^2) + eps),             n = x * rstd
    LayerNorm: mean = mean(x), rstd = 1 / sqrt(var(x) + eps), n = (x - mean) * rstd   (biased var)
    y = affine(n): see ``_affine`` for the casting modes.

Backward, with g = dy * w_eff (or dy without a weight) and means taken over the row:

    RMSNorm:   dx = rstd * (g - n * mean(g * n))
    LayerNorm: dx = rstd * (g - mean(g) - n * mean(g * n))
    dw = sum over rows of dy * n_w,  db = sum over rows of dy

where n_w is n rounded to the input dtype in llama mode (the value the weight multiplied).

Every kernel loads, converts to fp32 at once and rounds to a narrower type only at the store and where
the reference itself rounds (h = x + residual; llama mode): the reductions run in fp32, and the Triton
interpreter (the CPU test path) cannot do bf16 arithmetic. The variance is taken around the mean (one
pass over registers, or Chan's merge of chunks), never as E[x^2] - E[x]^2.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Only builtins of triton.language below, no functions of its jit-written standard library (tl.sum,
# tl.zeros, tl.cdiv): those were compiled or interpreted once, when triton was imported, while this file
# can be loaded in either mode later (see ``_launch.kernel_module``). Hence the local ``_sum``.


@triton.jit
def _add(a, b):
    return a + b


# The interpreter reduces with numpy when the combine function is triton's own sum combiner (it checks
# identity) and makes one Python call per element otherwise, far too slow for tests; a compiled kernel
# needs a combiner built in compiled mode, i.e. ours. The name ``_add`` is rebound rather than aliased:
# torch.compile copies these kernels' source into its own code by the names they use, so a kernel may
# only refer to functions under their own names.
if isinstance(_add, InterpretedFunction):
    _add = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


@triton.jit
def _round_bf16_rne(x):
    # fp32 -> nearest bf16 (ties to even), kept in fp32: add half an ulp of bf16 plus the tie bit, then
    # clear the 16 bits bf16 does not have. NaN passes through (the add could carry into its sign).
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _round(x, dtype: tl.constexpr, rne_bf16: tl.constexpr):
    """x (fp32) rounded to ``dtype``, returned in fp32.

    ``rne_bf16`` does the bf16 rounding in integer arithmetic: the interpreter truncates fp32 -> bf16 where
    GPUs round to nearest even, and truncation biases sums of rounded values (llama-mode dweight drifts
    by several ulps over a few hundred rows). Launchers set it only under the interpreter.
    """
    if rne_bf16 and dtype == tl.bfloat16:
        return _round_bf16_rne(x)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _cast(x, dtype: tl.constexpr, rne_bf16: tl.constexpr):
    """x (fp32) converted to ``dtype`` for a store, rounding to nearest even in both modes."""
    if rne_bf16 and dtype == tl.bfloat16:
        # Already representable, so the interpreter's truncating conversion is exact.
        return _round_bf16_rne(x).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _effective_weight(
    w,
    weight_offset,
    W_DTYPE: tl.constexpr,
    LLAMA: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    # The reference computes (w + offset) in the weight's own dtype in llama mode (it is a plain torch
    # add on the parameter) and in fp32 otherwise (w.float() + offset).
    if HAS_OFFSET:
        w = w + weight_offset
        if LLAMA:
            w = _round(w, W_DTYPE, RNE_BF16)
    return w


@triton.jit
def _affine(
    n,
    w,
    b,
    X_DTYPE: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    LLAMA: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    # llama: n is rounded to the input dtype before the weight multiply, and the product is rounded to
    # promote(x, w) before the bias add, exactly the roundings the eager reference performs. The fp32
    # product of two values of at most 11 significant bits is exact, so rounding it once equals the
    # rounded half-precision product torch computes.
    if LLAMA:
        y = _round(n, X_DTYPE, RNE_BF16)
        if HAS_W:
            y = y * w
            if HAS_B:
                y = _round(y, PROD_DTYPE, RNE_BF16)
    else:
        y = n
        if HAS_W:
            y = y * w
    if HAS_B:
        y = y + b
    return y


@triton.jit
def norm_fwd_tile_kernel(
    X,
    R,
    H,
    Y,
    W,
    B,
    Mean,
    Rstd,
    stride_x,
    stride_r,
    M,
    N,
    eps,
    weight_offset,
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    LLAMA: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """BLOCK_M whole rows per program (BLOCK_N >= N); Y and H are contiguous [M, N]."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    # int64 row offsets: M * N passes 2**31 at e.g. 65536 x 32768.
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # The reference normalizes the rounded sum, so must we.
        x = _round(x + r, H.dtype.element_ty, RNE_BF16)
        tl.store(H + rows64[:, None] * N + cols[None, :], x.to(H.dtype.element_ty), mask=mask)

    if IS_RMS:
        xc = x
    else:
        mean = _sum(x, 1) / N
        tl.store(Mean + rows, mean, mask=row_mask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(_sum(xc * xc, 1) / N + eps)
    tl.store(Rstd + rows, rstd, mask=row_mask)
    n = xc * rstd[:, None]

    w = 0.0
    b = 0.0
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = _effective_weight(w, weight_offset, W.dtype.element_ty, LLAMA, HAS_OFFSET, RNE_BF16)[None, :]
    if HAS_B:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = _affine(n, w, b, X.dtype.element_ty, PROD_DTYPE, HAS_W, HAS_B, LLAMA, RNE_BF16)
    tl.store(Y + rows64[:, None] * N + cols[None, :], _cast(y, Y.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit
def norm_fwd_chunked_kernel(
    X,
    R,
    H,
    Y,
    W,
    B,
    Mean,
    Rstd,
    stride_x,
    stride_r,
    N,
    eps,
    weight_offset,
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    LLAMA: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One row per program, walked in BLOCK_N chunks twice: statistics, then output.

    For rows too long to sit in registers. The second walk re-reads the row, which the first one just
    brought into L2. LayerNorm merges per-chunk (mean, M2) pairs (Chan et al.) instead of summing x and
    x^2, which would cancel catastrophically for rows with a large mean.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    r_row = R + row * stride_r
    h_row = H + row * N
    y_row = Y + row * N
    cols0 = tl.arange(0, BLOCK_N)

    sum_sq = tl.full([BLOCK_N], 0.0, tl.float32)
    mean = tl.full((), 0.0, tl.float32)
    m2 = tl.full((), 0.0, tl.float32)
    count = tl.full((), 0.0, tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            x = _round(x + r, H.dtype.element_ty, RNE_BF16)
            tl.store(h_row + cols, x.to(H.dtype.element_ty), mask=mask)
        if IS_RMS:
            sum_sq += x * x
        else:
            chunk_count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
            chunk_mean = _sum(x, 0) / chunk_count
            d = tl.where(mask, x - chunk_mean, 0.0)
            chunk_m2 = _sum(d * d, 0)
            new_count = count + chunk_count
            delta = chunk_mean - mean
            mean = mean + delta * (chunk_count / new_count)
            m2 = m2 + chunk_m2 + delta * delta * (count * chunk_count / new_count)
            count = new_count
    if IS_RMS:
        rstd = tl.rsqrt(_sum(sum_sq, 0) / N + eps)
    else:
        rstd = tl.rsqrt(m2 / N + eps)
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)

    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # Recompute h rather than reload it: no store-then-load ordering to reason about, and x and r
            # are as likely to be in L2 as h is.
            r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            x = _round(x + r, H.dtype.element_ty, RNE_BF16)
        if IS_RMS:
            n = x * rstd
        else:
            n = (x - mean) * rstd
        w = 0.0
        b = 0.0
        if HAS_W:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            w = _effective_weight(w, weight_offset, W.dtype.element_ty, LLAMA, HAS_OFFSET, RNE_BF16)
        if HAS_B:
            b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        y = _affine(n, w, b, X.dtype.element_ty, PROD_DTYPE, HAS_W, HAS_B, LLAMA, RNE_BF16)
        tl.store(y_row + cols, _cast(y, Y.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit
def norm_bwd_row_dots_kernel(
    DY,
    X,
    W,
    Mean,
    Rstd,
    C1,
    C2,
    stride_dy,
    stride_x,
    N,
    weight_offset,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    LLAMA: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Per-row mean(g * n) -> C1 and mean(g) -> C2 (LayerNorm), for rows too long for one tile.

    With these precomputed, the backward splits a long row across programs by columns, so the dw/db
    partial sums of one program fit in registers; see ``norm_bwd_tile_kernel`` with DOTS_GIVEN.
    """
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_N)
    rstd = tl.load(Rstd + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(Mean + row)
    acc_gn = tl.full([BLOCK_N], 0.0, tl.float32)
    acc_g = tl.full([BLOCK_N], 0.0, tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            g = g * _effective_weight(w, weight_offset, W.dtype.element_ty, LLAMA, HAS_OFFSET, RNE_BF16)
        if IS_RMS:
            n = x * rstd
        else:
            n = tl.where(mask, (x - mean) * rstd, 0.0)
        acc_gn += g * n
        acc_g += g
    tl.store(C1 + row, _sum(acc_gn, 0) / N)
    if not IS_RMS:
        tl.store(C2 + row, _sum(acc_g, 0) / N)


@triton.jit
def norm_bwd_tile_kernel(
    DY,
    DH,
    X,
    W,
    Mean,
    Rstd,
    C1,
    C2,
    DX,
    DW_partial,
    DB_partial,
    stride_dy,
    stride_dh,
    stride_x,
    M,
    N,
    weight_offset,
    IS_RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    LLAMA: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    DOTS_GIVEN: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dx for [BLOCK_M, BLOCK_N] tiles, and this program's partial sums of dw and db.

    Grid (G, C): program (p, c) handles column block c of row tiles p, p + G, p + 2G, ... and writes its
    fp32 sums of dy * n_w and dy to row p of the [G, N] partial buffers; the host sums those G rows. No
    atomics, so dw is deterministic. With DOTS_GIVEN=False a tile spans the whole row (C == 1) and the
    row reductions happen here; with DOTS_GIVEN=True they come from ``norm_bwd_row_dots_kernel``.
    DH is the gradient flowing into the residual-add output h from its other reader: it is added to dx.
    DX is contiguous [M, N].
    """
    pid_m = tl.program_id(0)
    num_pid_m = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N

    w = 0.0
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = _effective_weight(w, weight_offset, W.dtype.element_ty, LLAMA, HAS_OFFSET, RNE_BF16)[None, :]
    dw_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    db_acc = tl.full([BLOCK_N], 0.0, tl.float32)

    num_tiles = (M + BLOCK_M - 1) // BLOCK_M
    for tile in range(pid_m, num_tiles, num_pid_m):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            n = x * rstd[:, None]
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
            n = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)

        if HAS_W:
            g = dy * w
            if LLAMA:
                dw_acc += _sum(dy * _round(n, X.dtype.element_ty, RNE_BF16), 0)
            else:
                dw_acc += _sum(dy * n, 0)
        else:
            g = dy
        if HAS_B:
            db_acc += _sum(dy, 0)

        if DOTS_GIVEN:
            c1 = tl.load(C1 + rows, mask=row_mask, other=0.0)
        else:
            c1 = _sum(g * n, 1) / N
        if IS_RMS:
            dx = (g - n * c1[:, None]) * rstd[:, None]
        else:
            if DOTS_GIVEN:
                c2 = tl.load(C2 + rows, mask=row_mask, other=0.0)
            else:
                c2 = _sum(g, 1) / N
            dx = (g - c2[:, None] - n * c1[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(
            DX + rows64[:, None] * N + cols[None, :], _cast(dx, DX.dtype.element_ty, RNE_BF16), mask=mask
        )

    if HAS_W:
        tl.store(DW_partial + pid_m.to(tl.int64) * N + cols, dw_acc, mask=col_mask)
    if HAS_B:
        tl.store(DB_partial + pid_m.to(tl.int64) * N + cols, db_acc, mask=col_mask)
