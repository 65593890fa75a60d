"""Query/key RMSNorm (with its weight) + RoPE, fused: the attention prologue of
LTX-2, FLUX.1 and Qwen-Image, query and key in one launch.

What eager computes (diffusers 0.42.1), per source of queries/keys:

    q = norm_q(q); k = norm_k(k)          (per row of NW channels)
    q = rope(q, q_freqs); k = rope(k, k_freqs)
    joint sources: torch.cat([txt, img], dim=1) (FLUX: before its RoPE, Qwen: after)

Layouts: x is [B, S, C] with the norm over all C channels (LTX-2: NW = C, one
row a token), or [B, S, H, D] with the norm per head (FLUX, Qwen: NW = D, H
rows a token). The last dimension must be contiguous; other strides are read in
place (the projections' outputs may be views of a fused qkv).

NORMS (`norm=`), each reproduced with its reduction ORDER (fp32 sums in the
reference kernel's thread order, see `rms_norm_modulate`'s docstring):
- "aten": `torch.nn.RMSNorm` / `F.rms_norm(x, (NW,), weight, eps)`, aten's
  `_fused_rms_norm` (vectorized_layer_norm_kernel, rms_norm=true): sum of
  squares over 128 threads a row (fma-serial over float4 vectors, warp
  shuffle-down, (w0 + w2) + (w1 + w3)), rstd = rsqrtf(sigma2 / NW + eps), then
  `gamma * (rstd * x)` in fp32 (two products, no add to contract), rounded
  once. Rows of at most 32 float4 vectors (NW <= 128) live in warp 0: the
  other warps add exact zeros. The vectorized path needs NW % 4 == 0, x and
  gamma 4-element aligned (a contiguous x elsewhere takes
  RowwiseMomentsCUDAKernel; a strided x is copied, aligned) and of one dtype
  (else aten takes its composite path).
- "diffusers": diffusers' `RMSNorm`: v = x.float().pow(2).mean(-1) (aten's
  reduce_kernel<MeanOps>, `mean_reduce_config`), h = x * rsqrt(v + eps) in
  fp32; with a bf16/fp16 weight `h.to(weight.dtype) * weight` (two roundings),
  fp32: `h * weight`; without weight `h.to(x.dtype)`. Rows of D <= 128 floats
  are not vectorised by setReduceConfig (lane t sums x[t + m * bw] into
  accumulator m % 4); D = 128 sits on its threshold, `dim0 > 128` in some
  torch versions and `dim0 >= 128` in others: `mean_order_128` probes the
  running build once per device (its per-row means against plain-torch
  emulations of both orders).

ROPE (`rope_type=`), eager's fp32 products and sums, each rounded:
- "interleaved" (LTX-2.0 [B, S, C] cos/sin [B|1, S, C]; FLUX [B, S, H, D] with
  cos/sin [S, D]): pairs (x[2i], x[2i+1]), out = x * cos + x_rot * sin with
  x_rot = (-x[2i+1], x[2i]).
- "pairs" (x [B, S, C], cos/sin [B|1, S, C/2]): "interleaved" with the tables
  `cos.repeat_interleave(2, -1)`, `sin.repeat_interleave(2, -1)`, which is how
  LTX-2.0's RoPE module builds them: (a*c - b*s, b*c + a*s) for the pair (a, b)
  and its frequency (c, s), each product rounded. The same rotation from half the
  table bytes (the tables are half of LTX-2.0's q/k kernel's reads).
- "split" (LTX-2.3, cos/sin [B, H, S, r]): each head's halves rotate; aten's
  `addcmul_` is one FMA or not per build (`rotary.addcmul_fuses`).
- "complex" (Qwen-Image, freqs complex64 [S, D/2]): view_as_complex(x) * freqs:
  (a*c - b*d, a*d + b*c), where nvcc may contract either product into an FMA;
  `complex_mul_form` probes the build once per device (inputs whose products
  round differently in each form) and the kernel follows it.
- "wan" (Wan, x [B, S, H * Dh], cos/sin [B|1, S, 1, Dh] fp32, or float64):
  `apply_rotary_emb` of WanAttnProcessor: pairs (x[2i], x[2i+1]) of each head
  with c = cos[2i], s = sin[2i+1]: (a*c - b*s, a*s + b*c), products and sums
  in the tables' dtype (x promoted), each rounded, written into x's dtype
  (from float64: through fp32 or not as `f64_store_via_f32` probes).
- None: the norms alone.
Triton's unary minus is `0 - x` (loses eager's -0.0): negations are `x * -1.0`.
Kernels launch with FMA contraction off; an FMA appears only where the
reference contracts.

One launch: every program handles RU rows of one segment (a query or key
source); a query and a key of the same length alternate program by program,
so the key's program reads the frequencies the query's just brought to L2.
Pass 1 reads the rows in the reference's thread order for the statistic; pass
2 re-reads them (L2) in wide tiles, normalises, rotates and stores, each
source at its offset in the concatenated output.

Exact in every tier (memory-bound: fewer roundings buy nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cases
from ._launch import (
    HAS_TRITON,
    FastLaunch,
    GeometryCache,
    Output,
    Recipe,
    cdiv,
    contiguous_strides,
    device_index,
    inference_only,
    jit,
    next_pow2,
    probe_allowed,
    row_kernel,
    tl,
)
from ._norm import MAX_D, dummy_stats, rsqrt
from ._params import common_device_dtype
from .rms_norm_modulate import WARP_INC, mean_factor, mean_reduce_config
from .rotary import addcmul_fuses, rotary_reference
from .spec import OpSpec

NORMS = ("aten", "diffusers")
ROPE_TYPES = ("interleaved", "pairs", "split", "complex", "wan")
MAX_SEGMENTS = 4  # (query, key) x two sources

_ROPE_CODE = {None: 0, "interleaved": 1, "split": 2, "complex": 3, "wan": 4, "pairs": 5}

# ---------------------------------------------------------------- kernel


@jit
def _warp_tree(v, RU: tl.constexpr, INC: tl.constexpr):
    """[RU, 32] -> [RU]: warp shuffle-down, offsets 16..1 (INC: 1..16); each step one add."""
    for i in tl.static_range(5):
        if INC:
            v = tl.sum(tl.reshape(v, [RU, 16 >> i, 2]), axis=2)
        else:
            v = tl.sum(tl.reshape(v, [RU, 2, 16 >> i]), axis=1)
    return tl.reshape(v, [RU])


@jit
def _row_stat(x_ptr, x_row, umask, eps, factor, fD, NW: tl.constexpr, REF: tl.constexpr, LANES: tl.constexpr,
              XSTEPS: tl.constexpr, WARP_INC: tl.constexpr, RU: tl.constexpr):
    """The per-row statistic and its rsqrt, summed in the reference's order (module docstring)."""
    lane = tl.arange(0, LANES)
    NV: tl.constexpr = NW // 4
    if REF == 2:  # diffusers, scalar loads: lane t holds x[t + m * LANES] in accumulator m % 4
        a0 = tl.zeros([RU, LANES], tl.float32)
        a1 = tl.zeros([RU, LANES], tl.float32)
        a2 = tl.zeros([RU, LANES], tl.float32)
        a3 = tl.zeros([RU, LANES], tl.float32)
        for m in tl.static_range((NW + LANES - 1) // LANES):
            col = m * LANES + lane
            msk = umask[:, None] & (col < NW)[None, :]
            xf = tl.load(x_ptr + (x_row[:, None] + col[None, :]), mask=msk, other=0.0).to(tl.float32)
            if m % 4 == 0:
                a0 = a0 + xf * xf
            elif m % 4 == 1:
                a1 = a1 + xf * xf
            elif m % 4 == 2:
                a2 = a2 + xf * xf
            else:
                a3 = a3 + xf * xf
        v = ((a0 + a1) + a2) + a3
    else:  # float4 vectors t, t + LANES, ... per lane
        within = (lane * 4)[:, None] + tl.arange(0, 4)[None, :]  # [LANES, 4]
        if REF == 0:
            acc = tl.zeros([RU, LANES, 4], tl.float32)
        else:
            acc = tl.zeros([RU, LANES], tl.float32)
        for j in tl.static_range((NV + LANES - 1) // LANES):
            col = (j * 4 * LANES + within)[None, :, :]
            msk = umask[:, None, None] & ((j * LANES + lane) < NV)[None, :, None]
            xf = tl.load(x_ptr + (x_row[:, None, None] + col), mask=msk, other=0.0).to(tl.float32)
            if REF == 0:  # diffusers: four accumulators, one per position in the vector
                acc = acc + xf * xf
            else:  # aten: one accumulator, sigma2 = fma(v, v, sigma2) in vector order
                ev, od = tl.split(tl.reshape(xf, [RU, LANES, 2, 2]))
                e0, e2 = tl.split(ev)
                e1, e3 = tl.split(od)
                acc = tl.fma(e0, e0, acc)
                acc = tl.fma(e1, e1, acc)
                acc = tl.fma(e2, e2, acc)
                acc = tl.fma(e3, e3, acc)
        if REF == 0:
            ev, od = tl.split(tl.reshape(acc, [RU, LANES, 2, 2]))
            c0, c2 = tl.split(ev)
            c1, c3 = tl.split(od)
            v = ((c0 + c1) + c2) + c3
        else:
            v = acc
    if REF == 1:
        if LANES == 128:  # warps 0..3, then (w0 + w2) + (w1 + w3) through shared memory
            w = tl.reshape(v, [RU, 4, 32])
            for i in tl.static_range(5):
                w = tl.sum(tl.reshape(w, [RU, 4, 2, 16 >> i]), axis=2)
            w = tl.sum(tl.reshape(w, [RU, 2, 2]), axis=1)
            total = tl.sum(w, axis=1)
        else:  # LANES == 32: the row lives in warp 0
            total = _warp_tree(v, RU, False)
        stat = tl.math.div_rn(total, fD)
    else:
        for i in tl.static_range(XSTEPS):  # shared-memory halving: (t, t + o)
            v = tl.sum(tl.reshape(v, [RU, 2, LANES >> (i + 1)]), axis=1)
        stat = _warp_tree(v, RU, WARP_INC) * factor
    return stat, rsqrt(stat + eps, False)


@jit
def _normed(x, r, w, dtype: tl.constexpr, WEIGHT: tl.constexpr, REF: tl.constexpr):
    """The norm's output from fp32 x and its row's rsqrt r, in `dtype`."""
    t = x * r
    if WEIGHT:
        if REF == 1:  # aten: gamma * (rstd * x), rounded once
            t = w * t
        else:  # diffusers: (x * r).to(weight dtype) * weight
            t = t.to(dtype).to(tl.float32) * w
    return t.to(dtype)


@jit
def _rotate(a, b, ca, sa, cb, sb, REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr):
    """(a * ca - b * sa, b * cb + a * sb) in fp32 with eager's roundings. REAL_FMA 1:
    fma(a, ca, -(b * sa)), 2: fma(-b, sa, a * ca); IMAG_FMA 1: fma(a, sb, b * cb),
    2: fma(b, cb, a * sb); 0: both products rounded. (x - y is x + (-y) in IEEE,
    zeros included, so `-` needs no negation.)"""
    if REAL_FMA == 1:
        oa = tl.fma(a, ca, (b * sa) * -1.0)
    elif REAL_FMA == 2:
        oa = tl.fma(b * -1.0, sa, a * ca)
    else:
        oa = a * ca - b * sa
    if IMAG_FMA == 1:
        ob = tl.fma(a, sb, b * cb)
    elif IMAG_FMA == 2:
        ob = tl.fma(b, cb, a * sb)
    else:
        ob = b * cb + a * sb
    return oa, ob


@jit
def _segment_tile(
    x_ptr, w_ptr, c_ptr, s_ptr, o_ptr, stats_ptr,
    t, b, S, x_sb, x_ss, x_sg, f_sb, f_sh, f_ss, f_sj, o_S, o_tok0, stat0, write_stats,
    eps, factor, fD,
    G: tl.constexpr, NW: tl.constexpr, REF: tl.constexpr, LANES: tl.constexpr, XSTEPS: tl.constexpr,
    WARP_INC: tl.constexpr, RU: tl.constexpr, CH: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
    REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr, WEIGHT: tl.constexpr,
):
    """RU rows (token s, head g; u = s * G + g) of sample b: normed, rotated, stored."""
    u = t * RU + tl.arange(0, RU)
    umask = u < S * G
    s = (u // G).to(tl.int64)
    g = (u % G).to(tl.int64)
    x_row = b * x_sb + s * x_ss + g * x_sg
    stat, r = _row_stat(x_ptr, x_row, umask, eps, factor, fD, NW, REF, LANES, XSTEPS, WARP_INC, RU)
    smask = umask & (tl.full([RU], write_stats, tl.int32) != 0)
    srow = stat0 + b * S * G + u
    tl.store(stats_ptr + srow * 2, stat, mask=smask)
    tl.store(stats_ptr + srow * 2 + 1, r, mask=smask)

    dtype = o_ptr.dtype.element_ty
    o_row = ((b * o_S + o_tok0 + s) * G + g) * NW
    f_row = b * f_sb + s * f_ss
    r2 = r[:, None]
    HALF: tl.constexpr = CH // 2
    for ch in tl.static_range((NW + CH - 1) // CH):
        if ROPE == 2:  # split: pair p is channel j of head h's halves (x[h*2R + j], x[h*2R + R + j])
            p = ch * HALF + tl.arange(0, HALF)
            pok = p < NW // 2
            pm = umask[:, None] & pok[None, :]
            hh = p // R
            jj = p % R
            col_a = hh * (2 * R) + jj
            col_b = col_a + R
            xa = tl.load(x_ptr + (x_row[:, None] + col_a[None, :]), mask=pm, other=0.0).to(tl.float32)
            xb = tl.load(x_ptr + (x_row[:, None] + col_b[None, :]), mask=pm, other=0.0).to(tl.float32)
            wa = xa
            wb = xb
            if WEIGHT:
                wa = tl.load(w_ptr + col_a, mask=pok, other=0.0).to(tl.float32)[None, :]
                wb = tl.load(w_ptr + col_b, mask=pok, other=0.0).to(tl.float32)[None, :]
            na = _normed(xa, r2, wa, dtype, WEIGHT, REF).to(tl.float32)
            nb = _normed(xb, r2, wb, dtype, WEIGHT, REF).to(tl.float32)
            f_off = f_row[:, None] + (hh * f_sh + jj * f_sj)[None, :]
            c = tl.load(c_ptr + f_off, mask=pm, other=0.0)
            sn = tl.load(s_ptr + f_off, mask=pm, other=0.0)
            oa, ob = _rotate(na, nb, c, sn, c, sn, REAL_FMA, IMAG_FMA)
            tl.store(o_ptr + (o_row[:, None] + col_a[None, :]), oa.to(dtype), mask=pm)
            tl.store(o_ptr + (o_row[:, None] + col_b[None, :]), ob.to(dtype), mask=pm)
        else:
            cols = ch * CH + tl.arange(0, CH)
            cok = cols < NW
            m = umask[:, None] & cok[None, :]
            xf = tl.load(x_ptr + (x_row[:, None] + cols[None, :]), mask=m, other=0.0).to(tl.float32)
            w = xf
            if WEIGHT:
                w = tl.load(w_ptr + cols, mask=cok, other=0.0).to(tl.float32)[None, :]
            n = _normed(xf, r2, w, dtype, WEIGHT, REF)
            if ROPE == 0:
                out = n
            else:
                a, bb = tl.split(tl.reshape(n.to(tl.float32), [RU, HALF, 2]))
                if ROPE == 4:  # Wan: cos[2i], sin[2i + 1] of the head's channel, products and sums in the
                    # frequencies' dtype (REAL_FMA 1: fp64), then to x's dtype (IMAG_FMA 1: through fp32)
                    f_off = f_row[:, None] + ((cols % R) * f_sj)[None, :]
                    ca, _unused = tl.split(tl.reshape(tl.load(c_ptr + f_off, mask=m, other=0.0), [RU, HALF, 2]))
                    _unused, sb = tl.split(tl.reshape(tl.load(s_ptr + f_off, mask=m, other=0.0), [RU, HALF, 2]))
                    if REAL_FMA == 1:
                        a = a.to(tl.float64)
                        bb = bb.to(tl.float64)
                    oa, ob = _rotate(a, bb, ca, sb, ca, sb, 0, 0)
                    o = tl.reshape(tl.join(oa, ob), [RU, CH])
                    if IMAG_FMA == 1:
                        o = o.to(tl.float32)
                    out = o.to(dtype)
                elif ROPE == 1:  # a frequency per channel
                    f_off = f_row[:, None] + (cols * f_sj)[None, :]
                    ca, cb = tl.split(tl.reshape(tl.load(c_ptr + f_off, mask=m, other=0.0), [RU, HALF, 2]))
                    sa, sb = tl.split(tl.reshape(tl.load(s_ptr + f_off, mask=m, other=0.0), [RU, HALF, 2]))
                else:  # complex (3), pairs (5): a frequency per pair
                    p = ch * HALF + tl.arange(0, HALF)
                    pm = umask[:, None] & (p < NW // 2)[None, :]
                    f_off = f_row[:, None] + (p * f_sj)[None, :]
                    ca = tl.load(c_ptr + f_off, mask=pm, other=0.0)
                    sa = tl.load(s_ptr + f_off, mask=pm, other=0.0)
                    cb = ca
                    sb = sa
                if ROPE != 4:
                    oa, ob = _rotate(a, bb, ca, sa, cb, sb, REAL_FMA, IMAG_FMA)
                    out = tl.reshape(tl.join(oa, ob), [RU, CH]).to(dtype)
            tl.store(o_ptr + (o_row[:, None] + cols[None, :]), out, mask=m)


@row_kernel("S0", "S1", "S2", "S3", "oS0", "oS1", "oS2", "oS3", "tok0", "tok1", "tok2", "tok3",
            "st0", "st1", "st2", "st3", "P1", "P2", "P3", "write_stats")
def _qk_norm_rope_kernel(
    x0, w0, c0, s0, o0, x1, w1, c1, s1, o1, x2, w2, c2, s2, o2, x3, w3, c3, s3, o3, stats_ptr,
    S0, xb0, xs0, xg0, fb0, fh0, fs0, fj0, oS0, tok0, st0,
    S1, xb1, xs1, xg1, fb1, fh1, fs1, fj1, oS1, tok1, st1,
    S2, xb2, xs2, xg2, fb2, fh2, fs2, fj2, oS2, tok2, st2,
    S3, xb3, xs3, xg3, fb3, fh3, fs3, fj3, oS3, tok3, st3,
    P1, P2, P3, write_stats, eps, factor, fD,
    NSEG: tl.constexpr, MEMBERS: tl.constexpr,
    G: tl.constexpr, NW: tl.constexpr, REF: tl.constexpr, LANES: tl.constexpr, XSTEPS: tl.constexpr,
    WARP_INC: tl.constexpr, RU: tl.constexpr, CH: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
    REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr, WEIGHT: tl.constexpr,
):
    # programs: groups of MEMBERS segments (a query and its key alternate), groups
    # starting at programs 0, P1, P2, P3; grid axis 1 is the sample
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    group = (pid >= P1).to(tl.int32) + (pid >= P2).to(tl.int32) + (pid >= P3).to(tl.int32)
    start = tl.where(group == 0, 0, tl.where(group == 1, P1, tl.where(group == 2, P2, P3)))
    local = pid - start
    seg = group * MEMBERS + local % MEMBERS
    t = local // MEMBERS
    if seg == 0:
        _segment_tile(x0, w0, c0, s0, o0, stats_ptr, t, b, S0, xb0, xs0, xg0, fb0, fh0, fs0, fj0, oS0, tok0, st0,
                      write_stats, eps, factor, fD, G, NW, REF, LANES, XSTEPS, WARP_INC, RU, CH, ROPE, R,
                      REAL_FMA, IMAG_FMA, WEIGHT)
    if NSEG > 1:
        if seg == 1:
            _segment_tile(x1, w1, c1, s1, o1, stats_ptr, t, b, S1, xb1, xs1, xg1, fb1, fh1, fs1, fj1, oS1, tok1,
                          st1, write_stats, eps, factor, fD, G, NW, REF, LANES, XSTEPS, WARP_INC, RU, CH, ROPE, R,
                          REAL_FMA, IMAG_FMA, WEIGHT)
    if NSEG > 2:
        if seg == 2:
            _segment_tile(x2, w2, c2, s2, o2, stats_ptr, t, b, S2, xb2, xs2, xg2, fb2, fh2, fs2, fj2, oS2, tok2,
                          st2, write_stats, eps, factor, fD, G, NW, REF, LANES, XSTEPS, WARP_INC, RU, CH, ROPE, R,
                          REAL_FMA, IMAG_FMA, WEIGHT)
    if NSEG > 3:
        if seg == 3:
            _segment_tile(x3, w3, c3, s3, o3, stats_ptr, t, b, S3, xb3, xs3, xg3, fb3, fh3, fs3, fj3, oS3, tok3,
                          st3, write_stats, eps, factor, fD, G, NW, REF, LANES, XSTEPS, WARP_INC, RU, CH, ROPE, R,
                          REAL_FMA, IMAG_FMA, WEIGHT)


_CONSTS = ("NSEG", "MEMBERS", "G", "NW", "REF", "LANES", "XSTEPS", "WARP_INC", "RU", "CH", "ROPE", "R",
           "REAL_FMA", "IMAG_FMA", "WEIGHT")
_launch_kernel = FastLaunch(_qk_norm_rope_kernel, _CONSTS)


# ---------------------------------------------------------------- probes of the running build

_COMPLEX_FORM: dict = {}
_MEAN_128: dict = {}


def complex_mul_form(device) -> tuple[int, int] | None:
    """How eager's complex64 multiply (x * f as Qwen-Image's RoPE calls it) rounds on
    this device (a CUDA index, or -1 for the CPU): (REAL_FMA, IMAG_FMA) as `_rotate`
    takes them, or None where no form matched (or it can't be probed now: tracing,
    capture). With u = 1 + 2**-12 and w = 1 + 2**-13, fl(u*u) drops 2**-24 (a tie) and
    fl(w*w) drops 2**-26, so u*u - w*w is 2**-12 with both products rounded,
    2**-12 + 2**-24 with u*u inside an FMA, 2**-12 - 2**-26 with w*w inside; a third
    element (1 + 1i)(1 + 1i) must give a real part of +0.0 in all three forms."""
    device = device_index(device)
    known = _COMPLEX_FORM.get(device, False)
    if known is not False:
        return known
    if not probe_allowed(device):
        return None
    u, w = 1 + 2**-12, 1 + 2**-13
    x = torch.tensor([[u, w], [u, w], [1.0, 1.0]], dtype=torch.float32)
    f = torch.tensor([[u, w], [-w, u], [1.0, 1.0]], dtype=torch.float32)
    dev = "cpu" if device < 0 else f"cuda:{device}"
    # shaped as Qwen-Image multiplies: x [B, S, H, D/2] by freqs [S, 1, D/2]
    xc = torch.view_as_complex(x.to(dev)).reshape(1, 3, 1, 1).expand(1, 3, 2, 1).contiguous()
    fc = torch.view_as_complex(f.to(dev)).reshape(3, 1, 1)
    prod = torch.view_as_real(xc * fc).cpu().reshape(3, 2, 2)  # [element, head, (real, imaginary)]
    forms = {2.0**-12: 0, 2.0**-12 + 2.0**-24: 1, 2.0**-12 - 2.0**-26: 2}
    real, imag, zero = float(prod[0, 0, 0]), float(prod[1, 0, 1]), prod[2, 0, 0]
    same_heads = torch.equal(prod[:, 0], prod[:, 1])
    ok = real in forms and imag in forms and zero.item() == 0 and not torch.signbit(zero) and same_heads
    result = (forms[real], forms[imag]) if ok else None
    _COMPLEX_FORM[device] = result
    return result


_VIA_F32: dict = {}


def f64_store_via_f32(device) -> bool | None:
    """Whether eager's float64 -> bf16 copy on this device (a CUDA index, or -1 for the
    CPU) rounds through fp32 (c10::BFloat16 converts from float: two roundings) rather
    than once. Probed once per device with 1 + 2**-8 + 2**-30: through fp32 it is the
    tie 1 + 2**-8, which rounds to even (1.0); rounded once it is above the tie (1 +
    2**-7); fp16 likewise with 1 + 2**-11 + 2**-40. None where neither (or not now:
    tracing, capture)."""
    device = device_index(device)
    if device in _VIA_F32:
        return _VIA_F32[device]
    if not probe_allowed(device):
        return None
    dev = "cpu" if device < 0 else f"cuda:{device}"
    d = torch.tensor([1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40], dtype=torch.float64, device=dev)
    b, h = d[0:1].to(torch.bfloat16).item(), d[1:2].to(torch.float16).item()
    if b == 1.0 and h == 1.0:
        result = True
    elif b == 1 + 2**-7 and h == 1 + 2**-10:
        result = False
    else:
        result = None
    _VIA_F32[device] = result
    return result


def _emulated_means_128(x: torch.Tensor) -> dict:
    """The diffusers mean of [N, 128] fp32 rows in each candidate order (vectorised
    loads or not, warp offsets decreasing or not), plain torch fp32 adds (N >= 16)."""
    N = x.shape[0]
    sq = x * x
    out = {}
    for vec in (True, False):
        lanes = sq.view(N, 32, 4) if vec else sq.view(N, 4, 32).transpose(1, 2)  # [N, lane, accumulator]
        a = ((lanes[..., 0] + lanes[..., 1]) + lanes[..., 2]) + lanes[..., 3]
        for inc in (False, True):
            v = a
            while v.shape[1] > 1:
                h = v.shape[1] // 2
                v = v[:, 0::2] + v[:, 1::2] if inc else v[:, :h] + v[:, h:]
            out[(vec, inc)] = v[:, 0] * mean_factor(N, 128)
    return out


def mean_order_128(device) -> tuple[bool, bool] | None:
    """(vectorised, warp offsets increasing) of eager `x.float().pow(2).mean(-1)` over
    rows of 128 floats on this device, found by comparing its per-row means with the
    emulation of each candidate order; None where not exactly one matched (or it
    can't be probed now)."""
    device = device_index(device)
    known = _MEAN_128.get(device, False)
    if known is not False:
        return known
    if not probe_allowed(device):
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g) * torch.rand(512, 1, generator=g).mul(8).exp2()
    got = x.to("cpu" if device < 0 else f"cuda:{device}").pow(2).mean(-1).cpu()
    matches = [k for k, v in _emulated_means_128(x).items() if torch.equal(v, got)]
    result = matches[0] if len(matches) == 1 else None
    _MEAN_128[device] = result
    return result


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _scalar_mean_config(D: int, N: int) -> int:
    """setReduceConfig's block width for mean(-1) of [N, D] fp32 rows it does not
    vectorise (D <= 128): dim0 = D, dim1 = N, 512 threads, 32-lane warps."""
    dim0_p2 = _last_pow2(D)
    dim1_p2 = _last_pow2(N) if N < 512 else 512
    bw = min(dim0_p2, 32)
    bh = min(dim1_p2, 512 // bw)
    return min(dim0_p2, 512 // bh)


# ---------------------------------------------------------------- planner


class QKNormRopePlan:
    """A call that passed the guard: operands, cached geometry, reduction order, RoPE
    form, gate key."""

    __slots__ = ("xs", "ws", "fs", "geometry", "order", "rope", "eps", "key")

    def __init__(self, xs, ws, fs, geometry, order, rope, eps, key):
        self.xs, self.ws, self.fs = xs, ws, fs  # per segment (queries, then keys): x, weight or None, (cos, sin) or None
        self.geometry = geometry
        self.order = order  # (REF, LANES, XSTEPS, WARP_INC, factor)
        self.rope = rope  # (ROPE, R, REAL_FMA, IMAG_FMA)
        self.eps = eps
        self.key = key


class _Geometry:
    """What a layout decides, computed once per layout (`_geometry`): sizes, each
    segment's integers, the outputs' shapes, the reduction order where no probe is
    involved, and the launch recipes built for it."""

    __slots__ = ("B", "G", "NW", "n", "members", "tiles", "seg_ints", "outputs", "order", "key", "recipes")

    def __init__(self, B, G, NW, n, members, tiles, seg_ints, outputs, order, key):
        self.B, self.G, self.NW, self.n = B, G, NW, n
        self.members = members  # 2: a query and its key alternate program by program
        self.tiles = tiles  # per segment: rows (units) of one sample
        self.seg_ints = seg_ints  # per segment (S, x_sb, x_ss, x_sg, f_sb, f_sh, f_ss, f_sj, o_S, o_tok0)
        self.outputs = outputs  # shapes of the query and key outputs
        self.order = order  # the reduction order, or None where it depends on a probe (`_order`)
        self.key = key  # the gate key, less the order
        self.recipes: dict = {}


_geometry = GeometryCache()


def plan_qk_norm_rope(queries, keys, weights, eps, freqs, rope_type, norm, tier: str = "lossless"):
    """The guard: a plan for the fused kernel (exact in every tier), or why the call
    takes the reference. Arguments as for `qk_norm_rope_reference`."""
    if not HAS_TRITON:
        return "triton is not installed"
    if norm not in NORMS:
        return f"unknown norm {norm!r}"
    if rope_type is not None and rope_type not in ROPE_TYPES:
        return f"unknown rope_type {rope_type!r}"
    if queries.__class__ not in (tuple, list) or keys.__class__ not in (tuple, list):
        return "queries and keys must be sequences of tensors (one per source)"
    n = len(queries)
    if n not in (1, 2) or len(keys) != n:
        return "one or two sources, each with a query and a key"
    xs = (*queries, *keys)
    why = common_device_dtype(*xs)
    if why:
        return why
    x0 = xs[0]
    if weights is None:
        ws = (None,) * (2 * n)
    else:
        if weights.__class__ not in (tuple, list) or len(weights) != n or any(
                p.__class__ not in (tuple, list) or len(p) != 2 for p in weights):
            return "weights: a (query weight, key weight) pair per source"
        ws = (*(p[0] for p in weights), *(p[1] for p in weights))
        why = _check_weights(ws, x0, norm)
        if why:
            return why
    if rope_type is None:
        if freqs is not None:
            return "freqs given without a rope_type"
        fs = (None,) * (2 * n)
    else:
        if freqs.__class__ not in (tuple, list) or len(freqs) != n or any(
                p.__class__ not in (tuple, list) or len(p) != 2 for p in freqs):
            return "freqs: a (query freqs, key freqs) pair per source"
        fs = (*(_freq_pair(p[0], rope_type) for p in freqs), *(_freq_pair(p[1], rope_type) for p in freqs))
        for f in fs:
            if f.__class__ is str:
                return f
            if f[0].get_device() != x0.get_device():
                return "freqs on another device"
    has_weight = ws[0] is not None
    parts = (x0.dtype, x0.get_device(), rope_type, norm, has_weight, *((x.shape, x.stride()) for x in xs),
             *(None if f is None else (f[0].shape, f[0].stride()) for f in fs))
    geometry = _geometry.get(parts, _geometry_of, xs, fs, rope_type, norm, has_weight, n)
    if geometry.__class__ is str:
        return geometry
    order = geometry.order or _order_probed(geometry, x0)
    if order.__class__ is str:
        return order
    rope = _ROPE_CODE[rope_type], 0, 0, 0
    if rope_type == "split":
        fused = addcmul_fuses(x0.get_device())
        if fused is None:
            return "aten's addcmul rounding not probed yet on this device (capturing or compiling)"
        rope = 2, fs[0][0].shape[-1], 2 if fused else 0, 1 if fused else 0
    elif rope_type == "wan":
        via32 = f64_store_via_f32(x0.get_device()) if fs[0][0].dtype is torch.float64 else False
        if via32 is None:
            return "how eager rounds float64 to x's dtype is not known here (or not probed yet)"
        rope = 4, fs[0][0].shape[-1], int(fs[0][0].dtype is torch.float64), int(via32)
    elif rope_type == "complex":
        form = complex_mul_form(x0.get_device())
        if form is None:
            return "eager's complex multiply rounds in no form this kernel knows here (or not probed yet)"
        rope = 3, 0, form[0], form[1]
    if norm == "aten":
        for x in xs:
            if x.data_ptr() % (4 * x.element_size()) and x.is_contiguous():
                return "x is not 4-element aligned (aten takes RowwiseMomentsCUDAKernel)"
    if eps is None:  # F.rms_norm's default: the epsilon of the fp32 compute type
        eps = torch.finfo(torch.float32).eps
    key = geometry.key + (f"ref={order[0]}/{order[1]}",) + ((f"form={rope[2]}{rope[3]}",) if rope[2] or rope[3] else ())
    return QKNormRopePlan(xs, ws if has_weight else None, fs, geometry, order, rope, float(eps), key)


def _check_weights(ws, x0, norm) -> str | None:
    if ws[0] is None:
        return None if all(w is None for w in ws) else "some norms have a weight and others not"
    NW = x0.shape[-1]
    grad = torch.is_grad_enabled()
    for w in ws:
        if not isinstance(w, torch.Tensor):
            return "some norms have a weight and others not" if w is None else "weight is not a tensor"
        if w.dim() != 1 or w.shape[0] != NW:
            return f"weight must be [{NW}]"
        if w.dtype is not x0.dtype:
            return "weight dtype differs from x's (eager promotes; aten takes its composite path)"
        if w.get_device() != x0.get_device():
            return "weight on another device"
        if w.stride(0) != 1:
            return "weight is not contiguous"
        if norm == "aten" and w.data_ptr() % (4 * w.element_size()):
            return "weight is not 4-element aligned (aten takes RowwiseMomentsCUDAKernel)"
        if grad and w.requires_grad:
            return "autograd needs the eager graph"
    return None


def _freq_pair(f, rope_type):
    """(cos, sin) fp32 tensors for the kernel, or why not. Complex freqs become views of
    their real and imaginary parts."""
    if rope_type == "complex":
        if not isinstance(f, torch.Tensor) or f.dtype is not torch.complex64:
            return "complex freqs must be a complex64 tensor (eager promotes other types)"
        if f.requires_grad and torch.is_grad_enabled():
            return "autograd needs the eager graph"
        return _complex_pair(f)
    if f.__class__ not in (tuple, list) or len(f) != 2 or not all(isinstance(t, torch.Tensor) for t in f):
        return "freqs is not a (cos, sin) pair"
    cos, sin = f
    if rope_type == "wan":
        if cos.dtype not in (torch.float64, torch.float32) or sin.dtype is not cos.dtype:
            return "Wan's cos/sin must be float64 (or float32), both of one dtype"
    elif cos.dtype is not torch.float32 or sin.dtype is not torch.float32:
        return "cos/sin must be float32 (eager promotes x to their dtype)"
    if cos.shape != sin.shape:
        return "cos and sin shapes differ"
    if sin.stride() != cos.stride():
        return "cos and sin strides differ"
    if sin.get_device() != cos.get_device():
        return "cos and sin on different devices"
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return "autograd needs the eager graph"
    return cos, sin


def _complex_pair(f):
    """Views of a complex tensor's real and imaginary parts."""
    r = torch.view_as_real(f)
    return r[..., 0], r[..., 1]


def _order(norm, NW, N, device, probed=False):
    """(REF, LANES, XSTEPS, WARP_INC, factor) of the norm's reduction over N rows of NW,
    why it is not reproduced, or None where it depends on a probe not asked for
    (`probed`: ask it)."""
    if norm == "aten":
        if NW % 4:
            return f"rows of {NW}: not a multiple of 4 (aten's unaligned path)"
        return 1, 128 if NW > 128 else 32, 0, False, 0.0
    if N * NW >= 2**31:
        return "diffusers mean over 2**31 elements or more (aten splits the iteration)"
    vectorised, warp_inc = NW > 128, WARP_INC
    if NW == 128:  # on setReduceConfig's threshold: the running build decides
        if not probed:
            return None
        found = mean_order_128(device)
        if found is None:
            return "diffusers mean of 128-wide rows: the running torch's order is not known here (or not probed yet)"
        vectorised, warp_inc = found
    if vectorised:
        if NW == 128:
            lanes = 32  # dim0 = 32 float4 vectors: one a lane, whatever N
        else:
            lanes, why = mean_reduce_config(NW, N)
            if why:
                return why
        return 0, lanes, max(lanes.bit_length() - 6, 0), warp_inc, mean_factor(N, NW)
    lanes = _scalar_mean_config(NW, N)
    if lanes < 32:
        return f"rows of {NW} < 32: aten's block is narrower than a warp (not reproduced)"
    return 2, lanes, max(lanes.bit_length() - 6, 0), warp_inc, mean_factor(N, NW)


def _orders(norm, NW, B, tiles, device, probed=False):
    """The one order of every segment (eager reduces each tensor on its own), or why not."""
    orders = {_order(norm, NW, B * t, device, probed) for t in tiles}
    if len(orders) > 1:
        strs = [o for o in orders if o.__class__ is str]
        return strs[0] if strs else "the sources' tensors reduce in different orders (few rows)"
    return orders.pop()


def _order_probed(geometry, x0):
    return _orders("diffusers", geometry.NW, geometry.B, geometry.tiles, x0.get_device(), probed=True)


def _freq_strides(f, x, rope_type):
    """(f_sb, f_sh, f_ss, f_sj, R) of one (cos, sin) for x, or why they don't fit."""
    cos = f[0]
    B, S = x.shape[0], x.shape[1]
    if rope_type == "interleaved":
        if x.dim() == 3:  # LTX-2: [B | 1, S, C]
            if cos.dim() != 3 or cos.shape[1:] != x.shape[1:] or cos.shape[0] not in (1, B):
                return "cos/sin must be [B or 1, S, C] for x [B, S, C]"
            return (cos.stride(0) if cos.shape[0] != 1 else 0), 0, cos.stride(1), cos.stride(2), 0
        if cos.dim() != 2 or cos.shape != (S, x.shape[-1]):  # FLUX: [S, D]
            return "cos/sin must be [S, D] for x [B, S, H, D]"
        return 0, 0, cos.stride(0), cos.stride(1), 0
    if rope_type == "pairs":  # x [B, S, C], cos/sin [B | 1, S, C / 2]
        if x.dim() != 3 or cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1:] != (S, x.shape[-1] // 2):
            return "pairs RoPE takes x [B, S, C] and cos/sin [B or 1, S, C / 2]"
        return (cos.stride(0) if cos.shape[0] != 1 else 0), 0, cos.stride(1), cos.stride(2), 0
    if rope_type == "wan":  # x [B, S, H * Dh], cos/sin [B | 1, S, 1, Dh] (WanRotaryPosEmbed's output)
        if x.dim() != 3 or cos.dim() != 4 or cos.shape[0] not in (1, B) or cos.shape[1] != S or cos.shape[2] != 1:
            return "Wan RoPE takes x [B, S, C] and cos/sin [B or 1, S, 1, Dh]"
        dh = cos.shape[3]
        if dh % 2 or x.shape[-1] % dh:
            return "Wan RoPE: the head width must be even and divide C"
        return (cos.stride(0) if cos.shape[0] != 1 else 0), 0, cos.stride(1), cos.stride(3), dh
    if rope_type == "split":
        if x.dim() != 3 or cos.dim() != 4:
            return "split RoPE takes x [B, S, C] and cos/sin [B, H, S, r]"
        b, h, t, r = cos.shape
        if b not in (1, B) or t != S or 2 * h * r != x.shape[-1]:
            return "x is not [B, S, 2 * H * r] for cos/sin's [B, H, S, r]"
        return (cos.stride(0) if b != 1 else 0), cos.stride(1), cos.stride(2), cos.stride(3), r
    if x.dim() != 4 or cos.dim() != 2 or cos.shape != (S, x.shape[-1] // 2):  # complex
        return "complex RoPE takes x [B, S, H, D] and freqs [S, D / 2]"
    return 0, 0, cos.stride(0), cos.stride(1), 0


def _geometry_of(xs, fs, rope_type, norm, has_weight, n):
    x0 = xs[0]
    if x0.dim() not in (3, 4):
        return f"x must be [B, S, C] or [B, S, H, D], got {x0.dim()}-D"
    for x in xs:
        if x.dim() != x0.dim() or x.shape[0] != x0.shape[0] or x.shape[2:] != x0.shape[2:]:
            return "queries and keys differ in batch, heads or channels"
        if x.numel() == 0:
            return "empty tensor"
        if x.stride(-1) != 1:
            return "x's last dimension is not contiguous"
    B, NW = x0.shape[0], x0.shape[-1]
    G = x0.shape[2] if x0.dim() == 4 else 1
    if NW > MAX_D:
        return f"rows of {NW} > {MAX_D}: too wide for the register-resident kernel"
    if rope_type is not None and NW % 2:
        return "odd channel count"
    seg_ints = []
    lengths = (sum(x.shape[1] for x in xs[:n]), sum(x.shape[1] for x in xs[n:]))
    out_tok = [0, 0]
    for i, (x, f) in enumerate(zip(xs, fs)):
        fst = (0, 0, 0, 0, 0) if f is None else _freq_strides(f, x, rope_type)
        if fst.__class__ is str:
            return fst
        if rope_type in ("split", "wan") and fst[4] != fs[0][0].shape[-1]:
            return "split RoPE: head sizes differ between queries and keys"
        out = i // n
        seg_ints.append((x.shape[1], x.stride(0), x.stride(1), x.stride(2) if G > 1 else 0, *fst[:4], lengths[out],
                         out_tok[out]))
        out_tok[out] += x.shape[1]
    tiles = tuple(x.shape[1] * G for x in xs)
    order = _orders(norm, NW, B, tiles, x0.get_device())
    if order.__class__ is str:
        return order
    # a query and its key alternate when they have as many rows; else segments run apart
    members = 2 if all(tiles[i] == tiles[i + n] for i in range(n)) else 1
    tail = tuple(x0.shape[2:])
    key = (x0.dtype, x0.get_device(), norm, rope_type or "none", f"NW={NW}", f"G={G}",
           f"{n} source{'s' if n > 1 else ''}", "q+k paired" if members == 2 else "q, k apart",
           "weight" if has_weight else "no weight")
    return _Geometry(B, G, NW, n, members, tiles, tuple(seg_ints), ((B, lengths[0], *tail), (B, lengths[1], *tail)),
                     order, key)


# ---------------------------------------------------------------- launcher


def launch_shape(NW: int) -> tuple[int, int, int]:
    """(RU rows a program, CH columns a second-pass chunk, num_warps): about 2048
    elements a program's pass-1 tile (whole rows), chunks of up to 1024 columns."""
    nwp = next_pow2(NW)
    if nwp >= 2048:
        return (2 if nwp <= 4096 else 1), 1024, 8
    return max(1, 2048 // nwp), min(nwp, 1024), 4


def _recipe(plan, config):
    """(slots, Recipe): the segments in launch order and everything but the tensors,
    built once per geometry, order, RoPE form, eps and config."""
    geo = plan.geometry
    key = (config, plan.order, plan.rope, plan.eps)
    found = geo.recipes.get(key)
    if found is not None:
        return found
    RU, CH, num_warps = config or launch_shape(geo.NW)
    CH = min(CH, next_pow2(geo.NW))
    n, members = geo.n, geo.members
    slots = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair] if members == 2 else list(range(2 * n))
    stat_base = [sum(geo.B * t for t in geo.tiles[:i]) for i in range(2 * n)]  # stats rows: queries, then keys
    ints, starts, programs = [], [], 0
    for rank, i in enumerate(slots):
        ints += [*geo.seg_ints[i], stat_base[i]]
        if rank % members == 0:
            starts.append(programs)
            programs += members * cdiv(geo.tiles[i], RU)
    ints += ints[:11] * (MAX_SEGMENTS - 2 * n)  # unused slots: never selected
    starts += [programs] * (4 - len(starts))
    ref, lanes, xsteps, warp_inc, factor = plan.order
    rope, R, real_fma, imag_fma = plan.rope
    consts = (2 * n, members, geo.G, geo.NW, ref, lanes, xsteps, warp_inc, RU, CH, rope, R, real_fma, imag_fma,
              plan.ws is not None)
    recipe = Recipe((programs, geo.B), (*ints, *starts[1:], 0, plan.eps, factor, float(geo.NW)), consts, num_warps)
    found = geo.recipes[key] = (tuple(slots), recipe)
    return found


def launch_qk_norm_rope(plan: QKNormRopePlan, out=None, config=None, stats=None):
    """Run the kernel for a guarded plan: (query, key) normed and rotated, each the
    concatenation of its sources, written into `out` (a pair of contiguous tensors)
    if given. `config` overrides (RU, CH, num_warps) (RU a power of two); `stats`
    (fp32 [rows, 2], rows numbered segment by segment, queries first) receives each
    row's statistic (aten: sigma2 / NW; diffusers: the mean) and its rsqrt."""
    geo, x0 = plan.geometry, plan.xs[0]
    if out is None:
        out = (torch.empty(geo.outputs[0], dtype=x0.dtype, device=x0.device),
               torch.empty(geo.outputs[1], dtype=x0.dtype, device=x0.device))
    slots, recipe = _recipe(plan, config)
    tensors = _tensors(slots, geo.n, plan.xs, plan.ws, plan.fs, out)
    if stats is None:
        tensors.append(dummy_stats(x0))
        _launch_kernel.launch(recipe, tensors)
    else:
        ints = list(recipe.ints)
        ints[-4] = 1  # write_stats
        _launch_kernel(recipe.grid, tensors + [stats], tuple(ints), recipe.consts, recipe.num_warps)
    return out


def _tensors(slots, n, xs, ws, fs, out) -> list:
    """The kernel's tensor arguments: five per segment in launch order (x, weight, cos,
    sin, output; x where there is none), the unused segments repeating the first."""
    tensors = []
    for i in slots:
        x, f = xs[i], fs[i]
        tensors += (x, x if ws is None else ws[i], x if f is None else f[0], x if f is None else f[1], out[i // n])
    tensors += tensors[:5] * (MAX_SEGMENTS - len(slots))
    return tensors


def bind_qk_norm_rope(plan: QKNormRopePlan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(queries, keys,
    weights, eps, freqs, rope_type, norm)`, the planner's arguments, for a call with the
    plan's shapes, strides, dtypes, devices, eps, RoPE and norm; None where an x or a
    weight misses the 4-element alignment aten's kernel needs. The closure holds no
    tensor of the call that bound it."""
    geo = plan.geometry
    slots, recipe = _recipe(plan, None)
    n, shapes = geo.n, geo.outputs
    has_weight, has_freqs = plan.ws is not None, plan.fs[0] is not None
    complex_freqs = plan.rope[0] == _ROPE_CODE["complex"]
    dtype, device = plan.xs[0].dtype, plan.xs[0].get_device()
    outputs = tuple(Output(shape, contiguous_strides(shape), dtype, device) for shape in shapes)

    def run(queries, keys, weights, eps, freqs, rope_type, norm):
        xs = (*queries, *keys)
        ws = (*(p[0] for p in weights), *(p[1] for p in weights)) if has_weight else None
        if norm == "aten":
            for t in xs:
                if t.data_ptr() % (4 * t.element_size()) and t.is_contiguous():
                    return None
            for t in ws or ():
                if t.data_ptr() % (4 * t.element_size()):
                    return None
        if has_freqs:
            fs = (*(p[0] for p in freqs), *(p[1] for p in freqs))
            if complex_freqs:
                fs = tuple(_complex_pair(f) for f in fs)
        else:
            fs = (None,) * (2 * n)
        x0 = xs[0]
        out = (outputs[0](), outputs[1]())
        tensors = _tensors(slots, n, xs, ws, fs, out)
        tensors.append(dummy_stats(x0))
        _launch_kernel.launch(recipe, tensors)
        return out

    return run


def qk_norm_rope(queries, keys, weights, eps, freqs, rope_type, norm):
    """The fused op, guarded but ungated: the kernel where eligible, else the eager
    reference. Arguments and result as for `qk_norm_rope_reference`."""
    plan = plan_qk_norm_rope(queries, keys, weights, eps, freqs, rope_type, norm)
    if plan.__class__ is str:
        return qk_norm_rope_reference(queries, keys, weights, eps, freqs, rope_type, norm)
    return launch_qk_norm_rope(plan)


# ---------------------------------------------------------------- torch.library


@torch.library.custom_op("bitfuse::qk_norm_rope", mutates_args=())
def qk_norm_rope_op(
    queries: list[torch.Tensor], keys: list[torch.Tensor], weights: list[torch.Tensor], eps: float | None,
    freqs: list[torch.Tensor], rope_type: str, norm: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque op for torch.compile graphs and capture (eager callers launch directly).
    Flat lists: weights [] or (query, key) per source; freqs [] (rope_type "none"),
    (q cos, q sin, k cos, k sin) per source, or (q freqs, k freqs) per source for
    "complex". Inference only."""
    return qk_norm_rope(*_unflatten(queries, keys, weights, eps, freqs, rope_type, norm))


@qk_norm_rope_op.register_fake
def _(queries, keys, weights, eps, freqs, rope_type, norm):
    return qk_norm_rope_reference(*_unflatten(queries, keys, weights, eps, freqs, rope_type, norm))


def _unflatten(queries, keys, weights, eps, freqs, rope_type, norm):
    n = len(queries)
    w = tuple((weights[2 * i], weights[2 * i + 1]) for i in range(n)) if weights else None
    if rope_type == "none":
        return tuple(queries), tuple(keys), w, eps, None, None, norm
    if rope_type == "complex":
        f = tuple((freqs[2 * i], freqs[2 * i + 1]) for i in range(n))
    else:
        f = tuple(((freqs[4 * i], freqs[4 * i + 1]), (freqs[4 * i + 2], freqs[4 * i + 3])) for i in range(n))
    return tuple(queries), tuple(keys), w, eps, f, rope_type, norm


inference_only(qk_norm_rope_op)


# ---------------------------------------------------------------- reference


def rms_norm_reference(x, weight, eps, norm: str) -> torch.Tensor:
    """The norm as the models call it: "aten" (torch.nn.RMSNorm: F.rms_norm) or
    "diffusers" (diffusers' RMSNorm, weight applied after a rounding to its dtype)."""
    if norm == "aten":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if norm != "diffusers":
        raise ValueError(f"unknown norm {norm!r}; choose one of {', '.join(NORMS)}")
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    if weight is None:
        return h.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    return h * weight


def rope_reference(x, freqs, rope_type):
    """x rotated as the models rotate it: diffusers 0.42.1's `apply_interleaved_rotary_emb`
    and `apply_split_rotary_emb` (LTX-2, x [B, S, C]), `apply_rotary_emb(x, freqs,
    sequence_dim=1)` (FLUX, x [B, S, H, D], cos/sin [S, D]) and `apply_rotary_emb_qwen(x,
    freqs, use_real=False)` (Qwen-Image, complex freqs [S, D / 2]); "pairs": the
    interleaved rotation with the tables repeat-interleaved (x [B, S, C], cos/sin
    [B|1, S, C / 2]); None: x."""
    if rope_type is None:
        return x
    if rope_type == "complex":
        x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(x_rotated * freqs.unsqueeze(1)).flatten(3).type_as(x)
    if rope_type == "interleaved" and x.dim() == 4:
        cos, sin = freqs
        cos, sin = cos[None, :, None, :].to(x.device), sin[None, :, None, :].to(x.device)
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
    if rope_type == "wan":
        return wan_rope_reference(x, freqs)
    if rope_type == "pairs":
        return rotary_reference(x, tuple(f.repeat_interleave(2, -1) for f in freqs), "interleaved")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}; choose one of {', '.join(ROPE_TYPES)}")
    return rotary_reference(x, tuple(freqs), rope_type)


def wan_rope_reference(x, freqs):
    """diffusers 0.42.1 `WanAttnProcessor`'s `apply_rotary_emb` on x [B, S, H * Dh] (the
    processor's [B, S, H, Dh] view, flattened back), freqs (cos, sin) [B | 1, S, 1, Dh]:
    products and sums in the frequencies' dtype (fp32 as WanRotaryPosEmbed builds them;
    float64 accepted), written into x's dtype."""
    freqs_cos, freqs_sin = freqs
    hidden_states = x.unflatten(-1, (-1, freqs_cos.shape[-1]))
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states).flatten(-2)


def qk_norm_rope_reference(queries, keys, weights, eps, freqs, rope_type, norm):
    """The eager expressions, source by source: `rope(norm(x, weight), freqs)`, then the
    sources concatenated along the sequence (dim 1), as diffusers' processors compute
    them (RoPE is elementwise, so rotating before or after the concatenation gives the
    same bits).

    queries, keys: sequences of one or two sources (in concatenation order, e.g. text
        then image), each [B, S_i, C] (norm over C) or [B, S_i, H, D] (norm per head);
        last dimension contiguous; one dtype (bf16, fp16, fp32).
    weights: None, or per source a (query weight, key weight) pair of [C or D] tensors
        of x's dtype (None entries: norms without weight).
    eps: the norms' epsilon (None: F.rms_norm's default).
    freqs: None (rope_type None), or per source a (query freqs, key freqs) pair: fp32
        (cos, sin) for "interleaved" ([B|1, S, C] or, per head, [S, D]), "pairs"
        ([B|1, S, C / 2]) and "split" ([B, H, S, r]); complex64 [S, D / 2] for
        "complex".
    norm: "aten" or "diffusers".

    Returns (query, key), [B, sum S_i, ...] in x's dtype."""
    n = len(queries)
    weights = weights or ((None, None),) * n
    freqs = freqs or ((None, None),) * n
    q = [rope_reference(rms_norm_reference(x, w[0], eps, norm), f[0], rope_type)
         for x, w, f in zip(queries, weights, freqs)]
    k = [rope_reference(rms_norm_reference(x, w[1], eps, norm), f[1], rope_type)
         for x, w, f in zip(keys, weights, freqs)]
    return (q[0], k[0]) if n == 1 else (torch.cat(q, dim=1), torch.cat(k, dim=1))


# ---------------------------------------------------------------- operands for checks and benchmarks

LAYOUTS = ("interleaved", "pairs", "split", "cross", "flux", "qwen")


def _angles(shape, case, gen):
    theta = torch.rand(*shape, device=case.device, generator=gen) * 40 - 20
    cos, sin = theta.cos(), theta.sin()
    if case.data in ("zeros", "subnormal", "special"):  # signed zeros, subnormals, NaN/inf in the tables too
        cos, sin = (cases.spoil(f, case.data, gen) for f in (cos, sin))
    return cos, sin


def _make_args(case: cases.Case) -> tuple:
    """Operands as the models pass them, for x of width C = case.D:
    interleaved  LTX-2.0 self-attention: q, k [B, S, C], per-sample cos/sin [B, S, C]
    pairs        the same with the compact tables bitfuse's LTX-2.0 integration passes:
                 cos/sin [B, S, C / 2], a frequency per pair
    split        LTX-2.3: heads of 128, cos/sin [B, H, S, 64] as diffusers' swapaxes view
    cross        LTX-2 audio-to-video: k of another length with its own frequencies
    flux         FLUX.1 joint attention: text (S/4 + 1 tokens) and image sources,
                 [B, S_i, C/128, 128], cos/sin [S_txt + S_img, 128] (repeat-interleaved)
    qwen         Qwen-Image: diffusers RMSNorm, per-source complex64 freqs [S_i, 64]"""
    gen = case.generator()
    B, S, C, dtype, dev = case.B, case.S, case.D, case.dtype, case.device

    def act(S_, scale=2.0, heads=False):
        c = cases.Case(B, S_, C, dtype, case.layout, case.data, case.seed, dev, case.strided)
        x = cases.activation(c, gen, scale)
        return x.unflatten(-1, (C // 128, 128)) if heads else x

    def weight(n):
        return cases.draw((n,), dtype, "randn", gen, dev, 0.5) + 1

    layout = case.layout
    if layout in ("interleaved", "pairs", "split", "cross"):
        q, k = act(S), act(S // 2 + 1 if layout == "cross" else S, 1.0)
        wq, wk = weight(C), weight(C)
        if layout == "split":
            H = max(1, C // 128)
            fq = tuple(f.swapaxes(1, 2) for f in _angles((B, S, H, C // (2 * H)), case, gen))
            fk = fq
        else:
            fq = _angles((B, S, C // 2 if layout == "pairs" else C), case, gen)
            fk = _angles((B, k.shape[1], C), case, gen) if layout == "cross" else fq
        rope = layout if layout in ("pairs", "split") else "interleaved"
        return (q,), (k,), ((wq, wk),), 1e-6, ((fq, fk),), rope, "aten"
    if layout not in ("flux", "qwen"):
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    St = S // 4 + 1
    sources = [(act(St, heads=True), act(St, 1.0, heads=True)), (act(S, heads=True), act(S, 1.0, heads=True))]
    weights = tuple((weight(128), weight(128)) for _ in range(2))
    if layout == "flux":
        cos, sin = (f.repeat_interleave(2, -1) for f in _angles((St + S, 64), case, gen))
        freqs = (((cos[:St], sin[:St]),) * 2, ((cos[St:], sin[St:]),) * 2)
        rope, norm = "interleaved", "aten"
    else:
        freqs = tuple((torch.complex(*_angles((n, 64), case, gen)),) * 2 for n in (St, S))
        rope, norm = "complex", "diffusers"
    return (tuple(s[0] for s in sources), tuple(s[1] for s in sources), weights, 1e-6, freqs, rope, norm)


SPEC = OpSpec(
    name="qk_norm_rope",
    reference=qk_norm_rope_reference,
    plan=plan_qk_norm_rope,
    launch={"lossless": launch_qk_norm_rope},
    bind={"lossless": bind_qk_norm_rope},
    make_args=_make_args,
    layouts=LAYOUTS,
)
