"""Weightless RMSNorm + adaLN modulation: `rms_norm(x) * (1 + scale) + shift`.

Two references (`reference=`), two reduction orders:

"diffusers" -- diffusers' RMSNorm without weight:
    v = x.to(float32).pow(2).mean(-1, keepdim=True)
    n = (x * torch.rsqrt(v + eps)).to(x.dtype)
"aten" -- `F.rms_norm(x, (D,), eps=eps)`, aten's fused `_fused_rms_norm`
    kernel (torch >= 2.9; earlier versions run composite ops: fallback).

Both are followed by eager's modulate, three roundings: bf16(1 + scale),
bf16(n * t), bf16(p + shift) (fp16 likewise; no-ops for fp32).

EXACT MODE (`exact=True`) is bit-identical to the reference: it reproduces the
reduction ORDER and every rounding. Kernels launch with `enable_fp_fusion=False`;
each FMA that aten's nvcc build contracts is an explicit `tl.fma`, every other
product and sum is rounded. A tree step `v[i] + v[i+k]` is a sum over an axis
of size 2 (one add, commutative, so exact).

"diffusers" order (the mean is `reduce_kernel<MeanOps<float>>`, Reduce.cuh, on
the fresh contiguous fp32 tensor `x.float().pow(2)`; N rows of D):
  * setReduceConfig<float, float, vt0=4, input_vec_size=4>: reduction on the
    fastest dimension, vectorised (float4): dim0 = D/4, dim1 = N, at most 512
    threads: block width bw = min(lp2(D/4) capped at 512, 512/bh), block
    height bh = min(lp2(N), 16); bw = 32 for N >= 16, and 64, 128, 256, 512
    for N in [8,16), [4,8), [2,4), {1} (lp2: largest power of 2 <= n);
    `mean_reduce_config`.
  * input_vectorized_thread_reduce_impl: lane t of a row loads the float4
    vectors t, t+bw, t+2bw, ... into FOUR accumulators (one per position in the
    vector), serial fp32 sums from 0, combined ((a0 + a1) + a2) + a3.
  * block_x_reduce: for bw > 32 a shared-memory halving, v[t] += v[t+o] for
    o = bw/2 .. 32; then warp shuffle-down with DECREASING offsets 16, 8, 4, 2, 1
    (torch 2.11 CUDA builds; ROCm/fbcode and older builds go 1 -> 16, kept as
    WARP_INC). Measured on the H200: the kernel's per-row means equal
    `x.float().pow(2).mean(-1)` bit for bit with decreasing offsets, and differ
    on 20-27% of rows with increasing ones.
  * MeanOps::project: mean = sum * factor, factor = float(N) / float(N*D) in
    fp32 on the host (= fl(1/D) whenever N*D is exact); `mean_factor`.
  * `v + eps` one fp32 add; torch.rsqrt is CUDA's `rsqrtf` (rsqrt.approx.f32,
    the instruction Triton's rsqrt emits; the inline-PTX variant RSQRT_ASM gave
    the same bits); `x * r` one fp32 product, rounded to x's dtype.
  Falls back (the plan returns the reason) when D % 4 != 0 (aten's unaligned
  head path), D < 256 (the vectorise threshold differs between versions),
  D > MAX_D, or when aten splits a row across warps or CTAs (values a thread
  >= min(16*bh, 256): D > 8160 for N >= 16), which adds a block_y or global
  reduction whose order changed between versions.

"aten" order (layer_norm_kernel.cu, vectorized_layer_norm_kernel, rms_norm=true;
blocks of (32, 4) threads, one row a block):
  * thread t = 32*warp + lane reads float4 vectors t, t+128, ... into ONE
    accumulator, s = fma(v, v, s) over the 4 values of each vector in order
    (nvcc contracts `sigma2 + val*val`; for bf16/fp16 v*v is exact anyway);
  * warp shuffle-down, offsets 16, 8, 4, 2, 1; across warps through shared
    memory: (w0 + w2) + (w1 + w3);
  * sigma2 / float(D) (IEEE division), rsqrtf(sigma2 + eps), n = rstd * x
    rounded once. Measured: the kernel's rstd equals `_fused_rms_norm`'s bit
    for bit on every row checked.
  Falls back when D % 4 != 0, a contiguous x is not 4-element aligned (aten
  then takes RowwiseMomentsCUDAKernel: another order), D > MAX_D, torch < 2.9.

The kernels write the modulated output with streaming stores (`.cs`: the line
is the first to leave L2; the norm-only output, read again by two modulates,
keeps plain stores): 6144 x 4096 bf16 per-sample on the H200, interleaved with
the same kernel storing plainly, one-pass 26.6 us against 28.2, exact 0.4-1%
faster. (The pointwise ops measured level either way and keep plain stores.)

Exact kernels: pass 1 reads x in the reference's thread order (D is a
compile-time constant, the row is unrolled); pass 2 is elementwise and re-reads
x as wide row tiles (PASS2 = 2; it hits L2), which measured 31.6 us against
43.3 us for keeping x in the reference's 8-byte layout (diffusers, 6144 x 4096
bf16 on the H200; copy floor 23.5 us, eager 421 us; aten 28.4 us, eager 157 us). A side buffer (`stats=`) receives each
row's statistic and rsqrt for the device checks; production launches pass a
dummy and a zero flag (not a specialisation: the checked kernel is the one that
runs).

HIGH MODE (`exact=False`): one pass, x read once, sum of squares in any order
in fp32, then eager's roundings of n, 1 + scale and n*t (HIGH_ROUNDING = 2;
0 = one rounding at the end, 1 = n and t rounded, one FMA). It differs from eager
only where the other summation order moves a row's rsqrt by enough to flip the
rounding of n: 3 elements in 10^6 in bf16, 2 in 10^5 in fp16 (randn rows,
D = 4096, H200), where the result moves by up to 2 ULP at the scale of the
modulate's terms. So it does NOT meet the gate's one-ULP criterion everywhere,
and no one-pass kernel can: any other summation order flips some roundings of n.
One rounding at the end (HIGH_ROUNDING = 0) is 2-3 ULP off on about 1% of
elements (bench/norm_accuracy.py measures all of this). Timings: bench/results/ops-*.json.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from ._pointwise import (
    HAS_TRITON,
    INTERPRET,
    FastLaunch,
    Folded,
    broadcast_strides,
    cdiv,
    common_device_dtype,
    jit,
    layout_class,
    next_pow2,
    rows_of,
    tables_of,
    tl,
    triton,
)
from .modulate import _param, modulate_reference

REFERENCES = ("diffusers", "aten")


def _row_kernel(*names):
    """`triton.jit` without specialising on the row count (one compile for every S)
    or on the debug flag `write_stats` (the checked kernel is the production one)."""
    def wrap(fn):
        return triton.jit(fn, do_not_specialize=list(names)) if HAS_TRITON else fn

    return wrap


MAX_D = 16384  # exact kernels unroll the row; wider rows take the reference

# Reduction-order choices measured on the device (bench/explore_norm.py). The
# launcher reads them at call time so a device script can try the others.
WARP_INC = False  # diffusers mean: warp shuffle offsets decreasing (16..1)
RSQRT_ASM = False  # True: inline `rsqrt.approx.f32`; False: libdevice rsqrt
PASS2 = 2  # exact kernels' second pass: 0 x kept in registers, 1 reload, 2 reload as wide tiles
HIGH_ROUNDING = 2  # high mode's modulate roundings: see _modulate_tail


# ---------------------------------------------------------------- kernels


@jit
def _rsqrt(x, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.math.rsqrt(x)


@jit
def _program_rows(S, R: tl.constexpr):
    """This program's rows: sample b (grid axis 1), positions s in it (axis 0), the flat
    row index b * S + s and the row mask. A flat grid would divide by S before the
    first load (an integer division's latency in every program)."""
    s32 = tl.program_id(0) * R + tl.arange(0, R)
    b = tl.program_id(1).to(tl.int64)
    s = s32.to(tl.int64)
    return b, s, b * S + s, s32 < S


@_row_kernel("S", "write_stats")
def _rms_norm_modulate_exact_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, stats_ptr, scale_table_ptr, shift_table_ptr,
    S, write_stats,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    ct_sd, ht_sd,
    eps, factor, fD,
    D: tl.constexpr,
    REF: tl.constexpr,  # 0: diffusers (MeanOps reduce), 1: aten (_fused_rms_norm)
    LANES: tl.constexpr,  # threads sharing a row in the reference kernel
    XSTEPS: tl.constexpr,  # shared-memory halving steps before the warp tree (diffusers)
    WARP_INC: tl.constexpr,
    PASS2: tl.constexpr,  # 0: x from registers; 1: reload x, same tiles; 2: reload x, full-row tiles
    BLOCK_D: tl.constexpr,
    RSQRT_ASM: tl.constexpr,
    R: tl.constexpr,
    MODULATE: tl.constexpr = True,  # False: write the norm's output n (scale/shift unread)
    SCALE_TABLE: tl.constexpr = False,  # Folded parameters: temb + table row, rounded (modulate._param)
    SHIFT_TABLE: tl.constexpr = False,
):
    NV: tl.constexpr = D // 4
    NJ: tl.constexpr = (NV + LANES - 1) // LANES
    CH: tl.constexpr = 4 * LANES
    b, s, r64, rmask = _program_rows(S, R)
    lane = tl.arange(0, LANES)
    within = (lane * 4)[:, None] + tl.arange(0, 4)[None, :]  # [LANES, 4]
    x_row = b * x_sb + s * x_ss
    c_row = b * c_sb + s * c_ss
    h_row = b * h_sb + s * h_ss
    o_row = r64 * D
    x_base = x_row[:, None, None]
    c_base = c_row[:, None, None]
    h_base = h_row[:, None, None]
    o_base = o_row[:, None, None]
    dtype = out_ptr.dtype.element_ty

    # pass 1: per-thread serial accumulation, in the reference's thread order
    if REF == 0:
        acc = tl.zeros([R, LANES, 4], tl.float32)
    else:
        acc = tl.zeros([R, LANES], tl.float32)
    xs = ()
    for j in tl.static_range(NJ):
        col = (j * CH + within)[None, :, :]
        m = rmask[:, None, None] & ((j * LANES + lane) < NV)[None, :, None]
        xc = tl.load(x_ptr + (x_base + col), mask=m, other=0.0, eviction_policy="evict_last")
        if PASS2 == 0:
            xs = xs + (xc,)
        xf = xc.to(tl.float32)
        if REF == 0:
            acc = acc + xf * xf
        else:
            ev, od = tl.split(tl.reshape(xf, [R, LANES, 2, 2]))
            e0, e2 = tl.split(ev)
            e1, e3 = tl.split(od)
            acc = tl.fma(e0, e0, acc)
            acc = tl.fma(e1, e1, acc)
            acc = tl.fma(e2, e2, acc)
            acc = tl.fma(e3, e3, acc)

    # the reference's combine tree
    if REF == 0:
        ev, od = tl.split(tl.reshape(acc, [R, LANES, 2, 2]))
        a0, a2 = tl.split(ev)
        a1, a3 = tl.split(od)
        v = ((a0 + a1) + a2) + a3  # [R, LANES]
        for i in tl.static_range(XSTEPS):  # shared-memory halving: (t, t + o)
            v = tl.sum(tl.reshape(v, [R, 2, LANES >> (i + 1)]), axis=1)
        for i in tl.static_range(5):  # warp shuffle-down
            if WARP_INC:
                v = tl.sum(tl.reshape(v, [R, 16 >> i, 2]), axis=2)
            else:
                v = tl.sum(tl.reshape(v, [R, 2, 16 >> i]), axis=1)
        total = tl.reshape(v, [R])
        stat = total * factor  # the mean aten's MeanOps writes
        r = _rsqrt(stat + eps, RSQRT_ASM)
    else:
        v = tl.reshape(acc, [R, 4, 32])
        for i in tl.static_range(5):
            v = tl.sum(tl.reshape(v, [R, 4, 2, 16 >> i]), axis=2)
        v = tl.sum(tl.reshape(v, [R, 2, 2]), axis=1)  # (w0 + w2, w1 + w3)
        total = tl.sum(v, axis=1)
        stat = tl.math.div_rn(total, fD)  # sigma2 / N
        r = _rsqrt(stat + eps, RSQRT_ASM)
    # per-row statistics for the device checks (write_stats = 0 in production)
    smask = rmask & (tl.full([R], write_stats, tl.int32) != 0)
    tl.store(stats_ptr + r64 * 2, stat, mask=smask)
    tl.store(stats_ptr + r64 * 2 + 1, r, mask=smask)
    r3 = r[:, None, None]

    # pass 2: normalise, modulate with eager's three roundings, store
    if PASS2 == 2:  # elementwise: any thread may take any element, so wide tiles
        cols = tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (cols < D)[None, :]
        xf = tl.load(x_ptr + (x_row[:, None] + cols[None, :]), mask=m2, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        n = (xf * r[:, None]).to(dtype)
        if MODULATE:
            n = n.to(tl.float32)
            col_ok = cols < D
            scale = _param(scale_ptr, c_row[:, None] + cols[None, :] * c_sd, m2, scale_table_ptr, cols * ct_sd,
                           col_ok, SCALE_TABLE, dtype, False)
            shift = _param(shift_ptr, h_row[:, None] + cols[None, :] * h_sd, m2, shift_table_ptr, cols * ht_sd,
                           col_ok, SHIFT_TABLE, dtype, False)
            t = (1.0 + scale).to(dtype).to(tl.float32)
            p = (n * t).to(dtype).to(tl.float32)
            tl.store(out_ptr + (o_row[:, None] + cols[None, :]), (p + shift).to(dtype), mask=m2, cache_modifier=".cs")
        else:
            tl.store(out_ptr + (o_row[:, None] + cols[None, :]), n, mask=m2)
    else:
        for j in tl.static_range(NJ):
            col = (j * CH + within)[None, :, :]
            m = rmask[:, None, None] & ((j * LANES + lane) < NV)[None, :, None]
            if PASS2 == 0:
                xf = xs[j].to(tl.float32)
            else:
                xf = tl.load(x_ptr + (x_base + col), mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            n = (xf * r3).to(dtype)
            if MODULATE:
                n = n.to(tl.float32)
                zero = c_base * 0  # table offsets broadcast to the [R, LANES, 4] tile
                scale = _param(scale_ptr, c_base + col * c_sd, m, scale_table_ptr, zero + col * ct_sd, m,
                               SCALE_TABLE, dtype, False)
                shift = _param(shift_ptr, h_base + col * h_sd, m, shift_table_ptr, zero + col * ht_sd, m,
                               SHIFT_TABLE, dtype, False)
                t = (1.0 + scale).to(dtype).to(tl.float32)
                p = (n * t).to(dtype).to(tl.float32)
                tl.store(out_ptr + (o_base + col), (p + shift).to(dtype), mask=m, cache_modifier=".cs")
            else:
                tl.store(out_ptr + (o_base + col), n, mask=m)


@_row_kernel("S")
def _rms_norm_modulate_high_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, scale_table_ptr, shift_table_ptr,
    S, D,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    ct_sd, ht_sd,
    eps, inv_d,
    ROUNDING: tl.constexpr,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_TABLE: tl.constexpr = False,
    SHIFT_TABLE: tl.constexpr = False,
):
    b, s, r64, rmask = _program_rows(S, R)
    cols = tl.arange(0, BLOCK_D)
    m = rmask[:, None] & (cols < D)[None, :]
    x = tl.load(
        x_ptr + ((b * x_sb + s * x_ss)[:, None] + cols[None, :]), mask=m, other=0.0,
        eviction_policy="evict_first",
    ).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)
    dtype = out_ptr.dtype.element_ty
    col_ok = cols < D
    scale = _param(scale_ptr, (b * c_sb + s * c_ss)[:, None] + cols[None, :] * c_sd, m, scale_table_ptr,
                   cols * ct_sd, col_ok, SCALE_TABLE, dtype, False)
    shift = _param(shift_ptr, (b * h_sb + s * h_ss)[:, None] + cols[None, :] * h_sd, m, shift_table_ptr,
                   cols * ht_sd, col_ok, SHIFT_TABLE, dtype, False)
    y = _modulate_tail(x * r[:, None], scale, shift, dtype, ROUNDING)
    tl.store(out_ptr + ((r64 * D)[:, None] + cols[None, :]), y, mask=m, cache_modifier=".cs")


@jit
def _modulate_tail(n, scale, shift, dtype: tl.constexpr, ROUNDING: tl.constexpr):
    """n * (1 + scale) + shift for the one-pass kernels. They launch with FMA
    contraction off: LLVM narrows a product or sum of two rounded operands that is
    rounded again to one bf16/fp16 instruction (exact: fp32 holds twice their
    precision), and with contraction on it fuses the narrowed n * t and + shift
    into one half-precision FMA, dropping a rounding (29% of elements changed on
    the H200; the interpreter does not narrow). ROUNDING 0: fp32 throughout, one rounding at the end.
    1: eager's roundings of the norm's output n and of 1 + scale, then one FMA
    (2-3 ULP from eager at the scale of the terms: bench/results/norm-accuracy-*).
    2: all of eager's roundings (only the reduction order differs from eager)."""
    scale = scale.to(tl.float32)
    shift = shift.to(tl.float32)
    if ROUNDING == 0:
        y = n * (1.0 + scale) + shift
    else:
        n = n.to(dtype).to(tl.float32)
        t = (1.0 + scale).to(dtype).to(tl.float32)
        if ROUNDING == 1:
            y = tl.fma(n, t, shift)
        else:
            y = (n * t).to(dtype).to(tl.float32) + shift
    return y.to(dtype)


_launch_exact = FastLaunch(_rms_norm_modulate_exact_kernel)
_launch_high = FastLaunch(_rms_norm_modulate_high_kernel)


# ---------------------------------------------------------------- launcher


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@functools.lru_cache(maxsize=4096)
def mean_reduce_config(D: int, N: int) -> tuple[int, str | None]:
    """aten's setReduceConfig for `mean(-1)` of a contiguous fp32 [N, D] tensor
    (vt0 = input_vec_size = 4, 512 threads, 32-lane warps): the block width
    (threads sharing a row) and None, or 0 and why its order is not reproduced."""
    if D % 4:
        return 0, f"D={D} is not a multiple of 4 (aten's unaligned-head path)"
    if D < 256:
        return 0, f"D={D} < 256 (aten's vectorise threshold differs between versions)"
    max_threads = 512
    dim0 = D // 4
    dim0_p2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_p2 = _last_pow2(N) if N < max_threads else max_threads
    bw = min(dim0_p2, 32)
    bh = min(dim1_p2, max_threads // bw)
    bw = min(dim0_p2, max_threads // bh)
    values_per_thread = cdiv(D, bw)
    if values_per_thread >= min(bh * 16, 256):
        if bh > 1 or values_per_thread >= 256:
            return 0, (
                f"aten splits rows of D={D} (N={N}) across warps or CTAs "
                f"(block {bw}x{bh}, {values_per_thread} values a thread): order not reproduced"
            )
    return bw, None


@functools.lru_cache(maxsize=4096)
def mean_factor(N: int, D: int) -> float:
    """MeanOps' factor: float(num_outputs) / numel, in fp32 as on the host."""
    return float(np.float32(N) / np.float32(N * D))


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


_FUSED_RMS_NORM = _torch_at_least(2, 9)


class RMSNormModulatePlan:
    """A call that passed the guard: operands, geometry, reduction order, gate key."""

    __slots__ = ("x", "scale", "shift", "rows", "c_strides", "h_strides", "eps", "reference",
                 "lanes", "factor", "key", "modulate", "scale_table", "shift_table")

    def __init__(self, x, scale, shift, rows, c_strides, h_strides, eps, reference, lanes, factor, key,
                 modulate=True):
        self.x, self.scale, self.shift = x, scale, shift
        self.rows, self.c_strides, self.h_strides = rows, c_strides, h_strides
        self.eps, self.reference = eps, reference
        self.lanes, self.factor, self.key = lanes, factor, key
        self.modulate = modulate  # False: the norm alone (plan_rms_norm)
        self.scale_table = self.shift_table = None  # Folded parameters: table rows added on the fly


def _check_operands(x, scale, shift, *, cpu_ok=False):
    """Shared guard: (rows, c_strides, h_strides) or a reason string."""
    if not HAS_TRITON:
        return "triton is not installed"
    if scale.__class__ is Folded or shift.__class__ is Folded:
        return "folded parameters are unpacked by _plan"
    why = common_device_dtype(x, scale, shift)
    if why and not (cpu_ok and why == "CPU tensor"):
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


def plan_rms_norm_modulate(x, scale, shift, eps, reference, exact: bool = True):
    """The guard: a plan for the kernel, or the reason the call takes the reference."""
    return _plan(x, scale, shift, eps, reference, exact)


def plan_rms_norm(x, eps, reference):
    """The guard for the norm alone, `rms_norm_reference(x, eps, reference)` bit for bit
    (the exact kernel without its modulate: for a normed tensor modulated twice)."""
    plan = _plan(x, x, x, eps, reference, True)  # scale/shift: placeholders, never read
    if plan.__class__ is str:
        return plan
    plan.modulate = False
    plan.key = (x.dtype, x.get_device(), reference, f"D={x.shape[-1]}", f"lanes={plan.lanes}")
    return plan


def _plan(x, scale, shift, eps, reference, exact, cpu_ok=False):
    if reference not in REFERENCES:
        return f"unknown RMSNorm reference {reference!r}"
    unpacked = tables_of(scale, shift, x)
    if unpacked.__class__ is str:
        return unpacked
    scale, shift, scale_table, shift_table = unpacked
    checked = _check_operands(x, scale, shift, cpu_ok=cpu_ok)
    if isinstance(checked, str):
        return checked
    rows, c, h = checked
    D, N = rows.D, rows.B * rows.S
    lanes, factor = 128, 0.0
    if exact:
        if D > MAX_D:
            return f"D={D} > {MAX_D}: row too wide for the register-resident exact kernel"
        if reference == "diffusers":
            lanes, why = mean_reduce_config(D, N)
            if why:
                return why
            factor = mean_factor(N, D)
        else:
            if D % 4:
                return f"D={D} is not a multiple of 4 (aten takes RowwiseMomentsCUDAKernel)"
            if x.is_contiguous() and x.data_ptr() % (4 * x.element_size()):
                return "x is not 4-element aligned (aten takes RowwiseMomentsCUDAKernel)"
            if not _FUSED_RMS_NORM:
                return "torch < 2.9 runs F.rms_norm as composite ops"
    elif D > MAX_D:
        return f"D={D} > {MAX_D}: row too wide for the one-pass kernel"
    key = (x.dtype, x.get_device(), layout_class(c, scale) + ("+table" if scale_table is not None else ""),
           layout_class(h, shift) + ("+table" if shift_table is not None else ""),
           reference, f"D={D}", f"lanes={lanes}")
    plan = RMSNormModulatePlan(x, scale, shift, rows, c, h, float(eps), reference, lanes, factor, key)
    plan.scale_table, plan.shift_table = scale_table, shift_table
    return plan


def exact_launch_shape(plan, elem_bytes: int) -> tuple[int, int]:
    """(R, num_warps) for the exact kernel: rows per program and warps (the reduction
    order does not depend on them). Measured on the H200 at 6144 x 4096 bf16, timed
    interleaved: diffusers per-sample (2, 4) 29.4 us against 31.1 for (1, 2) and
    33.4 for (2, 2); per-token (1, 2) 50.1-50.9 us against 50.5-51.2 for (2, 8) and
    52.0-52.8 for (4, 8) (two runs, bench/NOTES.md); aten (2, 8) 28.4 us."""
    if plan.reference == "aten":
        return 2, 8
    if plan.lanes == 32:
        per_token = plan.c_strides[1] != 0 or plan.h_strides[1] != 0
        return (1, 2) if per_token else (2, 4)
    return 1, min(plan.lanes // 32, 8)  # few rows: wide blocks


def _dummy_stats(x):
    """A placeholder fp32 pointer for the exact kernels' stats output (not written)."""
    d = _DUMMY.get(x.get_device())
    if d is None:
        d = _DUMMY[x.get_device()] = torch.empty(2, dtype=torch.float32, device=x.device)
    return d


_DUMMY: dict = {}


def launch_rms_norm_modulate(plan, exact: bool = True, config=None, out=None, stats=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (R, num_warps, pass2) in exact mode, (R, num_warps) in high mode.
    `stats` (fp32, 2 per row; exact mode): receives each row's statistic (diffusers:
    the mean; aten: sigma2 / D) and its rsqrt, for checks against aten's."""
    x, r = plan.x, plan.rows
    if not (exact or plan.modulate):
        raise ValueError("a norm-only plan (plan_rms_norm) runs the exact kernel")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tensors = (x, plan.scale, plan.shift, out)
    ct, ht = plan.scale_table, plan.shift_table
    tables = (plan.scale if ct is None else ct, plan.shift if ht is None else ht)
    table_strides = (0 if ct is None else ct.stride(0), 0 if ht is None else ht.stride(0))
    folded = dict(SCALE_TABLE=ct is not None, SHIFT_TABLE=ht is not None)
    if exact:
        if config:
            R, num_warps, pass2 = (tuple(config) + (PASS2,))[:3]
        else:
            (R, num_warps), pass2 = exact_launch_shape(plan, x.element_size()), PASS2
        lanes = plan.lanes
        _launch_exact(
            (cdiv(r.S, R), r.B), tensors + (_dummy_stats(x) if stats is None else stats,) + tables,
            (r.S, int(stats is not None), r.sb, r.ss, *plan.c_strides, *plan.h_strides, *table_strides,
             plan.eps, plan.factor, float(r.D)),
            dict(D=r.D, REF=0 if plan.reference == "diffusers" else 1,
                 LANES=lanes, XSTEPS=max(lanes.bit_length() - 1 - 5, 0),
                 WARP_INC=WARP_INC, PASS2=pass2, BLOCK_D=next_pow2(r.D),
                 RSQRT_ASM=RSQRT_ASM and not INTERPRET, R=R, MODULATE=plan.modulate, **folded),
            dict(num_warps=num_warps, enable_fp_fusion=False),
        )
    else:
        block_d = next_pow2(r.D)
        R, num_warps = config or high_launch_shape(block_d, r.S, x.element_size())
        _launch_high(
            (cdiv(r.S, R), r.B), tensors + tables,
            (r.S, r.D, r.sb, r.ss, *plan.c_strides, *plan.h_strides, *table_strides, plan.eps, 1.0 / r.D),
            dict(ROUNDING=HIGH_ROUNDING, R=R, BLOCK_D=block_d, **folded),
            dict(num_warps=num_warps, enable_fp_fusion=False),  # see _modulate_tail
        )
    return out


def high_launch_shape(block_d: int, S: int, elem_bytes: int) -> tuple[int, int]:
    """(R, num_warps) for the one-pass kernels. 16-bit rows of 2048, 4096 or 8192
    padded columns: one row on 4, 8 or 4 warps (H200, 6144 rows, per-sample, timed
    interleaved: D = 2048 13.95 us against 14.59 for two rows on 4 warps; D = 4096
    28.24 against 28.48 for 4 warps; D = 5120 35.83 against 37.94 for 8 warps).
    Otherwise about 8 KiB of x a program, at most the S rows of a sample."""
    if elem_bytes == 2 and block_d in _HIGH_WARPS:
        return 1, _HIGH_WARPS[block_d]
    R = max(1, min(8192 // (block_d * elem_bytes), next_pow2(S)))
    num_warps = max(1, min(8, R * block_d * elem_bytes // 2048))
    return R, num_warps


_HIGH_WARPS = {2048: 4, 4096: 8, 8192: 4}


def rms_norm_modulate(x, scale, shift, eps: float, reference: str, *, exact: bool = True) -> torch.Tensor:
    """Guarded, ungated: the kernel where eligible, else the eager reference."""
    plan = plan_rms_norm_modulate(x, scale, shift, eps, reference, exact)
    if isinstance(plan, str):
        return rms_norm_modulate_reference(x, scale, shift, eps, reference)
    return launch_rms_norm_modulate(plan, exact)


# ---------------------------------------------------------------- torch.library


@torch.library.custom_op("bitfuse::rms_norm_modulate", mutates_args=())
def rms_norm_modulate_op(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, reference: str
) -> torch.Tensor:
    """Opaque op for torch.compile graphs and capture (exact mode; eager callers
    launch directly: this boundary costs tens of microseconds a call)."""
    return rms_norm_modulate(x, scale, shift, eps, reference)


@rms_norm_modulate_op.register_fake
def _(x, scale, shift, eps, reference):
    return rms_norm_modulate_reference(x, scale, shift, eps, reference)


# ---------------------------------------------------------------- reference


def rms_norm_reference(x, eps: float, reference: str) -> torch.Tensor:
    """The norm as the models write it: diffusers' RMSNorm, or aten's F.rms_norm."""
    if reference == "aten":
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_modulate_reference(x, scale, shift, eps: float, reference: str) -> torch.Tensor:
    return modulate_reference(rms_norm_reference(x, eps, reference), scale, shift)
