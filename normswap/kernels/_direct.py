"""Launching a compiled kernel again without Triton's per-call binding (CUDA, eager calls only).

``kernel[grid](*args)`` binds the arguments to the signature, computes Triton's specialization of every
argument, builds a string cache key, looks the compiled kernel up, then builds launch metadata and calls
two (usually empty) hook chains: at one row that host work is longer than the kernel. A norm call site
launches the same kernel with the same compile-time switches every time, so :class:`DirectKernel` keeps,
per specialization, the kernel that Triton's own launch compiled and returned, and launches it through
its launcher the next time.

Correctness rests on one rule: the key of a launch here is at least as fine as Triton's specialization.
Triton specializes a tensor on its dtype and on whether its address is a multiple of 16, an int on
whether it equals 1, whether it is a multiple of 16 and on its width (i32 / i64 / u64), and a float not
at all; :func:`launch_key` records each of those facts, so two launches with one key would have been
given the same compiled kernel by Triton too. Anything else (a bool, a None) is keyed by its value.

The first launch of every key, and every launch while a Triton launch hook is installed (a profiler
such as proton), a pre-run hook or ``TRITON_DEBUG`` is set, goes through ``kernel[grid]`` as before.
``NORMSWAP_DIRECT_LAUNCH=0`` turns this off (read at import; :func:`set_direct_launch` at run time).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64_MAX = (1 << 63) - 1
_MAX_KEYS = 1024  # compiled kernels kept per jit kernel; a model needs a handful, so this bounds a leak

_enabled = os.environ.get("NORMSWAP_DIRECT_LAUNCH", "1") != "0"
# ROCm's backend specializes tensors on more than their alignment (buffer ops on tensors under 2 GB):
# the key here is proven against CUDA's rules only, so ROCm keeps Triton's own launch
_HIP = torch.version.hip is not None


def set_direct_launch(enabled: bool) -> bool:
    """Turn direct launches on or off; returns the previous setting (benchmarks compare both)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


def direct_launch_enabled() -> bool:
    return _enabled


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def launch_key(args: tuple[Any, ...], constants: dict[str, Any]) -> tuple[Any, ...]:
    """The cache key of one launch: every positional argument's specialization facts and every keyword
    (compile-time switches, tile sizes, ``num_warps``) by name and value.

    Per argument (see the module docstring): an int is coded as one int of its facts (equal to 1, a
    multiple of 16, within i32, within i64; bit 4 marks it an int), a float as the type, a tensor as its
    dtype followed by whether its address is a multiple of 16, anything else by its type and value;
    codes of different kinds never compare equal. One loop, no call per argument: it runs on every eager launch,
    twice per training step of a norm, and at a few rows host time is the cost.
    """
    key = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append(
                16
                | (arg == 1)
                | (arg % 16 == 0) << 1
                | (_I32[0] <= arg <= _I32[1]) << 2
                | (arg <= _I64_MAX) << 3
            )
        elif kind is float:
            key.append(float)
        elif kind in _TENSOR_TYPES or isinstance(arg, torch.Tensor):
            # two entries, not a pair: a dtype is always followed by its alignment, so the sequence
            # reads one way only, and no tuple is built and hashed per tensor
            key.append(arg.dtype)
            key.append(not arg.data_ptr() & 15)
        else:
            key.append((kind, arg))
    return (tuple(key), tuple(constants.items()))


@functools.cache
def _triton_runtime() -> tuple[Any, Callable[[int], int], Callable[[], int]]:
    from triton import knobs
    from triton.runtime import driver

    return knobs.runtime, driver.active.get_current_stream, driver.active.get_current_device


def _hooks_idle(runtime: Any) -> bool:
    """Whether no launch hook is installed (a HookChain with no calls, or None) and debug is off."""
    if runtime.debug:
        return False
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class DirectKernel:
    """A ``@triton.jit`` kernel launched as ``DirectKernel(kernel)[grid](*args, **constants)``: the same
    call as the kernel's own, with later launches of a seen specialization going straight to the
    compiled kernel's launcher."""

    def __init__(
        self, kernel: Any, runtime: tuple[Any, Callable[[int], int], Callable[[], int]] | None = None
    ) -> None:
        """``runtime``: Triton's runtime knobs, the current-stream and current-device functions (Triton's
        own by default; a test gives its own to run without a GPU)."""
        self.kernel = kernel
        self.runtime = runtime
        self.param_names = tuple(p.name for p in kernel.params)
        # key -> (compiled kernel, names of the parameters given by keyword, in signature order)
        self.compiled: dict[tuple[Any, ...], tuple[Any, tuple[str, ...]]] = {}
        # counted for the tests and the host-time diagnosis: every launch, and those that went around
        # Triton's binding
        self.launches = self.direct_launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args: Any, **constants: Any) -> None:
        self.launches += 1
        runtime, current_stream, current_device = self.runtime or _triton_runtime()
        if not _enabled or _HIP or self.kernel.pre_run_hooks or not _hooks_idle(runtime):
            self.kernel[grid](*args, **constants)
            return
        device = current_device()
        key = (device, launch_key(args, constants))
        entry = self.compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constants)
            self._remember(key, compiled, len(args), constants)
            return
        compiled, keyword_names = entry
        values = args + tuple(constants[name] for name in keyword_names) if keyword_names else args
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0],
            grid_y,
            grid_z,
            current_stream(device),
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata: only hooks read it, and none is installed
            None,
            None,
            *values,
        )
        self.direct_launches += 1

    def _remember(
        self, key: tuple[Any, ...], compiled: Any, positional: int, constants: dict[str, Any]
    ) -> None:
        """Keep what Triton compiled and launched, if it is a launchable kernel and every parameter after
        the positional ones was given by keyword (a parameter left to its default is not replayed)."""
        keyword_names = self.param_names[positional:]
        if any(name not in constants for name in keyword_names):
            return
        # a compile-time constant given by position would be keyed by its specialization facts only
        if any(p.is_constexpr for p in self.kernel.params[:positional]):
            return
        if getattr(compiled, "function", None) is None or not hasattr(compiled, "packed_metadata"):
            return
        if len(self.compiled) >= _MAX_KEYS:
            self.compiled.clear()
        self.compiled[key] = (compiled, keyword_names)


_DIRECT: dict[int, DirectKernel] = {}


def direct_kernel(kernel: Any) -> DirectKernel:
    """The one :class:`DirectKernel` of a jit kernel (its cache is shared by every call site)."""
    wrapped = _DIRECT.get(id(kernel))
    if wrapped is None or wrapped.kernel is not kernel:
        wrapped = _DIRECT[id(kernel)] = DirectKernel(kernel)
    return wrapped


__all__ = ["DirectKernel", "direct_kernel", "direct_launch_enabled", "launch_key", "set_direct_launch"]
