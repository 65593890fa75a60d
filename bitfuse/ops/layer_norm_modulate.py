"""Weightless LayerNorm + adaLN modulation: `layer_norm(x) * (1 + scale) + shift`.

The reference is `F.layer_norm(x, (D,), eps=eps)` without weight or bias
(`nn.LayerNorm(elementwise_affine=False)`, the final norm of LTX-2), then
eager's modulate with its three roundings.

EXACT MODE reproduces aten's `vectorized_layer_norm_kernel`
(aten/src/ATen/native/cuda/layer_norm_kernel.cu), which aten takes when
D % 4 == 0, D <= 2^24 and x (after `.contiguous()`) is 4-element aligned:
  * one row a block of 128 threads (32 lanes x 4 warps); thread
    t = 32*warp + lane reads float4 vectors t, t+128, t+256, ... and runs
    Welford serially over the 4 values of each vector in order:
        delta = v - mean; count += 1
        mean  = fma(delta, 1/count, mean)        (1/count: IEEE division)
        m2    = fma(delta, v - mean_new, m2)
  * warp shuffle-down, offsets 16, 8, 4, 2, 1, each step
    cuWelfordCombine(B = own, A = other):
        delta = B.mean - A.mean; count = A.count + B.count; coef = 1/count
        nA = A.count*coef; nB = B.count*coef
        mean  = fma(nA, A.mean, nB*B.mean)
        m2    = fma((delta*delta)*A.count, nB, A.m2 + B.m2)
        count == 0 -> mean = m2 = 0;
  * across warps through shared memory: w0 <- (w0, w2), w1 <- (w1, w3), then
    w0 <- (w0, w1), as combine(B = lower, A = upper);
  * var = m2 / float(D) (IEEE), rstd = rsqrtf(var + eps),
    n = rstd * (x - mean), rounded once to x's dtype.
Which products nvcc contracts into FMAs is a property of the build, so they are
selectable (WELFORD_FMA, MEAN_V, SIG_FMA). Measured on the H200 with torch 2.11,
comparing the kernel's per-row mean and rstd with `native_layer_norm`'s bit for
bit: without the Welford FMAs outputs differ; of the six combine variants only
(MEAN_V = 0, SIG_FMA) matches for D = 1000 (counts not powers of two; for D a
multiple of 512 every count is a power of two and all six agree).

Falls back (the plan returns the reason) when D % 4 != 0 or a contiguous x is
not aligned (aten then takes RowwiseMomentsCUDAKernel + LayerNormForwardCUDAKernel,
a block-reduce Welford with other roundings), or D > MAX_D.

Pass 1 runs in aten's thread order; pass 2 is elementwise and re-reads x as
wide row tiles (PASS2 = 2). When every thread holds the same number of vectors
(D % 512 == 0), the tree's counts are compile-time constants: the same values
without the divisions, count shuffles and tests (a quarter of the kernel's
instructions; timings in bench/results/ops-*.json).
Both kernels write their output with streaming stores, as rms_norm_modulate's do.

HIGH TIER (bf16/fp16): one pass, x read once; the row's sum and sum of squares
in float64, in one reduction (`moments`: the mean as two fp32 terms, the variance
without overflow), x - mean in fp32, then n * (1 + scale) + shift in fp32, rounded
once: within 0.5 ULP of the float64 value at the scale of the modulate's terms (see
rms_norm_modulate). A row is held as 2-7 power-of-two tiles where they hold fewer
lanes than one padded tile (3072 = 3 x 1024, 5120 = 5 x 1024, 6144 = 3 x 2048, all
unmasked; 2240 = 5 x 512, the last tile masked), their float64 terms added
elementwise before the one reduction (`high_tiles`): a padded lane costs the
float64 work of a real one.

Shapes: x [B, S, D] or [N, D] with a contiguous last dimension; scale, shift as
for modulate (tensors broadcasting to x, or Folded: a [D] table row plus a temb
view, added in the kernel with eager's rounding, as rms_norm_modulate's); one
dtype. Output: a new contiguous tensor of x's shape and dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import cases
from ._launch import (
    HAS_TRITON,
    INTERPRET,
    FastLaunch,
    Output,
    Recipe,
    cdiv,
    jit,
    next_pow2,
    register_op,
    row_kernel,
    tl,
)
from ._norm import (
    MAX_D,
    check_operands,
    device_family,
    dummy_stats,
    high_launch_shape,
    layer_norm64,
    modulate_once,
    modulated64,
    modulated_terms64,
    program_rows,
    rsqrt,
)
from ._params import (
    Folded,
    bound_param_launch,
    broadcast_strides,
    common_device_dtype,
    layout_class,
    load_param,
    rows_of,
    table_of,
    tables_of,
    value32,
)
from .modulate import modulate_reference
from .spec import OpSpec

# FMA contractions of aten's nvcc build (measured on the H200: bench/NOTES.md, "Norm kernels")
WELFORD_FMA = True  # per-thread Welford update: two FMAs
MEAN_V = 0  # combine mean: 0 fma(nA, mA, nB*mB), 1 fma(nB, mB, nA*mA), 2 no FMA
SIG_FMA = True  # combine m2: fma((d*d)*cA, nB, sA + sB)
RSQRT_ASM = False
PASS2 = 2  # second pass: 0 x kept in registers, 1 reload, 2 reload as wide tiles

LANES = 128  # aten's num_threads(): 4 warps of 32


# ---------------------------------------------------------------- kernels


@jit
def _welford_step(v, mean, m2, valid, c_new: tl.constexpr, WELFORD_FMA: tl.constexpr, FULL: tl.constexpr):
    """cuWelfordOnlineSum for the threads that hold this vector (all, if FULL);
    c_new: their count after this value (the same for all of them, known at
    compile time). aten divides 1 / count at run time (IEEE); the constant here is
    the same fp32 value: float32(1.0 / n), rounded from the double, equals the
    correctly rounded fp32 quotient for every n < 2**16 (checked with numpy)."""
    rcp = tl.full([], 1.0 / c_new, tl.float32)
    delta = v - mean
    if WELFORD_FMA:
        nm = tl.fma(delta, rcp, mean)
        nm2 = tl.fma(delta, v - nm, m2)
    else:
        nm = mean + delta * rcp
        nm2 = m2 + delta * (v - nm)
    if FULL:
        return nm, nm2
    else:
        return tl.where(valid, nm, mean), tl.where(valid, nm2, m2)


@jit
def _welford_combine(mB, sB, cB, mA, sA, cA, MEAN_V: tl.constexpr, SIG_FMA: tl.constexpr, RCP: tl.constexpr):
    """cuWelfordCombine(B, A). RCP > 0: both counts are the same compile-time
    constant C (scalars cB = cA), and RCP = 1 / (2C) as a double, which rounds to
    the fp32 quotient aten divides at run time (2C < 2**16, as in _welford_step):
    the same values, without the division and the count > 0 test."""
    delta = mB - mA
    count = cA + cB
    if RCP > 0:
        coef = tl.full([], RCP, tl.float32)
    else:
        coef = tl.math.div_rn(tl.full(count.shape, 1.0, tl.float32), count)
    nA = cA * coef
    nB = cB * coef
    if MEAN_V == 0:
        mean = tl.fma(nA, mA, nB * mB)
    elif MEAN_V == 1:
        mean = tl.fma(nB, mB, nA * mA)
    else:
        mean = nA * mA + nB * mB
    ddc = (delta * delta) * cA
    sab = sA + sB
    if SIG_FMA:
        m2 = tl.fma(ddc, nB, sab)
    else:
        m2 = sab + ddc * nB
    if RCP > 0:
        return mean, m2, count
    pos = count > 0.0
    return tl.where(pos, mean, 0.0), tl.where(pos, m2, 0.0), count


@jit
def _combine_halves(mean, m2, cnt, R: tl.constexpr, G: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                    MEAN_V: tl.constexpr, SIG_FMA: tl.constexpr):
    """One level of the tree: [R, G, 2H] -> [R, G, H], combine(B = lower half, A = upper
    half). C > 0: every count at this level is C (cnt is not read)."""
    mlo, mhi = _halves(mean, R, G, H)
    slo, shi = _halves(m2, R, G, H)
    if C > 0:
        c = tl.full([], C, tl.float32)
        return _welford_combine(mlo, slo, c, mhi, shi, c, MEAN_V, SIG_FMA, 1.0 / (2 * C))
    else:
        clo, chi = _halves(cnt, R, G, H)
        return _welford_combine(mlo, slo, clo, mhi, shi, chi, MEAN_V, SIG_FMA, 0.0)


@jit
def _halves(v, R: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
    """[R, G, 2H] -> (v[..., :H], v[..., H:]), as sums over a size-2 axis with the
    other half replaced by -0.0 (exact, signed zeros included: -0.0 is the identity
    of +, where 0.0 + -0.0 would give +0.0; lowers to warp shuffles, where a permute
    + split went through shared memory and replicated the tree in every thread)."""
    v4 = tl.reshape(v, [R, G, 2, H])
    upper = (tl.arange(0, 2) == 1)[None, None, :, None]
    lo = tl.sum(tl.where(upper, -0.0, v4), axis=2)
    hi = tl.sum(tl.where(upper, v4, -0.0), axis=2)
    return lo, hi


@row_kernel("S", "write_stats")
def _layer_norm_modulate_exact_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, stats_ptr, scale_table_ptr, shift_table_ptr,
    S, write_stats,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    eps, fD,
    ct_sd, ht_sd,
    D: tl.constexpr,
    WELFORD_FMA: tl.constexpr,
    MEAN_V: tl.constexpr,
    SIG_FMA: tl.constexpr,
    PASS2: tl.constexpr,  # 0: x from registers; 1: reload x, same tiles; 2: reload x, full-row tiles
    BLOCK_D: tl.constexpr,
    RSQRT_ASM: tl.constexpr,
    R: tl.constexpr,
    F32: tl.constexpr,  # fp32 compute (Wan): n, 1 + scale, the product and the sum stay fp32; one rounding at the store
    MODE: tl.constexpr,  # 0: modulate; 1: affine, `weight * n + bias` (scale_ptr: weight, shift_ptr: bias; PASS2 = 2)
    AFFINE_FMA: tl.constexpr,  # MODE 1: aten's `gamma * n + beta` as one FMA (nvcc's contraction), else two roundings
    SCALE_TABLE: tl.constexpr,  # Folded scale: `table_row + temb`, summed in fp32 (F32) or rounded to x's dtype
    SHIFT_TABLE: tl.constexpr,
):
    L: tl.constexpr = 128
    NV: tl.constexpr = D // 4
    NJ: tl.constexpr = (NV + L - 1) // L
    b, s, r64, rmask = program_rows(S, R)
    lane = tl.arange(0, L)
    within = (lane * 4)[:, None] + tl.arange(0, 4)[None, :]
    x_row = b * x_sb + s * x_ss
    c_row = b * c_sb + s * c_ss
    h_row = b * h_sb + s * h_ss
    o_row = r64 * D
    x_base = x_row[:, None, None]
    c_base = c_row[:, None, None]
    h_base = h_row[:, None, None]
    o_base = o_row[:, None, None]
    dtype = out_ptr.dtype.element_ty

    # pass 1: per-thread Welford, serial over the thread's vectors and their lanes
    mean = tl.zeros([R, L], tl.float32)
    m2 = tl.zeros([R, L], tl.float32)
    xs = ()
    for j in tl.static_range(NJ):
        col = (j * 4 * L + within)[None, :, :]
        vvec = (j * L + lane) < NV
        m = rmask[:, None, None] & vvec[None, :, None]
        xc = tl.load(x_ptr + (x_base + col), mask=m, other=0.0, eviction_policy="evict_last")
        if PASS2 == 0:
            xs = xs + (xc,)
        ev, od = tl.split(tl.reshape(xc.to(tl.float32), [R, L, 2, 2]))
        e0, e2 = tl.split(ev)
        e1, e3 = tl.split(od)
        valid = vvec[None, :]
        full = (j + 1) * L <= NV  # every thread holds a vector of this chunk
        mean, m2 = _welford_step(e0, mean, m2, valid, 4 * j + 1, WELFORD_FMA, full)
        mean, m2 = _welford_step(e1, mean, m2, valid, 4 * j + 2, WELFORD_FMA, full)
        mean, m2 = _welford_step(e2, mean, m2, valid, 4 * j + 3, WELFORD_FMA, full)
        mean, m2 = _welford_step(e3, mean, m2, valid, 4 * j + 4, WELFORD_FMA, full)

    # each thread's count: 4 per vector it holds. When every thread holds NJ vectors
    # (D % 512 == 0) the tree's counts are compile-time constants: C0 << level.
    C0: tl.constexpr = 4 * NJ * (NV % L == 0)
    cnt = (4 * tl.maximum((NV - lane + L - 1) // L, 0)).to(tl.float32)
    cnt = tl.reshape(tl.broadcast_to(cnt[None, :], [R, L]), [R, 4, 32])
    # warp shuffle-down tree (offsets 16..1), combine(B=own, A=other)
    mean = tl.reshape(mean, [R, 4, 32])
    m2 = tl.reshape(m2, [R, 4, 32])
    for i in tl.static_range(5):
        mean, m2, cnt = _combine_halves(mean, m2, cnt, R, 4, 16 >> i, C0 << i, MEAN_V, SIG_FMA)
    # across warps: (w0, w2), (w1, w3), then (w0, w1)
    if C0 == 0:
        cnt = tl.reshape(cnt, [R, 1, 4])
    mean, m2, cnt = _combine_halves(tl.reshape(mean, [R, 1, 4]), tl.reshape(m2, [R, 1, 4]), cnt, R, 1, 2,
                                    C0 << 5, MEAN_V, SIG_FMA)
    mean, m2, cnt = _combine_halves(mean, m2, cnt, R, 1, 1, C0 << 6, MEAN_V, SIG_FMA)
    mean = tl.reshape(mean, [R])
    rstd = rsqrt(tl.math.div_rn(tl.reshape(m2, [R]), fD) + eps, RSQRT_ASM)
    # per-row statistics for the device checks (write_stats = 0 in production)
    smask = rmask & (tl.full([R], write_stats, tl.int32) != 0)
    tl.store(stats_ptr + r64 * 2, mean, mask=smask)
    tl.store(stats_ptr + r64 * 2 + 1, rstd, mask=smask)
    mean3 = mean[:, None, None]
    rstd3 = rstd[:, None, None]

    # pass 2: normalise, modulate with eager's three roundings, store
    if PASS2 == 2:  # elementwise: any thread may take any element, so wide tiles
        cols = tl.arange(0, BLOCK_D)
        cok = cols < D
        m2 = rmask[:, None] & cok[None, :]
        xf = tl.load(x_ptr + (x_row[:, None] + cols[None, :]), mask=m2, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        if MODE == 1:  # aten's affine epilogue in fp32: gamma * (rstd * (x - mean)) + beta
            n = rstd[:, None] * (xf - mean[:, None])
            w = tl.load(scale_ptr + cols * c_sd, mask=cok, other=0.0, eviction_policy="evict_last").to(tl.float32)
            bb = tl.load(shift_ptr + cols * h_sd, mask=cok, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if AFFINE_FMA:
                y = tl.fma(w[None, :], n, bb[None, :])
            else:
                y = w[None, :] * n + bb[None, :]
            tl.store(out_ptr + (o_row[:, None] + cols[None, :]), y.to(dtype), mask=m2, cache_modifier=".cs")
        elif F32:  # (layer_norm(x.float()) * (1 + scale) + shift).type_as(x): fp32 throughout
            n = rstd[:, None] * (xf - mean[:, None])
            scale = tl.load(scale_ptr + (c_row[:, None] + cols[None, :] * c_sd), mask=m2, other=0.0).to(tl.float32)
            shift = tl.load(shift_ptr + (h_row[:, None] + cols[None, :] * h_sd), mask=m2, other=0.0).to(tl.float32)
            if SCALE_TABLE:  # eager: table + temb.float(), one fp32 rounding
                scale = scale + tl.load(scale_table_ptr + cols * ct_sd, mask=cok, other=0.0,
                                        eviction_policy="evict_last").to(tl.float32)[None, :]
            if SHIFT_TABLE:
                shift = shift + tl.load(shift_table_ptr + cols * ht_sd, mask=cok, other=0.0,
                                        eviction_policy="evict_last").to(tl.float32)[None, :]
            y = n * (1.0 + scale) + shift  # fusion off: the sum, the product and the sum each rounded in fp32
            tl.store(out_ptr + (o_row[:, None] + cols[None, :]), y.to(dtype), mask=m2, cache_modifier=".cs")
        else:
            n = (rstd[:, None] * (xf - mean[:, None])).to(dtype).to(tl.float32)
            scale = load_param(scale_ptr, c_row[:, None] + cols[None, :] * c_sd, m2, scale_table_ptr, cols * ct_sd,
                               cok, SCALE_TABLE, dtype, False)
            shift = load_param(shift_ptr, h_row[:, None] + cols[None, :] * h_sd, m2, shift_table_ptr, cols * ht_sd,
                               cok, SHIFT_TABLE, dtype, False)
            t = (1.0 + scale).to(dtype).to(tl.float32)
            p = (n * t).to(dtype).to(tl.float32)
            tl.store(out_ptr + (o_row[:, None] + cols[None, :]), (p + shift).to(dtype), mask=m2, cache_modifier=".cs")
    else:
        for j in tl.static_range(NJ):
            col = (j * 4 * L + within)[None, :, :]
            m = rmask[:, None, None] & ((j * L + lane) < NV)[None, :, None]
            if PASS2 == 0:
                xf = xs[j].to(tl.float32)
            else:
                xf = tl.load(x_ptr + (x_base + col), mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            n = (rstd3 * (xf - mean3)).to(dtype).to(tl.float32)
            zero = c_base * 0  # table offsets broadcast to the [R, L, 4] tile
            scale = load_param(scale_ptr, c_base + col * c_sd, m, scale_table_ptr, zero + col * ct_sd, m, SCALE_TABLE,
                               dtype, False)
            shift = load_param(shift_ptr, h_base + col * h_sd, m, shift_table_ptr, zero + col * ht_sd, m, SHIFT_TABLE,
                               dtype, False)
            t = (1.0 + scale).to(dtype).to(tl.float32)
            p = (n * t).to(dtype).to(tl.float32)
            tl.store(out_ptr + (o_base + col), (p + shift).to(dtype), mask=m, cache_modifier=".cs")


@jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@jit
def moments(s64, q64, D, inv_d, eps):
    """Per row of the float64 tiles s64 (x) and q64 (x**2) [R, BLOCK] (masked columns
    0): the mean as two fp32 terms hi + lo, and 1 / sqrt(var + eps) in fp32, from the
    row's sum and sum of squares in float64, in one joint reduction.

    float64 holds every square of a bf16/fp16/fp32 value and D of them (no overflow,
    no rescale), and the sums to 2**-53 of the row's sum of |x| and of x**2. The mean:
    hi = fp32(sum * inv_d) (inv_d the fp32 1/D) is within a few 2**-24 of it; sum -
    hi * D is exact in float64 (hi * D is exact for D <= MAX_D, and within 2**-22 of
    the sum); lo, that remainder times inv_d in fp32, errs by about 2**-46 of the
    mean. x - hi - lo then keeps a centred value near zero accurate where an fp32 mean
    would be off by about 2**-24 of the row's sum of |x| (many ULPs of it where the
    shift is zero: fuzz seed 0 case 8607, 4.75 ULP). The variance: D * sum(x**2) -
    sum(x)**2 = D**2 var, its cancellation in float64, relative error about 2**-53
    mean**2 / var; a row of 16-bit values that are not all equal has mean / std at
    most about 2**p sqrt(D) (values near the mean are at least 2**-p of it apart: p =
    8 for bf16, 11 for fp16), so that error stays below about 2**-17 (fp16, D =
    MAX_D), far under an output ULP."""
    s, q = tl.reduce((s64, q64), 1, _add_pairs)
    hi = (s * inv_d).to(tl.float32)
    lo = (s - hi.to(tl.float64) * D).to(tl.float32) * inv_d
    var = tl.maximum((q * D - s * s) * inv_d * inv_d, 0.0)
    return hi, lo, (1.0 / tl.sqrt(var + eps)).to(tl.float32)


@row_kernel("S")
def _layer_norm_modulate_high_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, scale_table_ptr, shift_table_ptr,
    S, D,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    ct_sd, ht_sd,
    eps, inv_d,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NCH: tl.constexpr,  # the row as NCH tiles of BLOCK_D columns (masked past D)
    EVEN: tl.constexpr,  # D == NCH * BLOCK_D and S % R == 0: no masks
    SCALE_TABLE: tl.constexpr,  # Folded scale: `table_row + temb`, rounded to x's dtype as eager's add
    SHIFT_TABLE: tl.constexpr,
):
    b, s, r64, rmask = program_rows(S, R)
    cols = tl.arange(0, BLOCK_D)
    x_row = (b * x_sb + s * x_ss)[:, None]
    # pass 1: each tile's float64 values and squares, added elementwise across the tiles,
    # then one reduction
    xs = ()
    for j in tl.static_range(NCH):
        cj = j * BLOCK_D + cols
        if EVEN:
            x = tl.load(x_ptr + (x_row + cj[None, :]), eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(x_ptr + (x_row + cj[None, :]), mask=rmask[:, None] & (cj < D)[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
        x64 = x.to(tl.float64)
        if j == 0:
            s64 = x64
            q64 = x64 * x64
        else:
            s64 += x64
            q64 += x64 * x64
        xs = xs + (x,)
    hi, lo, rstd = moments(s64, q64, D, inv_d, eps)
    # pass 2, from registers: normalise, modulate, round once
    dtype = out_ptr.dtype.element_ty
    c_row = (b * c_sb + s * c_ss)[:, None]
    h_row = (b * h_sb + s * h_ss)[:, None]
    for j in tl.static_range(NCH):
        cj = j * BLOCK_D + cols
        if EVEN:
            m = None
            col_ok = None
        else:
            col_ok = cj < D
            m = rmask[:, None] & col_ok[None, :]
        scale = load_param(scale_ptr, c_row + cj[None, :] * c_sd, m, scale_table_ptr, cj * ct_sd, col_ok,
                           SCALE_TABLE, dtype, False)
        shift = load_param(shift_ptr, h_row + cj[None, :] * h_sd, m, shift_table_ptr, cj * ht_sd, col_ok,
                           SHIFT_TABLE, dtype, False)
        n = ((xs[j] - hi[:, None]) - lo[:, None]) * rstd[:, None]
        y = modulate_once(n, scale, shift, dtype)
        tl.store(out_ptr + ((r64 * D)[:, None] + cj[None, :]), y, mask=m, cache_modifier=".cs")


_launch_exact = FastLaunch(_layer_norm_modulate_exact_kernel, (
    "D", "WELFORD_FMA", "MEAN_V", "SIG_FMA", "PASS2", "BLOCK_D", "RSQRT_ASM", "R", "F32", "MODE", "AFFINE_FMA",
    "SCALE_TABLE", "SHIFT_TABLE"))
_launch_high = FastLaunch(_layer_norm_modulate_high_kernel, ("R", "BLOCK_D", "NCH", "EVEN", "SCALE_TABLE",
                                                            "SHIFT_TABLE"))


# ---------------------------------------------------------------- launcher


class LayerNormModulatePlan:
    """A call that passed the guard: operands, geometry, the kernel and the gate key.
    f32: the fp32-compute variant; mode 1: the affine layer norm (scale: weight,
    shift: bias) with `fma` its epilogue form; scale_table/shift_table: Folded rows."""

    __slots__ = ("x", "scale", "shift", "rows", "c_strides", "h_strides", "eps", "key", "exact", "f32", "mode", "fma",
                 "scale_table", "shift_table")

    def __init__(self, x, scale, shift, rows, c_strides, h_strides, eps, key, exact, f32=False, mode=0, fma=False,
                 scale_table=None, shift_table=None):
        self.x, self.scale, self.shift = x, scale, shift
        self.rows, self.c_strides, self.h_strides = rows, c_strides, h_strides
        self.eps, self.key, self.exact = eps, key, exact
        self.f32, self.mode, self.fma = f32, mode, fma
        self.scale_table, self.shift_table = scale_table, shift_table


def plan_layer_norm_modulate(x, scale, shift, eps, tier: str = "lossless"):
    """The guard: a plan for the kernel of `tier` ("lossless": aten's Welford order,
    bit-exact; "high": one pass, one rounding; the sites send fp32 to the lossless
    kernel), or the reason the call takes the reference. scale/shift may be Folded
    (a table row of x's dtype added on the fly, rounded as eager's add)."""
    unpacked = tables_of(scale, shift, x)
    if unpacked.__class__ is str:
        return unpacked
    scale, shift, scale_table, shift_table = unpacked
    checked = check_operands(x, scale, shift)
    if checked.__class__ is str:
        return checked
    rows, c, h = checked
    D = rows.D
    if D > MAX_D:
        return f"D={D} > {MAX_D}: row too wide for the register-resident kernels"
    exact = tier != "high"
    if exact:
        if D % 4:
            return f"D={D} is not a multiple of 4 (aten takes RowwiseMomentsCUDAKernel)"
        if x.is_contiguous() and x.data_ptr() % (4 * x.element_size()):
            return "x is not 4-element aligned (aten takes RowwiseMomentsCUDAKernel)"
    key = (x.dtype, x.get_device(), layout_class(c, scale) + ("+table" if scale_table is not None else ""),
           layout_class(h, shift) + ("+table" if shift_table is not None else ""), "layer_norm", f"D={D}",
           "welford" if exact else "one-pass")
    return LayerNormModulatePlan(x, scale, shift, rows, c, h, float(eps), key, exact, scale_table=scale_table,
                                 shift_table=shift_table)


def exact_launch_shape(plan) -> tuple[int, int]:
    """(R, num_warps) for the exact kernel (the reduction order does not depend on
    them; measured on the H200, bench/NOTES.md "Norm launch shapes"): D = 4096
    per-token two rows on 8 warps, D = 3072 one row on 4; elsewhere one row on 2
    warps, 4 with per-token parameters."""
    per_token = plan.c_strides[1] != 0 or plan.h_strides[1] != 0
    return _EXACT_SHAPES.get((plan.rows.D, per_token), (1, 4 if per_token else 2))


_EXACT_SHAPES = {(4096, True): (2, 8), (3072, False): (1, 4)}

#: warps a 16-bit row of the high kernel takes, by padded width: 4 for 4096 columns (the
#: float64 reduction's shuffles; H200, 6144 x 4096 per-sample: 86.8% of the copy
#: ceiling on 4 warps, 78.8% on 8; bench/NOTES.md, 2026-12-03 tenth session); on the
#: H100, whose slower memory hides the float64 arithmetic, 8 for rows of exactly 4096
#: columns (0.5-1.3 points ahead of 4 in each of nine runs over four sessions; a row of
#: 3072 padded to 4096 loses 5.5 on 8; twenty-fifth session)
_HIGH_WARPS = {2048: 4, 4096: 4, 8192: 4}
_HIGH_WARPS_BY_FAMILY = {"H100": {**_HIGH_WARPS, 4096: 8}}
#: warps of a row held as tiles (`high_tiles`), by tile width: 4 (H100, one row a
#: program: 2240 as 5 x 512 89.1% of the copy ceiling on 4 warps, 86.8% on 2, 72.4% on
#: 8; 1536 as 3 x 512 92.3% on 4, 91.4% on 2; 6144 as 3 x 2048 91.6% on 4, 90.6% on 8;
#: 3072 as 3 x 1024 level on 4 and 8; twenty-seventh session); 8 for tiles of 4096
#: (rows over 8192 columns, not measured), whose 4-warp threads would hold 32 columns a tile
_CHUNK_WARPS = {512: 4, 1024: 4, 2048: 4, 4096: 8}


def _recipe_of(plan, config=None, stats=None) -> Recipe:
    """The launch of a guarded plan: the kernel's grid, integers, constexprs and warps."""
    r = plan.rows
    if plan.exact:
        R, num_warps, pass2 = (tuple(config) + (PASS2,))[:3] if config else exact_launch_shape(plan) + (PASS2,)
        if plan.f32 or plan.mode:
            pass2 = 2  # the fp32-compute and affine epilogues are written for the wide second pass
        ct, ht = plan.scale_table, plan.shift_table
        return Recipe(
            (cdiv(r.S, R), r.B),
            (r.S, int(stats is not None), r.sb, r.ss, *plan.c_strides, *plan.h_strides, plan.eps, float(r.D),
             0 if ct is None else ct.stride(0), 0 if ht is None else ht.stride(0)),
            (r.D, WELFORD_FMA, MEAN_V, SIG_FMA, pass2, next_pow2(r.D), RSQRT_ASM and not INTERPRET, R, plan.f32,
             plan.mode, plan.fma, ct is not None, ht is not None),
            num_warps,
        )
    padded = next_pow2(r.D)
    family = device_family(plan.x.get_device()) if padded == r.D else ""  # padded rows: the default table
    warps = _HIGH_WARPS_BY_FAMILY.get(family, _HIGH_WARPS)
    R, num_warps = high_launch_shape(padded, r.S, plan.x.element_size(), warps)
    block_d, nch = high_tiles(r.D) if R == 1 else (padded, 1)
    if nch > 1:
        num_warps = _CHUNK_WARPS[block_d]
    if config:
        R, num_warps = config[:2]
        block_d = config[2] if len(config) > 2 else padded
        nch = cdiv(r.D, block_d)
    ct, ht = plan.scale_table, plan.shift_table
    return Recipe((cdiv(r.S, R), r.B),
                  (r.S, r.D, r.sb, r.ss, *plan.c_strides, *plan.h_strides, 0 if ct is None else ct.stride(0),
                   0 if ht is None else ht.stride(0), plan.eps, 1.0 / r.D),
                  (R, block_d, nch, nch * block_d == r.D and r.S % R == 0, ct is not None, ht is not None),
                  num_warps)


def high_tiles(D: int) -> tuple[int, int]:
    """(BLOCK_D, NCH) of a one-row-a-program launch of the high kernel: the row as NCH
    (2-7) tiles of a power of two >= 512 where they hold fewer lanes than one tile
    padded to the next power of two (3072 = 3 x 1024, 5120 = 5 x 1024, 6144 = 3 x 2048
    unmasked; 2240 as 5 x 512, the last tile masked, against 4096), else (that padded
    width, 1). Of equal lane counts the wider tile."""
    best = (next_pow2(D), 1)
    for tile in (4096, 2048, 1024, 512):
        n = cdiv(D, tile)
        if 2 <= n <= 7 and n * tile < best[0] * best[1]:
            best = (tile, n)
    return best


def _operands(exact: bool, x, scale, shift, out, ct, ht, stats=None) -> tuple:
    tables = (scale if ct is None else ct, shift if ht is None else ht)
    if exact:
        return (x, scale, shift, out, dummy_stats(x) if stats is None else stats) + tables
    return (x, scale, shift, out) + tables


def launch_layer_norm_modulate(plan, out=None, config=None, stats=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (R, num_warps[, pass2]) of the exact kernel, (R, num_warps[,
    BLOCK_D]) of the one-pass kernel (BLOCK_D below D: the row as ceil(D / BLOCK_D) tiles).
    `stats` (fp32, 2 per row; exact kernel) receives each row's mean and rstd."""
    x = plan.x
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch = _launch_exact if plan.exact else _launch_high
    launch.launch(_recipe_of(plan, config, stats),
                  _operands(plan.exact, x, plan.scale, plan.shift, out, plan.scale_table, plan.shift_table, stats))
    return out


def bind_layer_norm_modulate(plan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(x, scale, shift,
    eps)` (or `(x, weight, bias, eps)` for the affine variant) for a call with the
    plan's shapes, strides, dtypes and devices (and eps); None where the call's
    pointers miss an alignment the guard requires."""
    recipe, launch = _recipe_of(plan), (_launch_exact if plan.exact else _launch_high).launch
    x = plan.x
    checks = ()
    if plan.exact and x.is_contiguous() and (not plan.f32 or x.dtype is torch.float32):
        checks = ((0, 16 if plan.f32 else 4 * x.element_size()),)  # the guard's alignment of x (aten's kernel choice)
    if plan.mode:
        checks += tuple((i, 16) for i, p in ((1, plan.scale), (2, plan.shift))
                        if p.dtype is torch.float32 and p.stride(0) == 1)
    return bound_param_launch(launch, recipe, functools.partial(_operands, plan.exact), plan.scale_table is not None,
                              plan.shift_table is not None, Output.contiguous_like(x), checks)


def layer_norm_modulate(x, scale, shift, eps: float, *, tier: str = "lossless") -> torch.Tensor:
    """`layer_norm(x) * (1 + scale) + shift`, guarded but ungated: the kernel of
    `tier` where eligible, else the eager reference."""
    plan = plan_layer_norm_modulate(x, scale, shift, eps, tier)
    if plan.__class__ is str:
        return layer_norm_modulate_reference(x, scale, shift, eps)
    return launch_layer_norm_modulate(plan)


# ---------------------------------------------------------------- the fp32-compute variants (Wan)


def _check_f32_rows(x):
    """(rows, None) for the fp32-compute variants' x, or (None, why): x of bf16, fp16 or
    fp32, 2-D/3-D, last dimension contiguous, D a multiple of 4 (aten's vectorized
    kernel on `x.float()`) and at most MAX_D; an fp32 x (`x.float()` is x itself) must
    be 4-element aligned where contiguous, as aten requires (a bf16/fp16 x's `.float()`
    is a fresh, aligned tensor)."""
    if not HAS_TRITON:
        return None, "triton is not installed"
    why = common_device_dtype(x)
    if why:
        return None, why
    rows = rows_of(x)
    if rows is None:
        return None, f"x must be 2-D or 3-D, got {x.dim()}-D"
    if x.numel() == 0:
        return None, "empty tensor"
    if rows.sd != 1:
        return None, "x's last dimension is not contiguous"
    if rows.D > MAX_D:
        return None, f"D={rows.D} > {MAX_D}: row too wide for the register-resident kernels"
    if rows.D % 4:
        return None, f"D={rows.D} is not a multiple of 4 (aten takes RowwiseMomentsCUDAKernel)"
    if x.dtype is torch.float32 and x.is_contiguous() and x.data_ptr() % 16:
        return None, "x is not 4-element aligned (aten takes RowwiseMomentsCUDAKernel)"
    return rows, None


def _fp32_param(p, x, name):
    """(tensor, table row or None, strides, why): an fp32 parameter (or Folded, summed
    in fp32) broadcasting to x."""
    table = None
    if p.__class__ is Folded:
        p, table, why = table_of(p, x, f32=True)
        if why:
            return None, None, None, why
    elif not isinstance(p, torch.Tensor):
        return None, None, None, f"{name} is not a tensor"
    elif p.dtype is not torch.float32:
        return None, None, None, f"{name} is not fp32 (the fp32-compute variant)"
    grad = torch.is_grad_enabled()
    for t in (p, table):
        if t is not None:
            if t.get_device() != x.get_device():
                return None, None, None, "operands on different devices"
            if grad and t.requires_grad:
                return None, None, None, "autograd needs the eager graph"
    strides = broadcast_strides(p, x.shape)
    if strides is None:
        return None, None, None, f"{name} does not broadcast to x's shape"
    return p, table, strides, None


def plan_layer_norm_modulate_f32(x, scale, shift, eps, tier: str = "lossless"):
    """The guard of `(layer_norm(x.float()) * (1 + scale) + shift).type_as(x)` (Wan's
    adaLN, exact in every tier: one rounding already): x bf16/fp16/fp32, scale and
    shift fp32 (or Folded: `table + temb.float()`); a plan, or why the call takes the
    reference."""
    rows, why = _check_f32_rows(x)
    if why:
        return why
    scale, ct, c, why = _fp32_param(scale, x, "scale")
    if why:
        return why
    shift, ht, h, why = _fp32_param(shift, x, "shift")
    if why:
        return why
    key = (x.dtype, x.get_device(), layout_class(c, scale) + ("+table" if ct is not None else ""),
           layout_class(h, shift) + ("+table" if ht is not None else ""), "layer_norm_f32", f"D={rows.D}", "welford")
    return LayerNormModulatePlan(x, scale, shift, rows, c, h, float(eps), key, True, f32=True, scale_table=ct,
                                 shift_table=ht)


def layer_norm_modulate_f32(x, scale, shift, eps: float) -> torch.Tensor:
    """`(layer_norm(x.float()) * (1 + scale) + shift).type_as(x)`, guarded but ungated.
    x: [B, S, D] or [N, D] (bf16, fp16 or fp32), last dimension contiguous; scale, shift:
    fp32 broadcasting to x, or Folded (`table + temb.float()`). Returns x's shape and dtype."""
    plan = plan_layer_norm_modulate_f32(x, scale, shift, eps)
    if plan.__class__ is str:
        return layer_norm_modulate_f32_reference(x, scale, shift, eps)
    return launch_layer_norm_modulate(plan)


_AFFINE_FMA: dict = {}


def layer_norm_affine_fma(device) -> bool | None:
    """Whether aten's vectorized LayerNorm (fp32, with weight and bias) on this device
    (a CUDA index; -1 the CPU) computes `gamma * n + beta` as one FMA (nvcc contracts
    it) rather than rounding the product first. Probed once per device: the op's own
    mean and rstd (`native_layer_norm`) rebuild n = rstd * (x - mean) exactly, and the
    output is compared with both forms (the FMA form from float64, where the product
    is exact). None where neither matches, or it can't be probed now (tracing, capture)."""
    if device.__class__ is not int:
        device = torch.device(device)
        device = -1 if device.type == "cpu" else (torch.cuda.current_device() if device.index is None else device.index)
    if device in _AFFINE_FMA:
        return _AFFINE_FMA[device]
    if torch.compiler.is_compiling() or (device >= 0 and torch.cuda.is_current_stream_capturing()):
        return None
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 512, generator=g), torch.randn(512, generator=g), torch.randn(512, generator=g)
    dev = "cpu" if device < 0 else f"cuda:{device}"
    out, mean, rstd = (t.cpu() for t in torch.native_layer_norm(x.to(dev), (512,), w.to(dev), b.to(dev), 1e-6))
    n = rstd * (x - mean)
    rounded = n * w + b
    fused = (n.double() * w.double() + b.double()).float()
    if torch.equal(out, fused) and not torch.equal(out, rounded):
        result = True
    elif torch.equal(out, rounded) and not torch.equal(out, fused):
        result = False
    else:
        result = None
    _AFFINE_FMA[device] = result
    return result


def plan_layer_norm_f32(x, weight, bias, eps, tier: str = "lossless"):
    """The guard of `F.layer_norm(x.float(), (D,), weight.float(), bias.float(), eps).type_as(x)`
    (Wan's `norm2(x.float()).type_as(x)`, an FP32LayerNorm with affine): x as for
    `plan_layer_norm_modulate_f32`, weight and bias [D] of bf16/fp16/fp32. Exact in
    every tier. A plan, or why the call takes the reference."""
    rows, why = _check_f32_rows(x)
    if why:
        return why
    D = rows.D
    grad = torch.is_grad_enabled()
    for name, p in (("weight", weight), ("bias", bias)):
        if not isinstance(p, torch.Tensor):
            return f"{name} is not a tensor"
        if p.dim() != 1 or p.shape[0] != D:
            return f"{name} must be [D]"
        if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"unsupported {name} dtype {p.dtype}"
        if p.get_device() != x.get_device():
            return "operands on different devices"
        if grad and p.requires_grad:
            return "autograd needs the eager graph"
        if p.dtype is torch.float32 and p.stride(0) == 1 and p.data_ptr() % 16:
            return f"{name} is not 4-element aligned (aten takes RowwiseMomentsCUDAKernel)"
    fma = layer_norm_affine_fma(x.get_device())
    if fma is None:
        return "aten's LayerNorm epilogue rounds in no form this kernel knows here (or not probed yet)"
    key = (x.dtype, x.get_device(), f"weight {weight.dtype}", f"bias {bias.dtype}", "layer_norm_affine_f32",
           f"D={D}", "welford", "fma" if fma else "no fma")
    return LayerNormModulatePlan(x, weight, bias, rows, (0, 0, weight.stride(0)), (0, 0, bias.stride(0)), float(eps),
                                 key, True, f32=True, mode=1, fma=fma)


def layer_norm_f32(x, weight, bias, eps: float) -> torch.Tensor:
    """`F.layer_norm(x.float(), (D,), weight.float(), bias.float(), eps).type_as(x)`, guarded but
    ungated. x: [B, S, D] or [N, D] (bf16, fp16 or fp32), last dimension contiguous;
    weight, bias: [D] (bf16, fp16 or fp32). Returns x's shape and dtype."""
    plan = plan_layer_norm_f32(x, weight, bias, eps)
    if plan.__class__ is str:
        return layer_norm_f32_reference(x, weight, bias, eps)
    return launch_layer_norm_modulate(plan)


# ---------------------------------------------------------------- reference


def layer_norm_modulate_reference(x, scale, shift, eps: float) -> torch.Tensor:
    """The eager expression: `F.layer_norm` without affine, then `n * (1 + scale) + shift`."""
    return modulate_reference(F.layer_norm(x, (x.shape[-1],), eps=eps), scale, shift)


def layer_norm_modulate_f32_reference(x, scale, shift, eps: float) -> torch.Tensor:
    """Wan's eager expression: `(norm1(x.float()) * (1 + scale) + shift).type_as(x)` with
    FP32LayerNorm (no affine) and fp32 parameters (Folded: `table + temb.float()`)."""
    n = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (n * (1 + value32(scale)) + value32(shift)).type_as(x)


def layer_norm_f32_reference(x, weight, bias, eps: float) -> torch.Tensor:
    """Wan's `norm2(x.float()).type_as(x)`: FP32LayerNorm's forward on an fp32 input
    (`F.layer_norm(inputs.float(), shape, weight.float(), bias.float(), eps).to(fp32)`), then the cast."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).type_as(x)


def _reference64(x, scale, shift, eps):
    return modulated64(layer_norm64(x, eps), scale, shift)


def _terms(x, scale, shift, eps):
    return modulated_terms64(layer_norm64(x, eps), scale, shift)


def _make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    x = cases.activation(case, gen)
    scale, shift = cases.param(case, gen, 2)
    return x, scale, shift, 1e-6


SPEC = OpSpec(
    name="layer_norm_modulate",
    reference=layer_norm_modulate_reference,
    plan=plan_layer_norm_modulate,
    launch={"lossless": launch_layer_norm_modulate, "high": launch_layer_norm_modulate},
    tiers=("lossless", "high"),
    bind={"lossless": bind_layer_norm_modulate, "high": bind_layer_norm_modulate},
    reference64=_reference64,
    terms=_terms,
    make_args=_make_args,
    layouts=cases.PARAM_LAYOUTS,
)


def _f32_reference64(x, scale, shift, eps):
    return layer_norm64(x, eps) * (1 + value32(scale).double()) + value32(shift).double()


def _f32_terms(x, scale, shift, eps):
    return (layer_norm64(x, eps) * (1 + value32(scale).double())).abs().maximum(value32(shift).double().abs())


def _f32_make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    x = cases.activation(case, gen)
    shift, scale = cases.param_f32(case, gen, 2)
    return x, scale, shift, 1e-6


F32_SPEC = OpSpec(
    name="layer_norm_modulate_f32",
    reference=layer_norm_modulate_f32_reference,
    plan=plan_layer_norm_modulate_f32,
    launch={"lossless": launch_layer_norm_modulate},
    bind={"lossless": bind_layer_norm_modulate},
    reference64=_f32_reference64,
    terms=_f32_terms,
    make_args=_f32_make_args,
    layouts=cases.F32_PARAM_LAYOUTS,
)


def _affine_reference64(x, weight, bias, eps):
    return layer_norm64(x, eps) * weight.double() + bias.double()


def _affine_terms(x, weight, bias, eps):
    return (layer_norm64(x, eps) * weight.double()).abs().maximum(bias.double().abs())


AFFINE_LAYOUTS = ("fp32", "bf16")  # the weight and bias dtype (fp32: from_pretrained keeps norm2 in fp32)


def _affine_make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    x = cases.activation(case, gen)
    if case.layout not in AFFINE_LAYOUTS:
        raise ValueError(f"unknown layout {case.layout!r}; choose one of {', '.join(AFFINE_LAYOUTS)}")
    dt = torch.float32 if case.layout == "fp32" else torch.bfloat16
    weight = cases.draw((case.D,), dt, case.data, gen, case.device, 0.5) + 1
    bias = cases.draw((case.D,), dt, case.data, gen, case.device, 0.5)
    return x, weight, bias, 1e-6


AFFINE_SPEC = OpSpec(
    name="layer_norm_f32",
    reference=layer_norm_f32_reference,
    plan=plan_layer_norm_f32,
    launch={"lossless": launch_layer_norm_modulate},
    bind={"lossless": bind_layer_norm_modulate},
    reference64=_affine_reference64,
    terms=_affine_terms,
    make_args=_affine_make_args,
    layouts=AFFINE_LAYOUTS,
)


# ---------------------------------------------------------------- torch.library


def _layer_norm_modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    return layer_norm_modulate(x, scale, shift, eps)


layer_norm_modulate_op = register_op("layer_norm_modulate", _layer_norm_modulate_op, layer_norm_modulate_reference)


def _layer_norm_modulate_f32_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    return layer_norm_modulate_f32(x, scale, shift, eps)


layer_norm_modulate_f32_op = register_op("layer_norm_modulate_f32", _layer_norm_modulate_f32_op,
                                         layer_norm_modulate_f32_reference)


def _layer_norm_f32_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return layer_norm_f32(x, weight, bias, eps)


layer_norm_f32_op = register_op("layer_norm_f32", _layer_norm_f32_op, layer_norm_f32_reference)
