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

HIGH TIER (`tier="high"`, bf16/fp16): one pass, x read once, the sum of
squares in any order in fp32, then n * (1 + scale) + shift in fp32, rounded
once. Against the float64 value of the same expression it is within 0.5 ULP
(at the scale of the modulate's largest term; eager's three roundings are up to
3 ULP off, 0.39 on average): more accurate than eager, and so not bit-equal
to it (bench/norm_accuracy.py measures both against float64; the gate checks
the contract at first sight, `policy.gated`).

Shapes: x [B, S, D] or [N, D] with a contiguous last dimension; scale, shift as
for modulate (any broadcast layout, or Folded); one dtype. Output: a new
contiguous tensor of x's shape and dtype.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from . import cases
from ._launch import (
    INTERPRET,
    FastLaunch,
    Output,
    Recipe,
    cdiv,
    next_pow2,
    register_op,
    row_kernel,
    tl,
)
from ._norm import (
    MAX_D,
    check_operands,
    dummy_stats,
    high_launch_shape,
    modulate_once,
    modulated64,
    modulated_terms64,
    overflow_scale,
    program_rows,
    rms_norm64,
    rsqrt,
)
from ._params import bound_param_launch, layout_class, load_param, tables_of
from .modulate import modulate_reference
from .spec import OpSpec

REFERENCES = ("diffusers", "aten")

# Reduction-order choices, measured on the H200 (bench/NOTES.md, "Norm kernels"):
WARP_INC = False  # diffusers mean: warp shuffle offsets decreasing (16..1), as torch 2.11's CUDA builds
RSQRT_ASM = False  # libdevice rsqrt (the inline `rsqrt.approx.f32` gave the same bits)
PASS2 = 2  # exact kernels' second pass: 0 x kept in registers, 1 reload, 2 reload as wide tiles (fastest)


# ---------------------------------------------------------------- kernels


@row_kernel("S", "write_stats")
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
    SCALE_TABLE: tl.constexpr = False,  # Folded parameters: temb + table row, rounded (load_param)
    SHIFT_TABLE: tl.constexpr = False,
):
    NV: tl.constexpr = D // 4
    NJ: tl.constexpr = (NV + LANES - 1) // LANES
    CH: tl.constexpr = 4 * LANES
    b, s, r64, rmask = program_rows(S, R)
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
        r = rsqrt(stat + eps, RSQRT_ASM)
    else:
        v = tl.reshape(acc, [R, 4, 32])
        for i in tl.static_range(5):
            v = tl.sum(tl.reshape(v, [R, 4, 2, 16 >> i]), axis=2)
        v = tl.sum(tl.reshape(v, [R, 2, 2]), axis=1)  # (w0 + w2, w1 + w3)
        total = tl.sum(v, axis=1)
        stat = tl.math.div_rn(total, fD)  # sigma2 / N
        r = rsqrt(stat + eps, RSQRT_ASM)
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
            scale = load_param(scale_ptr, c_row[:, None] + cols[None, :] * c_sd, m2, scale_table_ptr, cols * ct_sd,
                           col_ok, SCALE_TABLE, dtype, False)
            shift = load_param(shift_ptr, h_row[:, None] + cols[None, :] * h_sd, m2, shift_table_ptr, cols * ht_sd,
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
                scale = load_param(scale_ptr, c_base + col * c_sd, m, scale_table_ptr, zero + col * ct_sd, m,
                               SCALE_TABLE, dtype, False)
                shift = load_param(shift_ptr, h_base + col * h_sd, m, shift_table_ptr, zero + col * ht_sd, m,
                               SHIFT_TABLE, dtype, False)
                t = (1.0 + scale).to(dtype).to(tl.float32)
                p = (n * t).to(dtype).to(tl.float32)
                tl.store(out_ptr + (o_base + col), (p + shift).to(dtype), mask=m, cache_modifier=".cs")
            else:
                tl.store(out_ptr + (o_base + col), n, mask=m)


@row_kernel("S")
def _rms_norm_modulate_high_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, scale_table_ptr, shift_table_ptr,
    S, D,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    ct_sd, ht_sd,
    eps, inv_d,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_TABLE: tl.constexpr = False,
    SHIFT_TABLE: tl.constexpr = False,
    EVEN: tl.constexpr = False,  # D == BLOCK_D and S % R == 0: no masks
):
    b, s, r64, rmask = program_rows(S, R)
    cols = tl.arange(0, BLOCK_D)
    x_off = (b * x_sb + s * x_ss)[:, None] + cols[None, :]
    if EVEN:
        m = None
        col_ok = None
        x = tl.load(x_ptr + x_off, eviction_policy="evict_first").to(tl.float32)
    else:
        m = rmask[:, None] & (cols < D)[None, :]
        col_ok = cols < D
        x = tl.load(x_ptr + x_off, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    sc = tl.full(ss.shape, 1.0, tl.float32)
    if tl.max(ss, axis=0) > 3.0e38:  # some row's squares overflowed: rescale those rows exactly
        sc = overflow_scale(x)
        xs = x * sc[:, None]
        ss = tl.sum(xs * xs, axis=1)
    r = tl.math.rsqrt(ss * inv_d + eps * sc * sc) * sc  # 1 / rms(x), exactly rescaled
    dtype = out_ptr.dtype.element_ty
    scale = load_param(scale_ptr, (b * c_sb + s * c_ss)[:, None] + cols[None, :] * c_sd, m, scale_table_ptr,
                       cols * ct_sd, col_ok, SCALE_TABLE, dtype, False)
    shift = load_param(shift_ptr, (b * h_sb + s * h_ss)[:, None] + cols[None, :] * h_sd, m, shift_table_ptr,
                       cols * ht_sd, col_ok, SHIFT_TABLE, dtype, False)
    y = modulate_once(x * r[:, None], scale, shift, dtype)
    tl.store(out_ptr + ((r64 * D)[:, None] + cols[None, :]), y, mask=m, cache_modifier=".cs")


_launch_exact = FastLaunch(_rms_norm_modulate_exact_kernel, (
    "D", "REF", "LANES", "XSTEPS", "WARP_INC", "PASS2", "BLOCK_D", "RSQRT_ASM", "R", "MODULATE", "SCALE_TABLE",
    "SHIFT_TABLE"))
_launch_high = FastLaunch(_rms_norm_modulate_high_kernel, ("R", "BLOCK_D", "SCALE_TABLE", "SHIFT_TABLE", "EVEN"))


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


class RMSNormModulatePlan:
    """A call that passed the guard: operands, geometry, reduction order, gate key."""

    __slots__ = ("x", "scale", "shift", "rows", "c_strides", "h_strides", "eps", "reference",
                 "lanes", "factor", "key", "exact", "modulate", "scale_table", "shift_table")

    def __init__(self, x, scale, shift, rows, c_strides, h_strides, eps, reference, lanes, factor, key, exact,
                 scale_table=None, shift_table=None):
        self.x, self.scale, self.shift = x, scale, shift
        self.rows, self.c_strides, self.h_strides = rows, c_strides, h_strides
        self.eps, self.reference = eps, reference
        self.lanes, self.factor, self.key = lanes, factor, key
        self.exact = exact  # the lossless kernel (the reference's order), or the one-pass high kernel
        self.modulate = True  # False: the norm alone (plan_rms_norm)
        self.scale_table, self.shift_table = scale_table, shift_table  # Folded: table rows added on the fly


def plan_rms_norm_modulate(x, scale, shift, eps, reference, tier: str = "lossless"):
    """The guard: a plan for the kernel of `tier` ("lossless": the reference's own
    reduction order, bit-exact; "high": one pass, one rounding; the sites send fp32
    to the lossless kernel), or the reason the call takes the reference."""
    if reference not in REFERENCES:
        return f"unknown RMSNorm reference {reference!r}"
    unpacked = tables_of(scale, shift, x)
    if unpacked.__class__ is str:
        return unpacked
    scale, shift, scale_table, shift_table = unpacked
    checked = check_operands(x, scale, shift)
    if checked.__class__ is str:
        return checked
    rows, c, h = checked
    D, N = rows.D, rows.B * rows.S
    if D > MAX_D:
        return f"D={D} > {MAX_D}: row too wide for the register-resident kernels"
    exact = tier != "high"
    lanes, factor = 128, 0.0
    if exact:
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
    key = (x.dtype, x.get_device(), layout_class(c, scale) + ("+table" if scale_table is not None else ""),
           layout_class(h, shift) + ("+table" if shift_table is not None else ""),
           reference, f"D={D}", f"lanes={lanes}" if exact else "one-pass")
    return RMSNormModulatePlan(x, scale, shift, rows, c, h, float(eps), reference, lanes, factor, key, exact,
                               scale_table, shift_table)


def plan_rms_norm(x, eps, reference, tier: str = "lossless"):
    """The guard for the norm alone, `rms_norm_reference(x, eps, reference)` bit for bit
    (the exact kernel without its modulate: for a normed tensor modulated twice)."""
    plan = plan_rms_norm_modulate(x, x, x, eps, reference)  # scale/shift: placeholders, never read
    if plan.__class__ is str:
        return plan
    plan.modulate = False
    plan.key = (x.dtype, x.get_device(), reference, f"D={x.shape[-1]}", f"lanes={plan.lanes}")
    return plan


def exact_launch_shape(plan) -> tuple[int, int]:
    """(R, num_warps) for the exact kernel: rows per program and warps (the reduction
    order does not depend on them; measured on the H200, bench/NOTES.md "Norm launch
    shapes")."""
    if plan.reference == "aten":
        return 2, 8
    if plan.lanes == 32:
        per_token = plan.c_strides[1] != 0 or plan.h_strides[1] != 0
        return (1, 2) if per_token else (2, 4)
    return 1, min(plan.lanes // 32, 8)  # few rows: wide blocks


#: warps a 16-bit row of the high kernel takes, by padded width (bench/NOTES.md, "Norm launch shapes")
_HIGH_WARPS = {2048: 4, 4096: 8, 8192: 4}


def _recipe_of(plan, config=None, stats=None) -> Recipe:
    """The launch of a guarded plan: the kernel's grid, integers, constexprs and warps."""
    r, ct, ht = plan.rows, plan.scale_table, plan.shift_table
    table_strides = (0 if ct is None else ct.stride(0), 0 if ht is None else ht.stride(0))
    if plan.exact:
        R, num_warps, pass2 = (tuple(config) + (PASS2,))[:3] if config else exact_launch_shape(plan) + (PASS2,)
        lanes = plan.lanes
        return Recipe(
            (cdiv(r.S, R), r.B),
            (r.S, int(stats is not None), r.sb, r.ss, *plan.c_strides, *plan.h_strides, *table_strides,
             plan.eps, plan.factor, float(r.D)),
            (r.D, 0 if plan.reference == "diffusers" else 1, lanes, max(lanes.bit_length() - 1 - 5, 0), WARP_INC,
             pass2, next_pow2(r.D), RSQRT_ASM and not INTERPRET, R, plan.modulate, ct is not None, ht is not None),
            num_warps,
        )
    block_d = next_pow2(r.D)
    R, num_warps = config or high_launch_shape(block_d, r.S, plan.x.element_size(), _HIGH_WARPS)
    return Recipe(
        (cdiv(r.S, R), r.B),
        (r.S, r.D, r.sb, r.ss, *plan.c_strides, *plan.h_strides, *table_strides, plan.eps, 1.0 / r.D),
        (R, block_d, ct is not None, ht is not None, block_d == r.D and r.S % R == 0),
        num_warps,  # FMA contraction off (FastLaunch's default): see _norm.modulate_once
    )


def _operands(exact: bool, x, scale, shift, out, ct, ht, stats=None) -> tuple:
    tables = (scale if ct is None else ct, shift if ht is None else ht)
    if exact:
        return (x, scale, shift, out, dummy_stats(x) if stats is None else stats) + tables
    return (x, scale, shift, out) + tables


def launch_rms_norm_modulate(plan, out=None, config=None, stats=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (R, num_warps[, pass2]) of the exact kernel, (R, num_warps) of
    the one-pass kernel. `stats` (fp32, 2 per row; exact kernel): receives each row's
    statistic (diffusers: the mean; aten: sigma2 / D) and its rsqrt, for checks
    against aten's."""
    x = plan.x
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch = _launch_exact if plan.exact else _launch_high
    launch.launch(_recipe_of(plan, config, stats),
                  _operands(plan.exact, x, plan.scale, plan.shift, out, plan.scale_table, plan.shift_table, stats))
    return out


def bind_rms_norm_modulate(plan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(x, scale, shift, eps,
    reference)` for a call with the plan's shapes, strides, dtypes, devices, eps and
    reference; None where x misses the alignment the guard requires."""
    recipe, launch = _recipe_of(plan), (_launch_exact if plan.exact else _launch_high).launch
    x = plan.x
    checks = ((0, 4 * x.element_size()),) if plan.exact and plan.reference == "aten" and x.is_contiguous() else ()
    return bound_param_launch(launch, recipe, functools.partial(_operands, plan.exact), plan.scale_table is not None,
                              plan.shift_table is not None, Output.contiguous_like(x), checks)


def bind_rms_norm(plan):
    """The launch of a `plan_rms_norm` plan bound to its geometry (`OpSpec.bind`):
    `run(x, eps, reference)` for a call with the plan's shape, strides, dtype, device,
    eps and reference; None where x misses the alignment the guard requires."""
    recipe, launch = _recipe_of(plan), _launch_exact.launch
    align = 4 * plan.x.element_size() if plan.reference == "aten" and plan.x.is_contiguous() else 0
    output = Output.contiguous_like(plan.x)

    def run(x, eps, reference):
        if align and x.data_ptr() % align:
            return None
        out = output()
        launch(recipe, _operands(True, x, x, x, out, None, None))
        return out

    return run


def rms_norm_modulate(x, scale, shift, eps: float, reference: str, *, tier: str = "lossless") -> torch.Tensor:
    """`rms_norm(x) * (1 + scale) + shift`, guarded but ungated: the kernel of `tier`
    where eligible, else the eager reference."""
    plan = plan_rms_norm_modulate(x, scale, shift, eps, reference, tier)
    if plan.__class__ is str:
        return rms_norm_modulate_reference(x, scale, shift, eps, reference)
    return launch_rms_norm_modulate(plan)


# ---------------------------------------------------------------- reference


def rms_norm_reference(x, eps: float, reference: str) -> torch.Tensor:
    """The norm as the models write it: diffusers' RMSNorm, or aten's F.rms_norm."""
    if reference == "aten":
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_modulate_reference(x, scale, shift, eps: float, reference: str) -> torch.Tensor:
    """The eager expression: the norm, then `n * (1 + scale) + shift` (three roundings)."""
    return modulate_reference(rms_norm_reference(x, eps, reference), scale, shift)


def _reference64(x, scale, shift, eps, reference):
    return modulated64(rms_norm64(x, eps), scale, shift)


def _terms(x, scale, shift, eps, reference):
    return modulated_terms64(rms_norm64(x, eps), scale, shift)


def _make_args(case: cases.Case, reference: str) -> tuple:
    gen = case.generator()
    x = cases.activation(case, gen)
    scale, shift = cases.param(case, gen, 2)
    return x, scale, shift, 1e-6, reference


def _spec(reference: str) -> OpSpec:
    return OpSpec(
        name=f"rms_norm_modulate[{reference}]",
        reference=rms_norm_modulate_reference,
        plan=plan_rms_norm_modulate,
        launch={"lossless": launch_rms_norm_modulate, "high": launch_rms_norm_modulate},
        tiers=("lossless", "high"),
        bind={"lossless": bind_rms_norm_modulate, "high": bind_rms_norm_modulate},
        reference64=_reference64,
        terms=_terms,
        make_args=functools.partial(_make_args, reference=reference),
        layouts=cases.PARAM_LAYOUTS,
    )


SPECS = {reference: _spec(reference) for reference in REFERENCES}

RMS_NORM_SPEC = OpSpec(
    name="rms_norm",
    reference=rms_norm_reference,
    plan=plan_rms_norm,
    launch={"lossless": launch_rms_norm_modulate},
    bind={"lossless": bind_rms_norm},
    make_args=lambda case: (cases.activation(case, case.generator()), 1e-6, "diffusers"),
    layouts=("none",),
)


# ---------------------------------------------------------------- torch.library


def _rms_norm_modulate_op(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, reference: str
) -> torch.Tensor:
    return rms_norm_modulate(x, scale, shift, eps, reference)


rms_norm_modulate_op = register_op("rms_norm_modulate", _rms_norm_modulate_op, rms_norm_modulate_reference)
