"""Rotary position embedding, as diffusers' LTX-2 applies it to queries and keys.

Two layouts, after diffusers' `apply_interleaved_rotary_emb` and
`apply_split_rotary_emb`:
- interleaved: channel pairs (x[2i], x[2i+1]) rotate; cos and sin are fp32
  with x's shape [B, S, C] (or broadcast to it);
- split: each head's channels are two halves (x[:r], x[r:]) that rotate; cos
  and sin are fp32 [B, H, S, r], read in place whatever their strides
  (diffusers passes a `swapaxes` view).

Eager computes in fp32 and rounds after every op. Interleaved:
`x.float() * cos + x_rot.float() * sin`, then the cast:
    out_a = f32(f32(a * cos) + f32(-b * sin)),  out_b = f32(f32(b * cos) + f32(a * sin)).
Split: `out = x * cos`, then `out[:r].addcmul_(-sin, x[r:])` and
`out[r:].addcmul_(sin, x[:r])`. How aten's CUDA addcmul rounds depends on the
torch build: from pytorch#172750 (torch 2.11) it is one FMA,
fma(-sin, b, f32(a * cos)); before, `a + alpha * (b * c)` rounded the product
first, as the interleaved form does. `addcmul_fuses` probes which, once per
device, and the split kernel follows it. Kernels launch with FMA contraction
off (every other product is rounded, as eager's): the result is exact, so
every tier gets it.

One launch rotates the query and the key when they share the frequencies
(self-attention): cos and sin, fp32 and the largest operands, are read once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import cases
from ._launch import (
    HAS_TRITON,
    FastLaunch,
    GeometryCache,
    cdiv,
    jit,
    needs_int64,
    next_pow2,
    register_op,
    tl,
)
from ._params import common_device_dtype
from .spec import OpSpec

ROPE_TYPES = ("interleaved", "split")

# ---------------------------------------------------------------- kernels


@jit
def _rotate_interleaved(x, c, n, BLOCK: tl.constexpr):
    # x, c, n: BLOCK consecutive channels of one row (BLOCK even, pairs aligned)
    x2 = tl.reshape(x, [BLOCK // 2, 2])
    a, b = tl.split(x2)
    # eager: torch.stack([-x_imag, x_real], -1). Negation as a product: Triton's unary
    # minus is 0 - b, which turns -0.0 into +0.0 where eager's neg gives -0.0.
    rot = tl.join(b * -1.0, a)
    out = x2 * tl.reshape(c, [BLOCK // 2, 2]) + rot * tl.reshape(n, [BLOCK // 2, 2])
    return tl.reshape(out, [BLOCK])


@jit
def _rotary_interleaved_kernel(
    x_ptr, y_ptr, cos_ptr, sin_ptr, xo_ptr, yo_ptr,
    S, C,
    x_sb, x_ss, x_sd,
    y_sb, y_ss, y_sd,
    c_sb, c_ss, c_sd,
    n_sb, n_ss, n_sd,
    HAS_Y: tl.constexpr,
    EVEN: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program (row s, channel block, sample b); BLOCK channels = BLOCK // 2 pairs
    s = tl.program_id(0)
    b = tl.program_id(2)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if INT64:
        s = s.to(tl.int64)
        b = b.to(tl.int64)
        cols = cols.to(tl.int64)
    mask = None if EVEN else cols < C
    c = tl.load(cos_ptr + b * c_sb + s * c_ss + cols * c_sd, mask=mask)
    n = tl.load(sin_ptr + b * n_sb + s * n_ss + cols * n_sd, mask=mask)
    x = tl.load(x_ptr + b * x_sb + s * x_ss + cols * x_sd, mask=mask).to(tl.float32)
    o_off = (b * S + s) * C + cols
    dtype = xo_ptr.dtype.element_ty
    tl.store(xo_ptr + o_off, _rotate_interleaved(x, c, n, BLOCK).to(dtype), mask=mask)
    if HAS_Y:
        y = tl.load(y_ptr + b * y_sb + s * y_ss + cols * y_sd, mask=mask).to(tl.float32)
        tl.store(yo_ptr + o_off, _rotate_interleaved(y, c, n, BLOCK).to(dtype), mask=mask)


@jit
def _rotary_split_kernel(
    x_ptr, y_ptr, cos_ptr, sin_ptr, xo_ptr, yo_ptr,
    S, C,
    x_sb, x_ss, x_sd,
    y_sb, y_ss, y_sd,
    c_sb, c_sh, c_ss, c_sj,
    n_sb, n_sh, n_ss, n_sj,
    HAS_Y: tl.constexpr,
    EVEN: tl.constexpr,
    INT64: tl.constexpr,
    FMA: tl.constexpr,  # eager's addcmul_ is one FMA (see addcmul_fuses)
    R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program (row s, pair block, sample b): pair p is channel j of head h's two halves
    s = tl.program_id(0)
    b = tl.program_id(2)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if INT64:
        s = s.to(tl.int64)
        b = b.to(tl.int64)
        p = p.to(tl.int64)
    h = p // R
    j = p % R
    col_a = h * (2 * R) + j
    col_b = col_a + R
    mask = None if EVEN else p < C // 2
    c = tl.load(cos_ptr + b * c_sb + h * c_sh + s * c_ss + j * c_sj, mask=mask)
    n = tl.load(sin_ptr + b * n_sb + h * n_sh + s * n_ss + j * n_sj, mask=mask)
    row_x = b * x_sb + s * x_ss
    xa = tl.load(x_ptr + row_x + col_a * x_sd, mask=mask).to(tl.float32)
    xb = tl.load(x_ptr + row_x + col_b * x_sd, mask=mask).to(tl.float32)
    row_o = (b * S + s) * C
    dtype = xo_ptr.dtype.element_ty
    oa, ob = _rotate_halves(xa, xb, c, n, FMA)
    tl.store(xo_ptr + row_o + col_a, oa.to(dtype), mask=mask)
    tl.store(xo_ptr + row_o + col_b, ob.to(dtype), mask=mask)
    if HAS_Y:
        row_y = b * y_sb + s * y_ss
        ya = tl.load(y_ptr + row_y + col_a * y_sd, mask=mask).to(tl.float32)
        yb = tl.load(y_ptr + row_y + col_b * y_sd, mask=mask).to(tl.float32)
        oa, ob = _rotate_halves(ya, yb, c, n, FMA)
        tl.store(yo_ptr + row_o + col_a, oa.to(dtype), mask=mask)
        tl.store(yo_ptr + row_o + col_b, ob.to(dtype), mask=mask)


@jit
def _rotate_halves(a, b, c, n, FMA: tl.constexpr):
    # eager: out = x * cos; out[:r].addcmul_(-sin, x[r:]); out[r:].addcmul_(sin, x[:r])
    # (-sin as a product: Triton's unary minus is 0 - sin, which loses eager's -0.0)
    neg = n * -1.0
    if FMA:
        return tl.fma(neg, b, a * c), tl.fma(n, a, b * c)
    else:
        return a * c + neg * b, b * c + n * a


_launch_interleaved = FastLaunch(_rotary_interleaved_kernel, ("HAS_Y", "EVEN", "INT64", "BLOCK"))
_launch_split = FastLaunch(_rotary_split_kernel, ("HAS_Y", "EVEN", "INT64", "FMA", "R", "BLOCK"))


_ADDCMUL_FUSES: dict = {}


def addcmul_fuses(device) -> bool | None:
    """Whether eager `torch.addcmul(a, b, c)` (fp32, value 1) on this device (a CUDA
    index, or -1 for the CPU) rounds once (an FMA) rather than rounding `b * c`
    first. Probed once per device: with b = 1 + 2**-12, b * b is inexact in fp32, so
    addcmul(-fl(b * b), b, b) is the rounding error with an FMA and 0 without. None
    where it is not yet known and can't be probed (torch.compile tracing, CUDA-graph
    capture)."""
    if device.__class__ is not int:  # a device index (what the plan passes) needs no parsing
        device = torch.device(device)
        device = -1 if device.type == "cpu" else (torch.cuda.current_device() if device.index is None else device.index)
    known = _ADDCMUL_FUSES.get(device)
    if known is not None:
        return known
    if torch.compiler.is_compiling() or (device >= 0 and torch.cuda.is_current_stream_capturing()):
        return None
    b = torch.full((1,), 1 + 2**-12, dtype=torch.float32, device="cpu" if device < 0 else f"cuda:{device}")
    fused = bool(torch.addcmul(-(b * b), b, b).item() != 0)
    _ADDCMUL_FUSES[device] = fused
    return fused


# ---------------------------------------------------------------- launcher


class RotaryPlan(NamedTuple):
    """A call that passed the guard: operands (y is None for one tensor), geometry, gate key."""

    rope_type: str
    x: torch.Tensor
    y: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    x_strides: tuple
    y_strides: tuple
    c_strides: tuple
    n_strides: tuple
    B: int
    S: int
    C: int
    R: int  # split: channels per half-head; interleaved: 0
    key: tuple
    wide: bool
    fma: bool = False  # split: eager's addcmul_ is one FMA here


_geometry = GeometryCache()


def plan_rotary(x, freqs, rope_type: str, y=None, tier: str = "lossless") -> RotaryPlan | str:
    """The guard: a plan rotating `x` (and `y`, with the same frequencies), or why
    the call takes the reference."""
    if freqs.__class__ is not tuple or len(freqs) != 2:
        return "freqs is not a (cos, sin) pair"
    cos, sin = freqs
    if not HAS_TRITON:
        return "triton is not installed"
    if rope_type not in ROPE_TYPES:
        return f"unknown rope_type {rope_type!r}"
    why = common_device_dtype(x, y) if y is not None else common_device_dtype(x)
    if why:
        return why
    why = common_device_dtype(cos, sin)
    if why:
        return "cos/sin: " + why
    if cos.dtype is not torch.float32:
        return f"cos/sin must be float32 (eager promotes x to their dtype), got {cos.dtype}"
    if cos.get_device() != x.get_device():
        return "operands on different devices"
    parts = (x.shape, x.stride(), cos.shape, cos.stride(), sin.shape, sin.stride(), x.dtype, x.get_device(), rope_type)
    if y is not None:
        parts += (y.shape, y.stride())
    geometry = _geometry.get(parts, _geometry_of, x, y, cos, sin, rope_type)
    if geometry.__class__ is str:
        return geometry
    fma = False
    if rope_type == "split":
        fma = addcmul_fuses(x.get_device())
        if fma is None:
            return "aten's addcmul rounding not probed yet on this device (capturing or compiling)"
    return RotaryPlan(rope_type, x, y, cos, sin, *geometry, fma)


def _freq_strides_interleaved(f, shape):
    """(sb, ss, sd) of a [B, S, C] frequency tensor broadcast to x's shape, or None."""
    if f.dim() != 3:
        return None
    out = []
    for size, stride, want in zip(f.shape, f.stride(), shape):
        if size == want:
            out.append(stride if size != 1 else 0)
        elif size == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


def _geometry_of(x, y, cos, sin, rope_type):
    if x.dim() != 3:
        return f"x must be [B, S, C], got {x.dim()}-D"
    if x.numel() == 0:
        return "empty tensor"
    if y is not None and y.shape != x.shape:
        return "query and key shapes differ"
    B, S, C = x.shape
    if C % 2:
        return "odd channel count"
    if rope_type == "interleaved":
        c = _freq_strides_interleaved(cos, x.shape)
        n = _freq_strides_interleaved(sin, x.shape)
        if c is None or n is None:
            return "cos/sin do not broadcast to x's shape"
        R = 0
        layout = "batch-broadcast" if c[0] == 0 else "per-sample"
    else:
        if cos.dim() != 4 or sin.shape != cos.shape:
            return "split RoPE expects cos/sin of shape [B, H, S, r]"
        b, h, t, r = cos.shape
        if (b, t, 2 * h * r) != tuple(x.shape):
            return "x is not [B, S, 2 * H * r] for cos/sin's [B, H, S, r]"
        c = (cos.stride(0) if b != 1 else 0, *cos.stride()[1:])
        n = (sin.stride(0) if b != 1 else 0, *sin.stride()[1:])
        R = r
        layout = "dense" if cos.is_contiguous() else "strided"
    xs = x.stride()
    ys = y.stride() if y is not None else (0, 0, 0)
    extents = [(B, xs[0]), (S, xs[1]), (C, xs[2]), (B, ys[0]), (S, ys[1]), (C, ys[2])]
    extents += list(zip(cos.shape, cos.stride())) + list(zip(sin.shape, sin.stride()))
    wide = B * S * C >= 2**31 or needs_int64(*extents)
    key = (rope_type, "q+k" if y is not None else "one", x.dtype, x.get_device(), layout)
    return xs, ys, c, n, B, S, C, R, key, wide


def _block(n: int, limit: int) -> int:
    """Elements of a row per program: the largest power of two from `limit` down to
    64 that divides the row (no masked lanes), else the row's next power of two
    (one masked block, capped at `limit`). Rows like 2240 thus run as 35 blocks of
    64: correct, not tuned (LTX-2's rows are powers of two)."""
    block = limit
    while block > 64 and n % block:
        block //= 2
    if n % block:
        block = min(next_pow2(n), limit)
    return block


def launch_rotary(plan: RotaryPlan, out=None, config=None):
    """Run the kernel for a guarded plan: the rotated x, or (x, y) rotated, into
    `out` (contiguous; a pair for two tensors) if given. `config` overrides
    (BLOCK, num_warps)."""
    x, y = plan.x, plan.y
    B, S, C = plan.B, plan.S, plan.C
    if out is None:
        xo = torch.empty_like(x, memory_format=torch.contiguous_format)
        yo = torch.empty_like(y, memory_format=torch.contiguous_format) if y is not None else xo
    else:
        xo, yo = out if y is not None else (out, out)
    tensors = (x, y if y is not None else x, plan.cos, plan.sin, xo, yo)
    ys = plan.y_strides
    if plan.rope_type == "interleaved":
        block, num_warps = config or (_block(C, 4096), 8)
        _launch_interleaved(
            (S, cdiv(C, block), B), tensors,
            (S, C, *plan.x_strides, *ys, *plan.c_strides, *plan.n_strides),
            (y is not None, C % block == 0, plan.wide, block),
            num_warps,
        )
    else:
        block, num_warps = config or (_block(C // 2, 2048), 8)
        _launch_split(
            (S, cdiv(C // 2, block), B), tensors,
            (S, C, *plan.x_strides, *ys, *plan.c_strides, *plan.n_strides),
            (y is not None, (C // 2) % block == 0, plan.wide, plan.fma, plan.R, block),
            num_warps,
        )
    return (xo, yo) if y is not None else xo


def rotary(x, freqs, rope_type: str = "interleaved", y=None):
    """x (and y) rotated as diffusers' LTX-2 attention rotates them, guarded but
    ungated: the kernel where eligible, else the eager reference."""
    plan = plan_rotary(x, freqs, rope_type, y)
    if plan.__class__ is str:
        return rotary_reference(x, freqs, rope_type, y)
    return launch_rotary(plan)


# ---------------------------------------------------------------- reference


def rotary_reference(x, freqs, rope_type: str = "interleaved", y=None):
    """The eager expressions of diffusers 0.42.1 (`apply_interleaved_rotary_emb`,
    `apply_split_rotary_emb`), op for op: x rotated, or (x, y) rotated when y is given."""
    if y is not None:
        return _rotate_reference(x, freqs, rope_type), _rotate_reference(y, freqs, rope_type)
    return _rotate_reference(x, freqs, rope_type)


def _rotate_reference(x, freqs, rope_type):
    cos, sin = freqs
    if rope_type == "interleaved":
        x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
    if rope_type != "split":
        raise ValueError(f"unknown rope_type {rope_type!r}; choose one of {', '.join(ROPE_TYPES)}")
    x_dtype = x.dtype
    needs_reshape = False
    if x.ndim != 4 and cos.ndim == 4:
        b, h, t, _ = cos.shape
        x = x.reshape(b, t, h, -1).swapaxes(1, 2)
        needs_reshape = True
    last = x.shape[-1]
    if last % 2 != 0:
        raise ValueError(f"Expected x.shape[-1] to be even for split rotary, got {last}.")
    r = last // 2
    split_x = x.reshape(*x.shape[:-1], 2, r).float()
    first_x = split_x[..., :1, :]
    second_x = split_x[..., 1:, :]
    cos_u = cos.unsqueeze(-2)
    sin_u = sin.unsqueeze(-2)
    out = split_x * cos_u
    first_out = out[..., :1, :]
    second_out = out[..., 1:, :]
    first_out.addcmul_(-sin_u, second_x)
    second_out.addcmul_(sin_u, first_x)
    out = out.reshape(*out.shape[:-2], last)
    if needs_reshape:
        out = out.swapaxes(1, 2).reshape(b, t, -1)
    return out.to(dtype=x_dtype)


def _make_args(case: cases.Case, rope_type: str) -> tuple:
    """query and key [B, S, C] (C = D), frequencies as diffusers builds them: interleaved
    [B, S, C] per sample (layout "per-sample") or shared by the batch ("shared");
    split [B, H, S, r] (heads of 128 channels), dense ("dense") or the swapaxes view
    diffusers passes ("strided")."""
    gen = case.generator()
    B, S, C = case.B, case.S, case.D
    q = cases.activation(case, gen)
    k = cases.draw((B, S, C), case.dtype, case.data, gen, case.device, 2.0)
    if rope_type == "interleaved":
        shape = (1 if case.layout == "shared" else B, S, C)
    else:
        shape = (B, S, max(1, C // 128), C // (2 * max(1, C // 128)))
    theta = torch.rand(*shape, device=case.device, generator=gen) * 40 - 20
    freqs = theta.cos(), theta.sin()
    if case.data in ("zeros", "subnormal", "special"):  # signed zeros, subnormals, NaN/inf in the tables too
        freqs = tuple(cases.spoil(f, case.data, gen) for f in freqs)
    if rope_type == "split":
        freqs = tuple(f.swapaxes(1, 2) for f in freqs)
        if case.layout == "dense":
            freqs = tuple(f.contiguous() for f in freqs)
    return q, freqs, rope_type, k


SPECS = {
    rope_type: OpSpec(
        name=f"rotary[{rope_type}]",
        reference=rotary_reference,
        plan=plan_rotary,
        launch={"lossless": launch_rotary},
        make_args=functools.partial(_make_args, rope_type=rope_type),
        layouts=("per-sample", "shared") if rope_type == "interleaved" else ("dense", "strided"),
    )
    for rope_type in ROPE_TYPES
}


# ---------------------------------------------------------------- torch.library


def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_type: str) -> torch.Tensor:
    return rotary(x, (cos, sin), rope_type)


rotary_op = register_op("rotary", _rotary_op, lambda x, cos, sin, rope_type: rotary_reference(x, (cos, sin), rope_type))
