"""Weightless LayerNorm + adaLN modulation: `layer_norm(x) * (1 + scale) + shift`.

The reference is `F.layer_norm(x, (D,), eps=eps)` without weight or bias
(`nn.LayerNorm(elementwise_affine=False)`, the final norm of LTX-2), then
eager's modulate with its three roundings.

Exact mode reproduces aten's `vectorized_layer_norm_kernel`
(aten/src/ATen/native/cuda/layer_norm_kernel.cu), taken when D % 4 == 0,
D <= 2^24 and x (after `.contiguous()`) is 4-element aligned:
  * one row per block of 128 threads (32 lanes x 4 warps); thread
    t = 32*warp + lane reads float4 vectors t, t+128, t+256, ... and runs
    Welford serially over the 4 values of each vector in order:
        delta = v - mean; count += 1
        mean  = fma(delta, 1/count, mean)          (1/count: IEEE division)
        m2    = fma(delta, v - mean_new, m2)
    (nvcc contracts `mean + delta * (1.f/new_count)` and
    `sigma2 + delta * (val - new_mean)`);
  * warp shuffle-down, offsets 16, 8, 4, 2, 1, combining (own, shuffled) as
    cuWelfordCombine(B=own, A=other):
        delta = B.mean - A.mean; count = A.count + B.count; coef = 1/count
        nA = A.count*coef; nB = B.count*coef
        mean  = fma(nA, A.mean, nB*B.mean)         (MEAN_V)
        m2    = fma((delta*delta)*A.count, nB, A.m2 + B.m2)   (SIG_FMA)
        count = 0 -> mean = m2 = 0;
  * across warps through shared memory: w0 <- (w0, w2), w1 <- (w1, w3), then
    w0 <- (w0, w1), each as combine(B=lower, A=upper);
  * var = m2 / float(D) (IEEE), rstd = rsqrtf(var + eps),
    n = rstd * (x - mean), rounded once to x's dtype.
Which products nvcc contracted into FMAs is a property of the build; the
variants are selectable (WELFORD_FMA, MEAN_V, SIG_FMA) and the defaults are
the ones measured to agree on the H200 with torch 2.11 (bench/explore_norm.py,
bench/results/norm_explore.md). For D a multiple of 512 every count is a power
of two and only the per-thread Welford contraction matters.

Falls back (plan returns a reason) when D % 4 != 0 or a contiguous x is not
aligned (aten then takes RowwiseMomentsCUDAKernel + LayerNormForwardCUDAKernel,
a block-reduce Welford with other rounding), or D > MAX_D.

High mode (`exact=False`): one pass, x read once, mean and variance in fp32
from registers (two-pass over the registers, no Welford), one rounding at the
end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._pointwise import INTERPRET, cdiv, jit, layout_class, tl, triton
from .modulate import modulate_reference
from .rms_norm_modulate import MAX_D, _check_operands, _row_kernel, _rsqrt, high_launch_shape

# FMA contractions of aten's nvcc build (measured: bench/explore_norm.py)
WELFORD_FMA = True  # per-thread Welford update: two FMAs
MEAN_V = 0  # combine mean: 0 fma(nA, mA, nB*mB), 1 fma(nB, mB, nA*mA), 2 no FMA
SIG_FMA = True  # combine m2: fma((d*d)*cA, nB, sA + sB)
RSQRT_ASM = False
KEEP = True  # keep the row in registers (False: read x twice)

LANES = 128  # aten's num_threads(): 4 warps of 32


# ---------------------------------------------------------------- kernels


@jit
def _welford_step(v, mean, m2, cnt, valid, c_new, WELFORD_FMA: tl.constexpr):
    rcp = tl.math.div_rn(tl.full([], 1.0, tl.float32), c_new)
    delta = v - mean
    if WELFORD_FMA:
        nm = tl.fma(delta, rcp, mean)
        nm2 = tl.fma(delta, v - nm, m2)
    else:
        nm = mean + delta * rcp
        nm2 = m2 + delta * (v - nm)
    return tl.where(valid, nm, mean), tl.where(valid, nm2, m2), tl.where(valid, c_new, cnt)


@jit
def _welford_combine(mB, sB, cB, mA, sA, cA, MEAN_V: tl.constexpr, SIG_FMA: tl.constexpr):
    delta = mB - mA
    count = cA + cB
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
    pos = count > 0.0
    return tl.where(pos, mean, 0.0), tl.where(pos, m2, 0.0), count


@jit
def _halves(v, R: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
    """[R, G, 2H] -> (v[..., :H], v[..., H:]), as sums over a size-2 axis with the
    other half zeroed (exact; lowers to warp shuffles, where a permute + split
    went through shared memory and replicated the tree in every thread)."""
    v4 = tl.reshape(v, [R, G, 2, H])
    upper = (tl.arange(0, 2) == 1)[None, None, :, None]
    lo = tl.sum(tl.where(upper, 0.0, v4), axis=2)
    hi = tl.sum(tl.where(upper, v4, 0.0), axis=2)
    return lo, hi


@_row_kernel
def _layer_norm_modulate_exact_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr,
    n_rows, S,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    eps, fD,
    D: tl.constexpr,
    WELFORD_FMA: tl.constexpr,
    MEAN_V: tl.constexpr,
    SIG_FMA: tl.constexpr,
    KEEP: tl.constexpr,
    RSQRT_ASM: tl.constexpr,
    R: tl.constexpr,
):
    L: tl.constexpr = 128
    NV: tl.constexpr = D // 4
    NJ: tl.constexpr = (NV + L - 1) // L
    rows = tl.program_id(0) * R + tl.arange(0, R)
    r64 = rows.to(tl.int64)
    b = r64 // S
    s = r64 - b * S
    rmask = rows < n_rows
    lane = tl.arange(0, L)
    within = (lane * 4)[:, None] + tl.arange(0, 4)[None, :]
    x_base = (b * x_sb + s * x_ss)[:, None, None]
    c_base = (b * c_sb + s * c_ss)[:, None, None]
    h_base = (b * h_sb + s * h_ss)[:, None, None]
    o_base = (r64 * D)[:, None, None]
    dtype = out_ptr.dtype.element_ty

    # pass 1: per-thread Welford, serial over the thread's vectors and their lanes
    mean = tl.zeros([R, L], tl.float32)
    m2 = tl.zeros([R, L], tl.float32)
    cnt = tl.zeros([R, L], tl.float32)
    xs = ()
    for j in tl.static_range(NJ):
        col = (j * 4 * L + within)[None, :, :]
        vvec = (j * L + lane) < NV
        m = rmask[:, None, None] & vvec[None, :, None]
        xc = tl.load(x_ptr + (x_base + col), mask=m, other=0.0, eviction_policy="evict_last")
        if KEEP:
            xs = xs + (xc,)
        ev, od = tl.split(tl.reshape(xc.to(tl.float32), [R, L, 2, 2]))
        e0, e2 = tl.split(ev)
        e1, e3 = tl.split(od)
        valid = vvec[None, :]
        mean, m2, cnt = _welford_step(e0, mean, m2, cnt, valid, tl.full([], 4 * j + 1, tl.float32), WELFORD_FMA)
        mean, m2, cnt = _welford_step(e1, mean, m2, cnt, valid, tl.full([], 4 * j + 2, tl.float32), WELFORD_FMA)
        mean, m2, cnt = _welford_step(e2, mean, m2, cnt, valid, tl.full([], 4 * j + 3, tl.float32), WELFORD_FMA)
        mean, m2, cnt = _welford_step(e3, mean, m2, cnt, valid, tl.full([], 4 * j + 4, tl.float32), WELFORD_FMA)

    # warp shuffle-down tree (offsets 16..1), combine(B=own, A=other)
    mean = tl.reshape(mean, [R, 4, 32])
    m2 = tl.reshape(m2, [R, 4, 32])
    cnt = tl.reshape(cnt, [R, 4, 32])
    for i in tl.static_range(5):
        mlo, mhi = _halves(mean, R, 4, 16 >> i)
        slo, shi = _halves(m2, R, 4, 16 >> i)
        clo, chi = _halves(cnt, R, 4, 16 >> i)
        mean, m2, cnt = _welford_combine(mlo, slo, clo, mhi, shi, chi, MEAN_V, SIG_FMA)
    # across warps: (w0, w2), (w1, w3), then (w0, w1)
    mlo, mhi = _halves(tl.reshape(mean, [R, 1, 4]), R, 1, 2)
    slo, shi = _halves(tl.reshape(m2, [R, 1, 4]), R, 1, 2)
    clo, chi = _halves(tl.reshape(cnt, [R, 1, 4]), R, 1, 2)
    mean, m2, cnt = _welford_combine(mlo, slo, clo, mhi, shi, chi, MEAN_V, SIG_FMA)
    mlo, mhi = _halves(mean, R, 1, 1)
    slo, shi = _halves(m2, R, 1, 1)
    clo, chi = _halves(cnt, R, 1, 1)
    mean, m2, cnt = _welford_combine(mlo, slo, clo, mhi, shi, chi, MEAN_V, SIG_FMA)
    mean = tl.reshape(mean, [R])
    rstd = _rsqrt(tl.math.div_rn(tl.reshape(m2, [R]), fD) + eps, RSQRT_ASM)
    mean3 = mean[:, None, None]
    rstd3 = rstd[:, None, None]

    # pass 2: normalise, modulate with eager's three roundings, store
    for j in tl.static_range(NJ):
        col = (j * 4 * L + within)[None, :, :]
        m = rmask[:, None, None] & ((j * L + lane) < NV)[None, :, None]
        if KEEP:
            xc = xs[j]
        else:
            xc = tl.load(x_ptr + (x_base + col), mask=m, other=0.0, eviction_policy="evict_first")
        n = (rstd3 * (xc.to(tl.float32) - mean3)).to(dtype).to(tl.float32)
        scale = tl.load(scale_ptr + (c_base + col * c_sd), mask=m, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + (h_base + col * h_sd), mask=m, other=0.0).to(tl.float32)
        t = (1.0 + scale).to(dtype).to(tl.float32)
        p = (n * t).to(dtype).to(tl.float32)
        tl.store(out_ptr + (o_base + col), (p + shift).to(dtype), mask=m)


@_row_kernel
def _layer_norm_modulate_high_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr,
    n_rows, S, D,
    x_sb, x_ss,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    eps, inv_d,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    r64 = rows.to(tl.int64)
    b = r64 // S
    s = r64 - b * S
    cols = tl.arange(0, BLOCK_D)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(
        x_ptr + ((b * x_sb + s * x_ss)[:, None] + cols[None, :]), mask=m, other=0.0,
        eviction_policy="evict_first",
    ).to(tl.float32)
    mean = tl.sum(x, axis=1) * inv_d
    xc = tl.where(m, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) * inv_d + eps)
    scale = tl.load(scale_ptr + ((b * c_sb + s * c_ss)[:, None] + cols[None, :] * c_sd), mask=m, other=0.0)
    shift = tl.load(shift_ptr + ((b * h_sb + s * h_ss)[:, None] + cols[None, :] * h_sd), mask=m, other=0.0)
    y = (xc * rstd[:, None]) * (1.0 + scale.to(tl.float32)) + shift.to(tl.float32)
    tl.store(out_ptr + ((r64 * D)[:, None] + cols[None, :]), y.to(out_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------- launcher


class LayerNormModulatePlan:
    """A call that passed the guard: operands, geometry and the gate key."""

    __slots__ = ("x", "scale", "shift", "rows", "c_strides", "h_strides", "eps", "key")

    def __init__(self, x, scale, shift, rows, c_strides, h_strides, eps, key):
        self.x, self.scale, self.shift = x, scale, shift
        self.rows, self.c_strides, self.h_strides = rows, c_strides, h_strides
        self.eps, self.key = eps, key


def plan_layer_norm_modulate(x, scale, shift, eps, exact: bool = True):
    """The guard: a plan for the kernel, or the reason the call takes the reference."""
    return _plan(x, scale, shift, eps, exact)


def _plan(x, scale, shift, eps, exact, cpu_ok=False):
    checked = _check_operands(x, scale, shift, cpu_ok=cpu_ok)
    if isinstance(checked, str):
        return checked
    rows, c, h = checked
    D = rows.D
    if D > MAX_D:
        return f"D={D} > {MAX_D}: row too wide for the register-resident kernels"
    if exact:
        if D % 4:
            return f"D={D} is not a multiple of 4 (aten takes RowwiseMomentsCUDAKernel)"
        if x.is_contiguous() and x.data_ptr() % (4 * x.element_size()):
            return "x is not 4-element aligned (aten takes RowwiseMomentsCUDAKernel)"
    key = (x.dtype, x.device.index, layout_class(c, scale), layout_class(h, shift), "layer_norm", f"D={D}")
    return LayerNormModulatePlan(x, scale, shift, rows, c, h, float(eps), key)


def exact_launch_shape(plan, elem_bytes: int) -> tuple[int, int]:
    """(R, num_warps) for the exact kernel."""
    return 1, 4


def launch_layer_norm_modulate(plan, exact: bool = True, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan. `config` overrides
    (R, num_warps, keep) in exact mode, (R, num_warps) in high mode."""
    x, r = plan.x, plan.rows
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = r.B * r.S
    if exact:
        if config:
            R, num_warps, keep = (tuple(config) + (True,))[:3]
        else:
            (R, num_warps), keep = exact_launch_shape(plan, x.element_size()), KEEP
        _layer_norm_modulate_exact_kernel[(cdiv(n_rows, R),)](
            x, plan.scale, plan.shift, out,
            n_rows, r.S, r.sb, r.ss,
            *plan.c_strides, *plan.h_strides,
            plan.eps, float(r.D),
            D=r.D, WELFORD_FMA=WELFORD_FMA, MEAN_V=MEAN_V, SIG_FMA=SIG_FMA,
            KEEP=keep, RSQRT_ASM=RSQRT_ASM and not INTERPRET, R=R,
            num_warps=num_warps, enable_fp_fusion=False,
        )
    else:
        block_d = triton.next_power_of_2(r.D)
        R, num_warps = config or high_launch_shape(block_d, n_rows, x.element_size())
        _layer_norm_modulate_high_kernel[(cdiv(n_rows, R),)](
            x, plan.scale, plan.shift, out,
            n_rows, r.S, r.D, r.sb, r.ss,
            *plan.c_strides, *plan.h_strides,
            plan.eps, 1.0 / r.D,
            R=R, BLOCK_D=block_d, num_warps=num_warps,
        )
    return out


def layer_norm_modulate(x, scale, shift, eps: float, *, exact: bool = True) -> torch.Tensor:
    """Guarded, ungated: the kernel where eligible, else the eager reference."""
    plan = plan_layer_norm_modulate(x, scale, shift, eps, exact)
    if isinstance(plan, str):
        return layer_norm_modulate_reference(x, scale, shift, eps)
    return launch_layer_norm_modulate(plan, exact)


# ---------------------------------------------------------------- torch.library


@torch.library.custom_op("bitfuse::layer_norm_modulate", mutates_args=())
def layer_norm_modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """Opaque op for torch.compile graphs and capture (exact mode; eager callers
    launch directly: this boundary costs tens of microseconds a call)."""
    return layer_norm_modulate(x, scale, shift, eps)


@layer_norm_modulate_op.register_fake
def _(x, scale, shift, eps):
    return layer_norm_modulate_reference(x, scale, shift, eps)


# ---------------------------------------------------------------- reference


def layer_norm_modulate_reference(x, scale, shift, eps: float) -> torch.Tensor:
    return modulate_reference(F.layer_norm(x, (x.shape[-1],), eps=eps), scale, shift)
