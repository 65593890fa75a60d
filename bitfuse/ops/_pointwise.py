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


def common_device_dtype(*tensors: torch.Tensor) -> str | None:
    """Why these operands can't share a kernel launch, or None if they can."""
    first = tensors[0]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return "operand is not a tensor"
    if not first.is_cuda:
        return "CPU tensor"
    for t in tensors[1:]:
        if t.device != first.device:
            return "operands on different devices"
        if t.dtype != first.dtype:
            return "mixed dtypes (eager type promotion applies)"
    if first.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {first.dtype}"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd needs the eager graph"
    return None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_shape(D: int, n_rows: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a streaming row-wise kernel.

    Each program moves about 16 KiB of x: enough bytes in flight per SM to
    reach the copy ceiling, few enough programs' tails at small sizes.
    Chosen by the sweep in bench/tune_pointwise.py on the H200.
    """
    block_d = min(triton.next_power_of_2(D), 4096 // elem_bytes * 2)
    target = 16384 // elem_bytes
    block_r = max(1, min(target // block_d, triton.next_power_of_2(n_rows)))
    num_warps = 8 if block_r * block_d * elem_bytes >= 16384 else 4
    return block_r, block_d, num_warps
