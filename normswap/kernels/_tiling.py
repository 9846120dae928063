"""Launch configuration of the norm kernels: how an [M, N] problem is tiled, from measured rules.

:func:`fwd_config` / :func:`bwd_config` answer rows per program, block length, warps, whole-row or
chunked, and (backward) programs per multiprocessor. The compiled-kernel rules come from
``benchmarks/tune_norms.py`` on an H100; the interpreter (CPU tests) gets big tiles instead.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from normswap.kernels.reference import KernelNormKind


def interpreter_enabled() -> bool:
    """Whether Triton kernels launched now run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# The launch rules below were chosen from timings: benchmarks/tune_norms.py swept rows per program,
# warps, whole-row vs chunked and the backward's programs per SM on an H100 (bf16, M = 16384 rows;
# benchmarks/results/tune_norms_h100.jsonl), and each rule is the best or within noise of it.
#
# Largest row, in elements, one program normalizes from registers; longer rows take the chunked kernels,
# which read the row twice (the second read missed L2 in the sweep: 66% of copy at N = 65536 forward,
# 60% backward, against 97-100% / 89% for whole rows up to these limits). Some variants spill a few
# hundred bytes of registers at the forward's 32K limit and still ran at 97-98% of copy; the LayerNorm
# backward spilled 1.8 KB at 16K and ran at half the speed of the chunked path, hence its lower limit.
_FWD_TILE_LIMIT = 32768
_BWD_TILE_LIMIT = {"rms": 16384, "layer": 8192}
# Chunk length of the chunked kernels (forward: one row per program; backward: row tiles x columns).
_FWD_CHUNK = 8192
_BWD_CHUNK = 1024
# Rows shorter than this are batched several to a program so a program still moves enough bytes.
_SHORT_ROW = 2048
# Elements a program's tile holds on short rows (forward) and on the backward's whole-row tiles.
_FWD_SHORT_TILE_ELEMS = 4096
_BWD_TILE_ELEMS = 16384
# The interpreter pays per operation, not per element: bigger tiles make the CPU tests several times
# faster while still leaving several tiles (and the persistent loop) on the test shapes.
_INTERPRETER_TILE_ELEMS = 16384


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class TileConfig:
    """How a launch covers an [M, N] problem.

    ``programs_per_sm`` sets the backward's persistent grid (programs per multiprocessor, each looping
    over row tiles and keeping its own dw/db partial sums); the forward launches one program per tile.
    """

    chunked: bool
    block_m: int
    block_n: int
    num_warps: int
    programs_per_sm: int = 1


def bwd_programs(device: torch.device, cfg: TileConfig) -> int:
    """How many programs the backward wants in flight (before capping by the work there is)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _num_sms(index) * cfg.programs_per_sm
    # Interpreter on CPU: a few programs, so tests see both several partial-sum rows and programs that
    # loop over more than one tile.
    return 3


def _rows_per_program(m: int, tile_elems: int, block_n: int) -> int:
    return max(1, min(tile_elems // block_n, next_pow2(m)))


def _interpreter_config(m: int, n: int, tile_limit: int, chunk: int, chunk_tiles_2d: bool) -> TileConfig:
    """Big tiles: the interpreter's cost is per operation (warps mean nothing there)."""
    if n > tile_limit:
        block_n = min(chunk, next_pow2(tile_limit))
        block_m = _rows_per_program(m, _INTERPRETER_TILE_ELEMS, block_n) if chunk_tiles_2d else 1
        return TileConfig(True, block_m, block_n, 4)
    block_n = next_pow2(n)
    return TileConfig(False, _rows_per_program(m, _INTERPRETER_TILE_ELEMS, block_n), block_n, 4)


@functools.lru_cache(maxsize=4096)  # host time per launch counts at a few rows; shapes repeat
def _fwd_config(m: int, n: int, tile_limit: int, interpret: bool) -> TileConfig:
    if interpret:
        return _interpreter_config(m, n, tile_limit, _FWD_CHUNK, False)
    if n > tile_limit:
        return TileConfig(True, 1, min(_FWD_CHUNK, next_pow2(tile_limit)), 16)
    block_n = next_pow2(n)
    if block_n >= _SHORT_ROW:
        # One row per program; 8 warps up to 8K, then 32 elements per thread (16 warps at 16K).
        return TileConfig(False, 1, block_n, max(8, min(32, block_n // 1024)))
    return TileConfig(False, _rows_per_program(m, _FWD_SHORT_TILE_ELEMS, block_n), block_n, 4)


@functools.lru_cache(maxsize=4096)
def _bwd_config(m: int, n: int, tile_limit: int, interpret: bool, is_rms: bool) -> TileConfig:
    if interpret:
        return _interpreter_config(m, n, tile_limit, _BWD_CHUNK, True)
    if n > tile_limit:
        block_n = min(_BWD_CHUNK, next_pow2(tile_limit))
        return TileConfig(True, _rows_per_program(m, 2048, block_n), block_n, 4, programs_per_sm=4)
    block_n = next_pow2(n)
    if block_n > _SHORT_ROW:
        # 16K-element tiles, 16 warps, one program per SM: the sweep's best from 4K to 16K for RMSNorm.
        # LayerNorm keeps one more row-wide array live; at 8K it ran faster one row at a time.
        tile_elems = _BWD_TILE_ELEMS if is_rms or block_n < 8192 else block_n
        return TileConfig(False, _rows_per_program(m, tile_elems, block_n), block_n, 16)
    if block_n == _SHORT_ROW:
        if is_rms:
            return TileConfig(False, 1, block_n, 8, programs_per_sm=4)
        return TileConfig(False, _rows_per_program(m, 4 * block_n, block_n), block_n, 8, programs_per_sm=2)
    return TileConfig(False, _rows_per_program(m, 4096, block_n), block_n, 4, programs_per_sm=2)


def fwd_config(m: int, n: int, max_block_n: int | None = None, interpret: bool | None = None) -> TileConfig:
    """Forward tiling; ``max_block_n`` lowers the whole-row limit (tests use it to reach the chunked path)."""
    interpret = interpreter_enabled() if interpret is None else interpret
    return _fwd_config(m, n, max_block_n or _FWD_TILE_LIMIT, interpret)


def bwd_config(
    m: int,
    n: int,
    max_block_n: int | None = None,
    interpret: bool | None = None,
    kind: KernelNormKind = "layer",
) -> TileConfig:
    """Backward tiling, as :func:`fwd_config`; the rules differ by ``kind`` (see ``_bwd_config``)."""
    interpret = interpreter_enabled() if interpret is None else interpret
    return _bwd_config(m, n, max_block_n or _BWD_TILE_LIMIT[kind], interpret, kind == "rms")
