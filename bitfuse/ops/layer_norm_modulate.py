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

HIGH TIER (bf16/fp16): one pass, x read once, mean and variance in fp32 from
registers (two passes over the registers, no Welford), then n * (1 + scale) +
shift in fp32, rounded once: within 0.5 ULP of the float64 value at the scale
of the modulate's terms (see rms_norm_modulate).

Shapes: x [B, S, D] or [N, D] with a contiguous last dimension; scale, shift as
for modulate (Folded parameters are materialised by the caller first); one
dtype. Output: a new contiguous tensor of x's shape and dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cases
from ._launch import (
    INTERPRET,
    FastLaunch,
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
    dummy_stats,
    high_launch_shape,
    layer_norm64,
    modulate_once,
    modulated64,
    modulated_terms64,
    overflow_scale,
    program_rows,
    rsqrt,
)
from ._params import layout_class
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
    x_ptr, scale_ptr, shift_ptr, out_ptr, stats_ptr,
    S, write_stats,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    eps, fD,
    D: tl.constexpr,
    WELFORD_FMA: tl.constexpr,
    MEAN_V: tl.constexpr,
    SIG_FMA: tl.constexpr,
    PASS2: tl.constexpr,  # 0: x from registers; 1: reload x, same tiles; 2: reload x, full-row tiles
    BLOCK_D: tl.constexpr,
    RSQRT_ASM: tl.constexpr,
    R: tl.constexpr,
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
        m2 = rmask[:, None] & (cols < D)[None, :]
        xf = tl.load(x_ptr + (x_row[:, None] + cols[None, :]), mask=m2, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        n = (rstd[:, None] * (xf - mean[:, None])).to(dtype).to(tl.float32)
        scale = tl.load(scale_ptr + (c_row[:, None] + cols[None, :] * c_sd), mask=m2, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + (h_row[:, None] + cols[None, :] * h_sd), mask=m2, other=0.0).to(tl.float32)
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
            scale = tl.load(scale_ptr + (c_base + col * c_sd), mask=m, other=0.0).to(tl.float32)
            shift = tl.load(shift_ptr + (h_base + col * h_sd), mask=m, other=0.0).to(tl.float32)
            t = (1.0 + scale).to(dtype).to(tl.float32)
            p = (n * t).to(dtype).to(tl.float32)
            tl.store(out_ptr + (o_base + col), (p + shift).to(dtype), mask=m, cache_modifier=".cs")


@row_kernel("S")
def _layer_norm_modulate_high_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr,
    S, D,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    eps, inv_d,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b, s, r64, rmask = program_rows(S, R)
    cols = tl.arange(0, BLOCK_D)
    m = rmask[:, None] & (cols < D)[None, :]
    x = tl.load(
        x_ptr + ((b * x_sb + s * x_ss)[:, None] + cols[None, :]), mask=m, other=0.0,
        eviction_policy="evict_first",
    ).to(tl.float32)
    sc = overflow_scale(x)
    xs = x * sc[:, None]  # (x - mean) * rstd is invariant under the power-of-two scale
    mean = tl.sum(xs, axis=1) * inv_d
    xc = tl.where(m, xs - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) * inv_d + eps * sc * sc)
    scale = tl.load(scale_ptr + ((b * c_sb + s * c_ss)[:, None] + cols[None, :] * c_sd), mask=m, other=0.0)
    shift = tl.load(shift_ptr + ((b * h_sb + s * h_ss)[:, None] + cols[None, :] * h_sd), mask=m, other=0.0)
    y = modulate_once(xc * rstd[:, None], scale, shift, out_ptr.dtype.element_ty)
    tl.store(out_ptr + ((r64 * D)[:, None] + cols[None, :]), y, mask=m, cache_modifier=".cs")


_launch_exact = FastLaunch(_layer_norm_modulate_exact_kernel)
_launch_high = FastLaunch(_layer_norm_modulate_high_kernel)


# ---------------------------------------------------------------- launcher


class LayerNormModulatePlan:
    """A call that passed the guard: operands, geometry, the kernel and the gate key."""

    __slots__ = ("x", "scale", "shift", "rows", "c_strides", "h_strides", "eps", "key", "exact")

    def __init__(self, x, scale, shift, rows, c_strides, h_strides, eps, key, exact):
        self.x, self.scale, self.shift = x, scale, shift
        self.rows, self.c_strides, self.h_strides = rows, c_strides, h_strides
        self.eps, self.key, self.exact = eps, key, exact


def plan_layer_norm_modulate(x, scale, shift, eps, tier: str = "lossless"):
    """The guard: a plan for the kernel of `tier` ("lossless": aten's Welford order,
    bit-exact; "high": one pass, one rounding; the sites send fp32 to the lossless
    kernel), or the reason the call takes the reference."""
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
    key = (x.dtype, x.get_device(), layout_class(c, scale), layout_class(h, shift), "layer_norm", f"D={D}",
           "welford" if exact else "one-pass")
    return LayerNormModulatePlan(x, scale, shift, rows, c, h, float(eps), key, exact)


def exact_launch_shape(plan) -> tuple[int, int]:
    """(R, num_warps) for the exact kernel (the reduction order does not depend on
    them; measured on the H200, bench/NOTES.md "Norm launch shapes"): D = 4096
    per-token two rows on 8 warps, D = 3072 one row on 4; elsewhere one row on 2
    warps, 4 with per-token parameters."""
    per_token = plan.c_strides[1] != 0 or plan.h_strides[1] != 0
    return _EXACT_SHAPES.get((plan.rows.D, per_token), (1, 4 if per_token else 2))


_EXACT_SHAPES = {(4096, True): (2, 8), (3072, False): (1, 4)}


def launch_layer_norm_modulate(plan, out=None, config=None, stats=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (R, num_warps[, pass2]) of the exact kernel, (R, num_warps) of
    the one-pass kernel. `stats` (fp32, 2 per row; exact kernel) receives each row's
    mean and rstd."""
    x, r = plan.x, plan.rows
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tensors = (x, plan.scale, plan.shift, out)
    if plan.exact:
        R, num_warps, pass2 = (tuple(config) + (PASS2,))[:3] if config else exact_launch_shape(plan) + (PASS2,)
        _launch_exact(
            (cdiv(r.S, R), r.B), tensors + (dummy_stats(x) if stats is None else stats,),
            (r.S, int(stats is not None), r.sb, r.ss, *plan.c_strides, *plan.h_strides,
             plan.eps, float(r.D)),
            dict(D=r.D, WELFORD_FMA=WELFORD_FMA, MEAN_V=MEAN_V, SIG_FMA=SIG_FMA,
                 PASS2=pass2, BLOCK_D=next_pow2(r.D), RSQRT_ASM=RSQRT_ASM and not INTERPRET, R=R),
            dict(num_warps=num_warps, enable_fp_fusion=False),
        )
    else:
        block_d = next_pow2(r.D)
        R, num_warps = config or high_launch_shape(block_d, r.S, x.element_size())
        _launch_high(
            (cdiv(r.S, R), r.B), tensors,
            (r.S, r.D, r.sb, r.ss, *plan.c_strides, *plan.h_strides, plan.eps, 1.0 / r.D),
            dict(R=R, BLOCK_D=block_d),
            dict(num_warps=num_warps, enable_fp_fusion=False),  # see _norm.modulate_once
        )
    return out


def layer_norm_modulate(x, scale, shift, eps: float, *, tier: str = "lossless") -> torch.Tensor:
    """`layer_norm(x) * (1 + scale) + shift`, guarded but ungated: the kernel of
    `tier` where eligible, else the eager reference."""
    plan = plan_layer_norm_modulate(x, scale, shift, eps, tier)
    if plan.__class__ is str:
        return layer_norm_modulate_reference(x, scale, shift, eps)
    return launch_layer_norm_modulate(plan)


# ---------------------------------------------------------------- reference


def layer_norm_modulate_reference(x, scale, shift, eps: float) -> torch.Tensor:
    """The eager expression: `F.layer_norm` without affine, then `n * (1 + scale) + shift`."""
    return modulate_reference(F.layer_norm(x, (x.shape[-1],), eps=eps), scale, shift)


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
    reference64=_reference64,
    terms=_terms,
    make_args=_make_args,
    layouts=tuple(layout for layout in cases.PARAM_LAYOUTS if not layout.startswith("folded")),
)


# ---------------------------------------------------------------- torch.library


def _layer_norm_modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    return layer_norm_modulate(x, scale, shift, eps)


layer_norm_modulate_op = register_op("layer_norm_modulate", _layer_norm_modulate_op, layer_norm_modulate_reference)
