"""Shared plumbing for the row-wise adaLN kernels: Triton import, operand
geometry, broadcast strides and launch shapes.

Every op views its operands as rows: `x` of shape [B, S, D] (or [N, D], read
as B=1, S=N) and parameters that broadcast against it. A broadcast parameter
is passed to the kernel as (stride_b, stride_s, stride_d) with stride 0 on
broadcast axes, so the strided views diffusers makes by `unbind` are read in
place, without a densifying copy.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:  # triton is optional: without it every op takes its eager reference
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

HAS_TRITON = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def jit(fn):
    """`triton.jit`, or the plain function where Triton is missing (never launched then)."""
    return triton.jit(fn) if HAS_TRITON else fn


class Rows(NamedTuple):
    """x seen as B x S rows of D elements, with its strides."""

    B: int
    S: int
    D: int
    sb: int
    ss: int
    sd: int


def rows_of(x: torch.Tensor) -> Rows | None:
    """Row geometry of a 2-D or 3-D operand, or None for any other rank."""
    shape, stride = x.shape, x.stride()
    if len(shape) == 3:
        return Rows(shape[0], shape[1], shape[2], stride[0], stride[1], stride[2])
    if len(shape) == 2:
        return Rows(1, shape[0], shape[1], 0, stride[0], stride[1])
    return None


def broadcast_strides(p: torch.Tensor, x_shape: torch.Size) -> tuple[int, int, int] | None:
    """(stride_b, stride_s, stride_d) of `p` broadcast to `x_shape` (rank 2 or 3),
    or None when `p` does not broadcast to exactly that shape."""
    pshape, pstride = p.shape, p.stride()
    n, k = len(x_shape), len(pshape)
    if k > n:
        return None
    out = [0, 0, 0]
    base = 3 - n  # a rank-2 x has no batch axis: its rows map to axis S
    for i in range(k):
        xi = n - k + i
        size = pshape[i]
        if size == x_shape[xi]:
            # a size-1 axis carries no offset, whatever stride it reports
            out[base + xi] = pstride[i] if size != 1 else 0
        elif size != 1:
            return None
    return out[0], out[1], out[2]


def layout_class(strides: tuple[int, int, int], p: torch.Tensor) -> str:
    """Name the parameter layout for gate signatures: what varies across rows, and
    whether the view is dense. e.g. 'per-sample', 'per-token/strided'."""
    sb, ss, _ = strides
    if ss:
        kind = "per-token"
    elif sb:
        kind = "per-sample"
    else:
        kind = "shared"
    return kind if p.is_contiguous() else kind + "/strided"


def common_device_dtype(*tensors) -> str | None:
    """Why these operands can't share one kernel launch, or None if they can.
    Runs on every call: kept to a few cheap attribute reads."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return "operand is not a tensor"
    first = tensors[0]
    device, dtype = first.get_device(), first.dtype
    if device < 0:
        return "CPU tensor"
    if dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {dtype}"
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.get_device() != device:
            return "operands on different devices"
        if t.dtype is not dtype:
            return "mixed dtypes (eager type promotion applies)"
        if grad and t.requires_grad:
            return "autograd needs the eager graph"
    return None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_shape(D: int, S: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a streaming row-wise kernel: a program
    covers up to 2048 columns of BLOCK_R rows of one sample, so a per-sample
    parameter slice is loaded once per program, not once per row. Picked from
    the sweep in bench/tune_pointwise.py on the H200."""
    block_d = min(triton.next_power_of_2(D), 2048)
    block_r = max(1, min(8192 // block_d, triton.next_power_of_2(S)))
    return block_r, block_d, 8 if block_r * block_d >= 8192 else 4


class FastLaunch:
    """Launch a Triton kernel without re-binding its arguments on every call.

    `JITFunction.run` re-derives the specialization of every argument on each
    launch (~10 us of host time for a kernel with 17 arguments). The first call
    with a given key goes through it and keeps the compiled kernel; later calls
    with the same key launch that kernel directly. The key holds every integer
    argument's value and every pointer's 16-byte alignment, which determine
    Triton's specialization, so a replayed kernel is the one Triton would pick.
    """

    MAX_KEYS = 4096

    def __init__(self, fn):
        self.fn = fn
        self.compiled = {}
        self.direct = _knobs is not None and not INTERPRET

    def __call__(self, grid, tensors, ints, constexprs: dict, options: dict):
        key = (tuple(t.data_ptr() % 16 == 0 for t in tensors), ints, grid, tuple(constexprs.values()),
               tuple(options.values()), tensors[0].dtype, tensors[0].get_device())
        k = self.compiled.get(key)
        if k is not None and self.direct:
            args = (*tensors, *ints, *constexprs.values())
            stream = torch._C._cuda_getCurrentRawStream(key[-1])
            try:
                k.run(grid[0], grid[1], 1, stream, k.function, k.packed_metadata,
                      k.launch_metadata(grid, stream, *args),
                      _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *args)
                return
            except (AttributeError, TypeError):  # another Triton's launcher: use its own path
                self.direct = False
        k = self.fn[grid](*tensors, *ints, **constexprs, **options)
        if k is not None and self.direct:
            if len(self.compiled) >= self.MAX_KEYS:
                self.compiled.clear()
            self.compiled[key] = k


try:
    from triton import knobs as _knobs
except Exception:  # pragma: no cover - older Triton: no direct launch
    _knobs = None
