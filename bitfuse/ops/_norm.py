"""Shared code of the norm + modulate kernels (the reduction base, as Quack keeps
`reduction_base.py`): the row program's indices, rsqrt, the one-pass modulate
tail, the operand guard, launch shapes of the one-pass kernels, and the float64
yardstick of the high tier."""

from __future__ import annotations

import functools

import torch

from ._launch import HAS_TRITON, jit, next_pow2, tl
from ._params import Folded, broadcast_strides, common_device_dtype, rows_of, value

MAX_D = 16384  # the kernels keep a row in registers; wider rows take the reference


@jit
def rsqrt(x, ASM: tl.constexpr):
    """CUDA's `rsqrtf` (rsqrt.approx.f32): libdevice's, or (ASM) the instruction inline."""
    if ASM:
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.rsqrt(x)


@jit
def program_rows(S, R: tl.constexpr):
    """This program's rows: sample b (grid axis 1), positions s in it (axis 0), the flat
    row index b * S + s and the row mask. A flat grid would divide by S before the
    first load (an integer division's latency in every program)."""
    s32 = tl.program_id(0) * R + tl.arange(0, R)
    b = tl.program_id(1).to(tl.int64)
    s = s32.to(tl.int64)
    return b, s, b * S + s, s32 < S


@jit
def overflow_scale(x):
    """Per row of the fp32 tile x [R, BLOCK]: 1.0, or for a row whose largest |x| is
    2**48 or more (its sum of squares could overflow fp32, as eager's does) the power
    of two that brings it to about 2**32. The RMSNorm one-pass kernels reduce x * s and
    undo s exactly (powers of two), so the high tier stays accurate on such rows; on every
    other row s = 1 and nothing changes. The kernels call it only for a tile where a
    sum of squares came out above 3e38 (an extra reduction otherwise: 89% -> 80% of
    the copy ceiling at 6144 x 4096 on the H200)."""
    amax = tl.max(tl.abs(x), axis=1)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
    big = (e >= 127 + 48) & (e < 255)
    return tl.where(big, ((127 + 32 + 127 - e) << 23).to(tl.float32, bitcast=True), 1.0)


@jit
def modulate_once(n, scale, shift, dtype: tl.constexpr):
    """n * (1 + scale) + shift in fp32, rounded once to `dtype`: the high tier's tail.
    The kernels launch with FMA contraction off, so the fp32 product and sum are
    each rounded in fp32 (errors ~2**-24, far below one ULP of bf16/fp16)."""
    return (n * (1.0 + scale.to(tl.float32)) + shift.to(tl.float32)).to(dtype)


def check_operands(x, scale, shift):
    """The guard both norm ops share: (rows, c_strides, h_strides) or a reason string.
    Folded parameters must be unpacked by the caller (`tables_of`)."""
    if not HAS_TRITON:
        return "triton is not installed"
    if scale.__class__ is Folded or shift.__class__ is Folded:
        return "this kernel takes no Folded parameters"
    why = common_device_dtype(x, scale, shift)
    if why:
        return why
    rows = rows_of(x)
    if rows is None:
        return f"x must be 2-D or 3-D, got {x.dim()}-D"
    if x.numel() == 0:
        return "empty tensor"
    if rows.sd != 1:
        return "x's last dimension is not contiguous"
    c = broadcast_strides(scale, x.shape)
    h = broadcast_strides(shift, x.shape)
    if c is None or h is None:
        return "scale/shift do not broadcast to x's shape"
    return rows, c, h


_DUMMY: dict = {}


def dummy_stats(x):
    """A placeholder fp32 pointer for the exact kernels' stats output (not written)."""
    d = _DUMMY.get(x.get_device())
    if d is None:
        d = _DUMMY[x.get_device()] = torch.empty(2, dtype=torch.float32, device=x.device)
    return d


@functools.lru_cache(maxsize=None)
def device_family(device: int) -> str:
    """What a per-device launch table is keyed by: "H100" for an H100 (HBM at 2.0-3.9
    TB/s, where a kernel's arithmetic hides under its memory time), else "" (the tables'
    defaults were measured on the H200, 4.8 TB/s). -1: the CPU (the interpreter)."""
    if device < 0:
        return ""
    return "H100" if "H100" in torch.cuda.get_device_name(device) else ""


def high_launch_shape(block_d: int, S: int, elem_bytes: int, warps: dict) -> tuple[int, int]:
    """(R, num_warps) for the one-pass kernels: a 16-bit row of a padded width in the
    op's `warps` table (width -> warps, measured per op: bench/NOTES.md, "Norm launch
    shapes") one row a program on that many warps; otherwise about 8 KiB of x a
    program, at most the S rows of a sample."""
    if elem_bytes == 2 and block_d in warps:
        return 1, warps[block_d]
    R = max(1, min(8192 // (block_d * elem_bytes), next_pow2(S)))
    num_warps = max(1, min(8, R * block_d * elem_bytes // 2048))
    return R, num_warps


# ---------------------------------------------------------------- the high tier's yardstick


def rms_norm64(x, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def layer_norm64(x, eps: float) -> torch.Tensor:
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps)


def modulated64(n64, scale, shift) -> torch.Tensor:
    return n64 * (1 + value(scale).double()) + value(shift).double()


def modulated_terms64(n64, scale, shift) -> torch.Tensor:
    return (n64 * (1 + value(scale).double())).abs().maximum(value(shift).double().abs())
