"""Compile the kernels for an H100 (sm_90) without one: type errors, and register spills in ptxas.

The interpreter runs the kernels' Python, not Triton's compiler, so a kernel can pass every CPU test and
still not compile (a loop-carried value that changes type, a constexpr misuse). Triton compiles to a cubin
on a machine without a GPU given an explicit target. The spill check guards the whole-row limits in
``_launch`` (rows above them take the chunked kernels): a config that spills registers to local memory
loses the bandwidth the kernels exist for.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

from normswap.kernels._launch import bwd_config, fwd_config, kernel_module

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

POINTERS_BF16 = {"X", "R", "H", "Y", "W", "B", "DY", "DH", "DX"}  # fp32 for Mean, Rstd, C1, C2, partials
SCALARS_FP32 = {"eps", "weight_offset"}


def _compile(fn, constexprs: dict, num_warps: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in SCALARS_FP32:
            signature[name] = "fp32"
        elif name in ("M", "N") or name.startswith("stride"):
            signature[name] = "i32"
        else:
            signature[name] = "*bf16" if name in POINTERS_BF16 else "*fp32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as e:  # no CUDA toolchain in this triton build
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise


def _spill_bytes(ptx: str) -> int:
    """Bytes of spill stores + loads ptxas reports for the kernel."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    assert found, out.stderr
    return sum(int(s) + int(ld) for s, ld in found)


@pytest.fixture
def compiled_kernels(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("triton.backends.nvidia.compiler")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return kernel_module()


def _fwd_consts(kind: str, block_m: int | None, block_n: int) -> dict:
    consts = {
        "IS_RMS": kind == "rms",
        "HAS_RESIDUAL": True,
        "HAS_W": True,
        "HAS_B": True,
        "LLAMA": True,
        "HAS_OFFSET": True,
        "PROD_DTYPE": tl.bfloat16,
        "RNE_BF16": False,
        "BLOCK_N": block_n,
    }
    if block_m is not None:
        consts["BLOCK_M"] = block_m
    return consts


def _bwd_consts(kind: str, dots_given: bool, block_m: int, block_n: int) -> dict:
    return {
        "IS_RMS": kind == "rms",
        "HAS_DH": True,
        "HAS_W": True,
        "HAS_B": True,
        "LLAMA": True,
        "HAS_OFFSET": True,
        "DOTS_GIVEN": dots_given,
        "RNE_BF16": False,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
    }


# The heaviest variants (every optional input, llama rounding) at the largest whole-row sizes.
@pytest.mark.parametrize("n", [768, 16384])
def test_forward_tile_kernel(compiled_kernels, n):
    cfg = fwd_config(4096, n)
    assert not cfg.chunked
    ck = _compile(
        compiled_kernels.norm_fwd_tile_kernel, _fwd_consts("layer", cfg.block_m, cfg.block_n), cfg.num_warps
    )
    assert _spill_bytes(ck.asm["ptx"]) == 0


def test_forward_chunked_kernel(compiled_kernels):
    cfg = fwd_config(4096, 65536)
    assert cfg.chunked
    ck = _compile(
        compiled_kernels.norm_fwd_chunked_kernel, _fwd_consts("layer", None, cfg.block_n), cfg.num_warps
    )
    assert _spill_bytes(ck.asm["ptx"]) == 0


@pytest.mark.parametrize("n", [768, 8192, 65536])
def test_backward_kernels(compiled_kernels, n):
    cfg = bwd_config(4096, n)
    assert cfg.chunked == (n > 8192)
    consts = _bwd_consts("layer", cfg.chunked, cfg.block_m, cfg.block_n)
    ck = _compile(compiled_kernels.norm_bwd_tile_kernel, consts, cfg.num_warps)
    assert _spill_bytes(ck.asm["ptx"]) == 0
    if cfg.chunked:
        dots = {k: consts[k] for k in ("IS_RMS", "HAS_W", "LLAMA", "HAS_OFFSET", "RNE_BF16")}
        ck = _compile(compiled_kernels.norm_bwd_row_dots_kernel, {**dots, "BLOCK_N": 4096}, 8)
        assert _spill_bytes(ck.asm["ptx"]) == 0


def test_rms_variants_compile(compiled_kernels):
    # The other constexpr branch of every kernel.
    _compile(compiled_kernels.norm_fwd_tile_kernel, _fwd_consts("rms", 4, 1024), 8)
    _compile(compiled_kernels.norm_fwd_chunked_kernel, _fwd_consts("rms", None, 4096), 8)
    _compile(compiled_kernels.norm_bwd_tile_kernel, _bwd_consts("rms", False, 4, 1024), 16)


def test_eps_is_an_fp32_argument():
    # The launchers pass eps as a Python float, which triton types as fp32 (not fp64): the kernel adds
    # it in fp32, as the reference does.
    from triton.runtime.jit import mangle_type

    assert mangle_type(1e-6) == "fp32"
