"""Convolution epilogues: what eager computes after a cuDNN convolution, fused.

Sana's GLUMBConv (diffusers `sana_transformer.py`) runs, on channels-last
activations [B, C, H, W]:

    y = conv_inverted(x)            1x1 convolution with bias
    y = silu(y)
    y = conv_depth(y)               3x3 depthwise convolution with bias
    h, g = y.chunk(2, dim=1)
    y = h * silu(g)

Four ops, two levels:

    bias_silu(y, bias)       silu(y + bias)               y: a convolution's output without its bias
    bias_glu(y, bias)        h * silu(g), h, g = (y + bias).chunk(2, dim=1)  (bias may be None)
    conv_bias_silu(x, w, b, stride, padding, dilation, groups)
                             silu(conv2d(x, w, b, ...))   the site-level op: eager's conv and SiLU
    conv_bias_glu(x, w, b, stride, padding, dilation, groups)
                             h * silu(g), h, g = conv2d(x, w, b, ...).chunk(2, dim=1)

The epilogues are the kernels (benchmarked alone); the conv-level ops are what the
sites gate at first sight: their fast path runs the convolution as eager runs it
(cuDNN), without the bias when eager adds the bias as a separate op, then the
epilogue kernel; their reference is the stock expression, convolution with bias
included, so a wrong assumption about where eager adds the bias is a mismatch
(a fallback to eager), never a wrong result.

WHERE EAGER ADDS A CONVOLUTION'S BIAS. `F.conv2d` -> `at::convolution` ->
`at::_convolution` (aten/src/ATen/native/Convolution.cpp) picks a backend with
`select_conv_backend` and, for `ConvBackend::Cudnn`, runs

    output = at::cudnn_convolution(input.contiguous(backend_memory_format), weight, padding,
                                   stride, dilation, groups, benchmark, deterministic, allow_tf32);
    if (bias.defined()) { output.add_(reshape_bias(input.dim(), bias)); }

(cuDNN convolutions take no bias: ConvShared.cpp, "NOTE [ Convolution design ]").
Read in the 2.x sources (the stored copies of Convolution.cpp of the 2.x line all
have this branch; torch 2.11's own file could not be fetched here), so with the
Cudnn backend `conv2d(x, w, b)` is bit for bit `conv2d(x, w, None).add_(b)`: the
same cuDNN call, then one eager add (fp32 opmath, one rounding), which the
epilogue reproduces before its SiLU. The other CUDA backends add the bias inside
their kernel: `_conv_depthwise2d` (CudaDepthwise2d, aten's native depthwise
kernel) starts its accumulator at the bias, `slow_conv2d` adds it inside too.
Which backend eager takes depends on dtype, memory format and shape: a bf16
depthwise convolution takes cuDNN when `cudnn_conv_suggest_memory_format` says
channels-last (input or weight channels-last: "always use cudnn_depthwise for
channels_last format"), and `_conv_depthwise2d` when contiguous (cuDNN's
contiguous depthwise path is fp16-only, behind a workload heuristic). So the
planner does not guess: it asks aten, `torch._C._select_conv_backend` (the
function `_convolution` dispatches with), for this call's backend, once per
geometry, and splits the bias only for `SPLIT_BACKENDS`. Elsewhere the GLU
epilogue still fuses the chunk, SiLU and product after eager's own convolution
with its bias (nothing of the convolution changes); a SiLU alone after such a
convolution is left to eager (nothing to fuse). In Sana every convolution input
is a channels-last view (the FF permutes [B, H*W, C] tokens to NCHW without
copying), so both convolutions take cuDNN and both biases are split.

Routed by `models.sana` (GLUMBConv.forward). Layouts matter as much as values
here: eager's result is channels-last, and the next convolution picks its aten
backend, and its bits, by layout, so the kernels write eager's strides and the
gate hands on eager's own result wherever its check buffer is laid out otherwise
(an earlier routing differed from stock for that reason: bench/NOTES.md).

EAGER'S SILU: `x / (1 + expf(-x))` in fp32 with IEEE division, which form 0 of
`_act.silu` reproduces bit for bit (the cheaper forms: below). Rounding to the
storage dtype: after the bias add (eager's add_), after the SiLU (eager's silu),
after the product (eager's mul); FMA contraction off.

THE DEPTHWISE CONVOLUTION IN THE GLU KERNEL. cuDNN's 3x3 depthwise convolution sums
each output's nine products in fp32 in row-major tap order (kh, then kw), from 0: on
the H100 and H200 with cuDNN 9.19 every output of Sana's [2, 11200, 32, 32] (bf16 and
fp16, channels-last and contiguous) and of odd shapes equals that sum rounded to the
dtype, where column-major, reversed, row-sums-first, tree and centre-first orders
differ (bench/NOTES.md, 2026-12-06). A product of two 16-bit values is exact in fp32,
so the order is all there is to match. `depthwise_glu` therefore computes the
convolution, cuDNN's rounding of it, the bias add_, the SiLU and the product in one
kernel, and `plan_conv_bias_glu` plans it for a channels-last 16-bit 3x3 depthwise
convolution, stride 1, padding 1, on a backend that adds the bias apart (`DEPTHWISE`):
its own gate signature ("convolution fused"), verified per geometry at first sight
against the stock convolution and epilogue, like every kernel (another cuDNN, another
order: a mismatch, and eager's path). A program walks a column of the image down its
rows and reads each input row once, adding its taps to the three output rows it
touches in that order. One library call and one launch a block fewer in Sana's
forward, and faster on the GPU: 68.2 us at Sana's shape on the H100, against 82.9 for
an earlier fused kernel that loaded each of the nine taps apart (itself level with
cuDNN + the epilogue).

CHEAPER SILUS, CHECKED WHOLE. That SiLU (libdevice's expf, then `div.rn.f32` with its
range check and slow-path branch) made the bias + SiLU kernel compute-bound: 79% of
the copy ceiling on the H200. But for bf16 and fp16 the SiLU's input is a value of
the storage dtype (the bias add's rounding, or the convolution's output) and its
result is rounded to that dtype, so the SiLU is a function of 65,536 inputs:
`silu_form` runs the kernel in each cheaper form (`SILU_FORMS`: ex2.approx with
rcp.approx, or expf with a Newton-refined reciprocal) over every one of them, once per
device, dtype and kernel, and keeps the first equal to eager's `F.silu` on all of
them; else (and for fp32, whose inputs can't all be tried) aten's arithmetic. On the
H200 (2026-12-02) bf16 takes ex2.approx + rcp.approx (equal on every input) and fp16
the Newton form (the approximate one differs on 2 of 65,536 inputs by 1 ULP).

Shapes: y [B, C, H, W] (bias_glu: 2C channels, output C), any strides where H and
W merge (h stride = W x w stride: contiguous, channels-last and their channel
slices); bias [C] (bias_glu: [2C]); one dtype (bf16, fp16, fp32). Output: a new
tensor with the strides eager's result has (computed once per geometry on the
meta device, so the next convolution sees the memory format it sees in eager),
or written into `out` (any strides) if given. The kernels are exact in every tier.

Under Triton's interpreter (CPU tests) the SiLU is numpy's float32
`x / (1 + exp(-x))`: the indexing is checked there, the bits on the GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import cases
from ._launch import (
    HAS_TRITON,
    INTERPRET,
    FastLaunch,
    GeometryCache,
    Output,
    Recipe,
    cdiv,
    device_index,
    jit,
    needs_int64,
    next_pow2,
    probe_allowed,
    register_op,
    synchronous,
    tl,
)
from ._act import DOMAIN, FAST_SILU_FORMS, SILU_FORMS, every_input, libdevice, silu
from ._params import common_device_dtype
from ._settings import cudnn_settings
from .spec import OpSpec

#: aten backends (`torch._C._ConvBackend` names) whose `_convolution` branch adds the
#: bias as a separate `output.add_(bias)` after the convolution
SPLIT_BACKENDS = frozenset({"Cudnn"})

LAYOUTS = ("channels-last", "contiguous")

# ---------------------------------------------------------------- kernel


@jit
def _epilogue_kernel(
    y_ptr, bias_ptr, out_ptr,
    P, C,
    y_sb, y_sc, y_sp,
    o_sb, o_sc, o_sp,
    b_s, gate_y, gate_b,
    HAS_BIAS: tl.constexpr,
    GLU: tl.constexpr,
    CL: tl.constexpr,  # channels are y's contiguous axis: tiles [pixels, channels]; else [channels, pixels]
    EVEN: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NFB: tl.constexpr,  # blocks along the tile's fast (contiguous) axis
    SILU: tl.constexpr,  # the SiLU's form (`SILU_FORMS`)
    INTERP: tl.constexpr,
):
    b = tl.program_id(2)
    pid = tl.program_id(0)
    slow = pid // NFB
    fast = pid - slow * NFB
    if CL:
        p = slow * BLOCK_P + tl.arange(0, BLOCK_P)
        c = fast * BLOCK_C + tl.arange(0, BLOCK_C)
    else:
        c = slow * BLOCK_C + tl.arange(0, BLOCK_C)
        p = fast * BLOCK_P + tl.arange(0, BLOCK_P)
    if INT64:
        b = b.to(tl.int64)
        p = p.to(tl.int64)
        c = c.to(tl.int64)
    if CL:
        y_off = b * y_sb + (p * y_sp)[:, None] + (c * y_sc)[None, :]
        o_off = b * o_sb + (p * o_sp)[:, None] + (c * o_sc)[None, :]
        b_off = (c * b_s)[None, :]
        c_ok = (c < C)[None, :]
        mask = (p < P)[:, None] & c_ok
    else:
        y_off = b * y_sb + (c * y_sc)[:, None] + (p * y_sp)[None, :]
        o_off = b * o_sb + (c * o_sc)[:, None] + (p * o_sp)[None, :]
        b_off = (c * b_s)[:, None]
        c_ok = (c < C)[:, None]
        mask = c_ok & (p < P)[None, :]
    if EVEN:  # P % BLOCK_P == 0 and C % BLOCK_C == 0: no masks
        c_ok = None
        mask = None

    dtype = out_ptr.dtype.element_ty
    h = tl.load(y_ptr + y_off, mask=mask).to(tl.float32)
    if HAS_BIAS:
        bh = tl.load(bias_ptr + b_off, mask=c_ok, eviction_policy="evict_last").to(tl.float32)
        h = (h + bh).to(dtype).to(tl.float32)  # eager: output.add_(bias)
    if GLU:
        g = tl.load(y_ptr + (y_off + gate_y), mask=mask).to(tl.float32)
        if HAS_BIAS:
            bg = tl.load(bias_ptr + (b_off + gate_b), mask=c_ok, eviction_policy="evict_last").to(tl.float32)
            g = (g + bg).to(dtype).to(tl.float32)  # eager: output.add_(bias) (the gate half)
        s = silu(g, SILU, INTERP).to(dtype).to(tl.float32)  # eager: silu(gate)
        out = h * s  # eager: hidden * silu(gate)
    else:
        out = silu(h, SILU, INTERP)  # eager: silu(output)
    tl.store(out_ptr + o_off, out.to(dtype), mask=mask)


_launch = FastLaunch(_epilogue_kernel, ("HAS_BIAS", "GLU", "CL", "EVEN", "INT64", "BLOCK_P", "BLOCK_C", "NFB",
                                        "SILU", "INTERP"))


@jit
def _row_taps(ptr, y_sw, w_ptr, wc, c_ok, row_ok, col_ok0, col_ok1, col_ok2, P, Q):
    """One input row's contributions to the three output rows it touches, in cuDNN's tap
    order: its three taps (kw = 0, 1, 2; `ptr` points at column kw = 0) as taps kh = 2 of
    the output row above (P, whose sum this completes), kh = 1 of the output row at it
    (Q), and kh = 0 of the output row below (returned N, a sum begun from 0). Each tap
    one FMA (a product of two 16-bit values is exact in fp32; the FMA keeps the order's
    roundings where a product would underflow); a tap outside the image adds x = 0."""
    N = tl.zeros(P.shape, tl.float32)
    for kw in tl.static_range(3):
        if kw == 0:
            col_ok = col_ok0
        elif kw == 1:
            col_ok = col_ok1
        else:
            col_ok = col_ok2
        v = tl.load(ptr + kw * y_sw, mask=(row_ok & col_ok)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + (wc + (6 + kw)), mask=c_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        w1 = tl.load(w_ptr + (wc + (3 + kw)), mask=c_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        w0 = tl.load(w_ptr + (wc + kw), mask=c_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        P = tl.fma(v, w2[None, :], P)
        Q = tl.fma(v, w1[None, :], Q)
        N = tl.fma(v, w0[None, :], N)
    return P, Q, N


@jit
def _depthwise_glu_kernel(
    y_ptr, w_ptr, bias_ptr, out_ptr,
    C, H, W,
    y_sb, y_sc, y_sh, y_sw,
    o_sb, o_sc, o_sh, o_sw,
    w_sc, b_s,
    INT64: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr,
    VEC_C: tl.constexpr,
    SILU: tl.constexpr,
    INTERP: tl.constexpr,
):
    """`h * silu(g)`, `h, g = conv2d(y, w, bias, 1, 1, 1, 2C).chunk(2, dim=1)`: the 3x3
    depthwise convolution (stride 1, zero padding 1) of both halves, summed as cuDNN sums
    it (`DEPTHWISE`) and rounded to the dtype as its output, eager's bias add_ (rounded),
    the gate's SiLU (rounded) and the product.

    Each input row is read once: a program walks ROWS output rows of a [BLOCK_W pixels,
    BLOCK_C channels] column of the image from the top, streaming input rows h0 - 1 ...
    h0 + ROWS; each row's taps go into the three output rows it touches (`_row_taps`), so
    every output still sums its nine taps in row-major order from 0, and an output row
    is finished (epilogue, store) once its last input row is in. Program 0: (row block,
    pixel block), 1: channel block, 2: sample. VEC_C: channels a thread holds (the index
    is contiguous in runs of VEC_C only, so that Triton does not give a thread 8
    channels: 8 of each of the 18 taps' weights then no longer fit in registers)."""
    b = tl.program_id(2)
    nwb = tl.cdiv(W, BLOCK_W)
    h0 = (tl.program_id(0) // nwb) * ROWS
    pw = (tl.program_id(0) % nwb) * BLOCK_W + tl.arange(0, BLOCK_W)
    k = tl.arange(0, BLOCK_C)
    c = tl.program_id(1) * BLOCK_C + (k // VEC_C) * VEC_C + k % VEC_C
    if INT64:
        b = b.to(tl.int64)
        h0 = h0.to(tl.int64)
        pw = pw.to(tl.int64)
        c = c.to(tl.int64)
    c_ok = c < C
    w_ok = pw < W
    col_ok0 = (pw >= 1) & (pw <= W)  # column pw - 1 in the image
    col_ok2 = pw + 1 < W
    dtype = out_ptr.dtype.element_ty
    bh = tl.load(bias_ptr + c * b_s, mask=c_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    bg = tl.load(bias_ptr + (c + C) * b_s, mask=c_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    Ph = tl.zeros((BLOCK_W, BLOCK_C), tl.float32)
    Qh = tl.zeros((BLOCK_W, BLOCK_C), tl.float32)
    Pg = tl.zeros((BLOCK_W, BLOCK_C), tl.float32)
    Qg = tl.zeros((BLOCK_W, BLOCK_C), tl.float32)
    for i in range(ROWS + 2):
        row = h0 - 1 + i  # the input row; it completes output row `row - 1`
        rows = pw * 0 + row  # as a vector: Triton's interpreter types a vector & scalar mask int32
        row_ok = (rows >= 0) & (rows < H)
        ph = y_ptr + (b * y_sb + row * y_sh + ((pw - 1) * y_sw)[:, None] + (c * y_sc)[None, :])
        Ph, Qh, Nh = _row_taps(ph, y_sw, w_ptr, c * w_sc, c_ok, row_ok, col_ok0, w_ok, col_ok2, Ph, Qh)
        Pg, Qg, Ng = _row_taps(ph + C * y_sc, y_sw, w_ptr, (c + C) * w_sc, c_ok, row_ok, col_ok0, w_ok, col_ok2,
                               Pg, Qg)
        oh = row - 1
        if (oh >= h0) & (oh < H):
            h = (Ph.to(dtype).to(tl.float32) + bh[None, :]).to(dtype).to(tl.float32)  # cuDNN's output, eager's add_
            g = (Pg.to(dtype).to(tl.float32) + bg[None, :]).to(dtype).to(tl.float32)
            s = silu(g, SILU, INTERP).to(dtype).to(tl.float32)  # eager: silu(gate)
            out = h * s  # eager: hidden * silu(gate)
            tl.store(out_ptr + (b * o_sb + oh * o_sh + (pw * o_sw)[:, None] + (c * o_sc)[None, :]), out.to(dtype),
                     mask=w_ok[:, None] & c_ok[None, :])
        Ph, Qh, Pg, Qg = Qh, Nh, Qg, Ng


_launch_depthwise = FastLaunch(_depthwise_glu_kernel, ("INT64", "BLOCK_W", "BLOCK_C", "ROWS", "VEC_C", "SILU",
                                                       "INTERP"))


# ---------------------------------------------------------------- geometry


def _pixel_stride(shape, stride) -> int | None:
    """The stride of the merged H x W axis of a 4-D tensor, or None when H and W do
    not merge (an h step is not W w steps)."""
    H, W = shape[2], shape[3]
    if W == 1:
        return stride[2]
    if H == 1 or stride[2] == W * stride[3]:
        return stride[3]
    return None


def launch_shape(P: int, C: int, cl: bool, elem_bytes: int, glu: bool = True) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_C, num_warps): channels-last, up to 128 channels by 16 pixels
    (bias_glu) or 32 pixels (bias_silu) on 8 warps, the fastest of 12 shapes for each
    at the op bench's geometry on the H200 with the cheaper SiLU forms (2026-12-02,
    bench/NOTES.md: bias + SiLU 89.7% of the copy ceiling at 32 x 128 against 84.1% at
    16 x 128; bias + gated SiLU best at 16 x 128); otherwise tiles of about 4096
    elements in blocks of up to 1024 pixels."""
    if cl:
        block_c = min(128, next_pow2(C))
        block_p = max(1, min((2048 if glu else 4096) // block_c, next_pow2(P)))
        return block_p, block_c, max(1, min(8, block_p * block_c * elem_bytes // 512))
    block_p = min(1024, next_pow2(P))
    block_c = max(1, min(4096 // block_p, next_pow2(C)))
    elems = block_p * block_c
    return block_p, block_c, max(1, min(8, elems * elem_bytes // 1024))


def _out_strides(y_shape, y_stride, dtype, has_bias: bool, glu: bool):
    """The strides of eager's result for a y of this geometry (aten's TensorIterator
    layout rules, run on the meta device)."""
    y = torch.empty_strided(y_shape, y_stride, dtype=dtype, device="meta")
    b = torch.empty(y_shape[1], dtype=dtype, device="meta") if has_bias else None
    ref = bias_glu_reference(y, b) if glu else bias_silu_reference(y, b)
    return tuple(ref.shape), ref.stride()


_strides_cache = GeometryCache()
_recipes = GeometryCache()


def _recipe(y, bias, out, glu: bool, form: int, config=None):
    """The launch for y -> out (a Recipe), or why the kernel can't take this layout."""
    key = (y.shape, y.stride(), out.stride(), y.dtype, y.get_device(), None if bias is None else bias.stride(), glu,
           form, config)
    return _recipes.get(key, _make_recipe, y, bias, out, glu, form, config)


def _make_recipe(y, bias, out, glu, form, config):
    B, Ct = y.shape[0], y.shape[1]
    C = Ct // 2 if glu else Ct
    P = y.shape[2] * y.shape[3]
    ysp, osp = _pixel_stride(y.shape, y.stride()), _pixel_stride(out.shape, out.stride())
    if ysp is None or osp is None:
        return "H and W do not merge into one axis"
    ysb, ysc = y.stride(0), y.stride(1)
    osb, osc = out.stride(0), out.stride(1)
    cl = not (ysp == 1 and P > 1)  # any strides work; this picks the tile's contiguous axis
    bs = 0 if bias is None else bias.stride(0)
    wide = needs_int64((B, ysb), (Ct, ysc), (P, ysp), (B, osb), (C, osc), (P, osp), (Ct, bs))
    block_p, block_c, num_warps = config or launch_shape(P, C, cl, y.element_size(), glu)
    nfb = cdiv(C, block_c) if cl else cdiv(P, block_p)
    nsb = cdiv(P, block_p) if cl else cdiv(C, block_c)
    even = P % block_p == 0 and C % block_c == 0
    return Recipe(
        (nsb * nfb, 1, B),
        (P, C, ysb, ysc, ysp, osb, osc, osp, bs, C * ysc, C * bs),
        (bias is not None, glu, cl, even, wide, block_p, block_c, nfb, form, INTERPRET),
        num_warps,
    )


def _epilogue(y, bias, glu: bool, out=None, config=None, form=None):
    """The fused epilogue of y (a convolution's output) into `out` (default: eager's
    layout), or eager's own ops where the kernel can't take the layout. `form`: the
    SiLU's (default: `silu_form` of y's device, dtype and glu)."""
    if form is None:
        form = _FORMS.get((y.get_device(), y.dtype, glu))
        if form is None:
            form = silu_form(y.device, y.dtype, glu)
    if out is None:
        key = (y.shape, y.stride(), y.dtype, bias is None, glu)
        shape, stride = _strides_cache.get(key, _out_strides, y.shape, y.stride(), y.dtype, bias is not None, glu)
        out = torch.empty_strided(shape, stride, dtype=y.dtype, device=y.device)
    recipe = _recipe(y, bias, out, glu, form, config)
    if recipe.__class__ is str:  # eager's ops (the same bits; no kernel for this layout)
        out.copy_(bias_glu_reference(y, bias) if glu else bias_silu_reference(y, bias))
        return out
    _launch.launch(recipe, (y, y if bias is None else bias, out))
    return out


# ---------------------------------------------------------------- the SiLU's form, checked whole

FAST_FORMS = FAST_SILU_FORMS  # the fastest first

_FORMS: dict = {}


def silu_form(device, dtype: torch.dtype, glu: bool) -> int:
    """The SiLU form (`SILU_FORMS`) the epilogue kernel runs for `dtype` on `device`.

    The SiLU's input is a value of the storage dtype (eager rounds the bias add to it,
    or the convolution wrote it) and its result is rounded to that dtype (eager's silu;
    bias_glu's product multiplies the rounded value), so for bf16 and fp16 the SiLU
    is a function of 65,536 inputs whose outputs can all be compared. Once per device,
    dtype and kernel (glu or not), outside tracing and capture, each of `FAST_FORMS`
    runs the kernel itself on every input (bias -0.0, which adds nothing, even to -0.0;
    for glu, hidden 1.0) into a NaN-poisoned output, compared bitwise with eager's
    `F.silu` (signed zeros count, NaN equals NaN): the first equal on all of them is
    kept. Otherwise form 0, aten's own arithmetic: where none is equal, for fp32 and on
    the CPU (kept), and while tracing or capturing (not kept: checked at the next call
    outside). The check compiles its kernels in place (about a second, once per
    process with Triton's cache cold). A form whose kernel fails to compile or run is
    passed over (form 0's failure is the gate's to record). Form 0 and the form found
    give the same outputs for every input, so a call may take either."""
    index = device_index(device)
    key = (index, dtype, glu)
    known = _FORMS.get(key)
    if known is not None:
        return known
    if dtype not in DOMAIN or index < 0 or INTERPRET or not HAS_TRITON or libdevice is None:
        _FORMS[key] = 0
        return 0
    if not probe_allowed(index):
        return 0
    from ..numerics import same_bits

    dev = f"cuda:{index}"
    g = every_input(dtype, dev).view(1, 1, 256, 256)
    ref = F.silu(g)
    y = torch.cat([torch.ones_like(g), g], dim=1) if glu else g
    bias = torch.full((y.shape[1],), -0.0, dtype=dtype, device=g.device)
    found = 0
    with synchronous():  # compiled in place, even at a gate's first sight in the background
        for form in FAST_FORMS:
            try:
                if same_bits(_epilogue(y, bias, glu, torch.full_like(ref, float("nan")), form=form), ref):
                    found = form
                    break
            except torch.OutOfMemoryError:
                raise
            except Exception:  # noqa: BLE001 - a form that fails to build or run is not taken
                continue
    _FORMS[key] = found
    return found


def silu_forms() -> dict:
    """The forms `silu_form` has settled, as {"<device> <dtype> <silu|glu>": form}."""
    return {f"{'cpu' if index < 0 else f'cuda:{index}'} {str(dtype).replace('torch.', '')} "
            f"{'glu' if glu else 'silu'}": form for (index, dtype, glu), form in _FORMS.items()}


# ---------------------------------------------------------------- the epilogue ops


class EpiloguePlan:
    """A call of bias_silu / bias_glu that passed the guard."""

    __slots__ = ("bias", "glu", "key", "y")

    def __init__(self, y, bias, glu, key):
        self.y, self.bias, self.glu, self.key = y, bias, glu, key


def _layout_name(t: torch.Tensor) -> str:
    if t.stride(1) == 1 and t.shape[1] > 1:
        return "channels-last"
    return "contiguous" if t.is_contiguous() else "strided"


def _plan_epilogue(y, bias, glu: bool):
    if not HAS_TRITON:
        return "triton is not installed"
    if not isinstance(y, torch.Tensor):
        return "y is not a tensor"
    why = common_device_dtype(y) if bias is None else common_device_dtype(y, bias)
    if why:
        return why
    if y.dim() != 4:
        return f"y must be 4-D [B, C, H, W], got {y.dim()}-D"
    if y.numel() == 0:
        return "empty tensor"
    if glu and y.shape[1] % 2:
        return "odd channel count: chunk(2) gives halves of different sizes"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != y.shape[1]):
        return "bias is not [C]"
    if _pixel_stride(y.shape, y.stride()) is None:
        return "H and W do not merge into one axis"
    key = (y.dtype, y.get_device(), _layout_name(y), "bias" if bias is not None else "no bias")
    return EpiloguePlan(y, bias, glu, key)


def plan_bias_silu(y, bias, tier: str = "lossless"):
    """The guard of `bias_silu` (y [B, C, H, W], bias [C], one dtype): a plan for the
    kernel, or the reason the call takes the reference."""
    if bias is None:
        return "no bias: a SiLU alone is eager's one kernel"
    return _plan_epilogue(y, bias, False)


def plan_bias_glu(y, bias, tier: str = "lossless"):
    """The guard of `bias_glu` (y [B, 2C, H, W], bias [2C] or None, one dtype): a plan for
    the kernel, or the reason the call takes the reference."""
    return _plan_epilogue(y, bias, True)


def launch_epilogue(plan: EpiloguePlan, out=None, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (any strides, the result's shape)
    if given. `config` overrides (BLOCK_P, BLOCK_C, num_warps)."""
    return _epilogue(plan.y, plan.bias, plan.glu, out, config)


def _bias4(bias):
    return bias.reshape(1, -1, 1, 1)  # aten's reshape_bias for 4-D


def bias_silu_reference(y, bias) -> torch.Tensor:
    """`silu(y + bias)`: eager's ops after a cuDNN convolution (its `add_` of the bias, then SiLU)."""
    return F.silu(y if bias is None else y + _bias4(bias))


def bias_glu_reference(y, bias) -> torch.Tensor:
    """`h * silu(g)` for `h, g = (y + bias).chunk(2, dim=1)` (bias None: y's halves)."""
    hidden, gate = torch.chunk(y if bias is None else y + _bias4(bias), 2, dim=1)
    return hidden * F.silu(gate)


def bias_silu(y, bias) -> torch.Tensor:
    """`silu(y + bias[:, None, None])`, guarded but ungated: the kernel where eligible,
    else the eager reference. y: [B, C, H, W]; bias: [C]; one dtype (bf16, fp16, fp32).
    Returns [B, C, H, W] with eager's strides."""
    plan = plan_bias_silu(y, bias)
    return bias_silu_reference(y, bias) if plan.__class__ is str else launch_epilogue(plan)


def bias_glu(y, bias) -> torch.Tensor:
    """`h * silu(g)` for `h, g = (y + bias[:, None, None]).chunk(2, dim=1)`, guarded but
    ungated. y: [B, 2C, H, W]; bias: [2C] or None. Returns [B, C, H, W]."""
    plan = plan_bias_glu(y, bias)
    return bias_glu_reference(y, bias) if plan.__class__ is str else launch_epilogue(plan)


# ---------------------------------------------------------------- the conv-level ops


class ConvPlan:
    """A conv + epilogue call that passed the guard: the convolution's arguments,
    whether its bias is split off to the epilogue, and the gate key."""

    __slots__ = ("bias", "dilation", "fused", "glu", "groups", "key", "padding", "split", "stride", "weight", "x")

    def __init__(self, x, weight, bias, stride, padding, dilation, groups, split, glu, key, fused=False):
        self.x, self.weight, self.bias = x, weight, bias
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.split, self.glu, self.key, self.fused = split, glu, key, fused


_backends = GeometryCache()


def conv_backend(x, weight, bias, stride, padding, dilation, groups) -> str:
    """The aten backend (`torch._C._ConvBackend` name) eager's `conv2d` takes for these
    operands: what `at::_convolution` dispatches on. Cached per geometry."""
    key = (x.shape, x.stride(), weight.shape, weight.stride(), bias is None, x.dtype, x.get_device(),
           stride, padding, dilation, groups, cudnn_settings(x.dtype))
    return _backends.get(key, _select_backend, x, weight, bias, stride, padding, dilation, groups)


def _select_backend(x, weight, bias, stride, padding, dilation, groups) -> str:
    try:
        backend = torch._C._select_conv_backend(x, weight, bias, list(stride), list(padding), list(dilation), False,
                                                [0] * len(stride), groups)
    except Exception as exc:  # noqa: BLE001 - an unknown torch: no split
        return f"unknown ({type(exc).__name__})"
    return getattr(backend, "name", str(backend).rsplit(".", 1)[-1])


def _pair(v) -> tuple[int, int] | None:
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return (int(v[0]), int(v[1]))
    return None


def _plan_conv(x, weight, bias, stride, padding, dilation, groups, glu: bool):
    if not HAS_TRITON:
        return "triton is not installed"
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "x and weight must be tensors"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return "bias is not a tensor"
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    if stride is None or padding is None or dilation is None or not isinstance(groups, int):
        return "stride, padding and dilation must be ints or pairs (string padding: eager)"
    why = common_device_dtype(x, weight) if bias is None else common_device_dtype(x, weight, bias)
    if why:
        return why
    if x.dim() != 4 or weight.dim() != 4:
        return "x and weight must be 4-D (conv2d)"
    if x.numel() == 0 or weight.numel() == 0:
        return "empty tensor"
    C = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != C):
        return "bias is not [C_out]"
    if glu and C % 2:
        return "odd output channels: chunk(2) gives halves of different sizes"
    backend = conv_backend(x, weight, bias, stride, padding, dilation, groups)
    split = (bias is not None and backend in SPLIT_BACKENDS
             and conv_backend(x, weight, None, stride, padding, dilation, groups) == backend)
    if not glu and not split:
        return f"eager's {backend} convolution adds the bias inside its kernel: no epilogue to fuse"
    cin = x.shape[1]
    kind = "depthwise" if groups == cin and groups > 1 else ("dense" if groups == 1 else f"groups={groups}")
    fmt = "channels-last" if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not \
        x.is_contiguous() else ("contiguous" if x.is_contiguous() else "strided")
    bias_where = "bias split" if split else ("bias in conv" if bias is not None else "no bias")
    fused = glu and split and DEPTHWISE and _depthwise_fits(x, weight, stride, padding, dilation, groups)
    key = (x.dtype, x.get_device(), f"{weight.shape[2]}x{weight.shape[3]} {kind}", f"stride={stride}",
           f"padding={padding}", f"dilation={dilation}", fmt, f"cuDNN settings {cudnn_settings(x.dtype)}", backend,
           bias_where)
    if fused:
        key += ("convolution fused",)
    return ConvPlan(x, weight, bias, stride, padding, dilation, groups, split, glu, key, fused)


def _depthwise_fits(x, weight, stride, padding, dilation, groups) -> bool:
    """The fused kernel's case: a 16-bit 3x3 depthwise convolution, stride 1, zero
    padding 1, one input channel a group, each filter's taps contiguous, x channels-last
    (so cuDNN's output, whose layout the result's follows, is channels-last: layouts
    decide the next convolution's backend and bits)."""
    return (x.dtype in DOMAIN and groups == x.shape[1] == weight.shape[0] and tuple(weight.shape[1:]) == (1, 3, 3)
            and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
            and stride == (1, 1) and padding == (1, 1) and dilation == (1, 1)
            and weight.stride(2) == 3 and weight.stride(3) == 1)


def plan_conv_bias_silu(x, weight, bias, stride, padding, dilation, groups, tier: str = "lossless"):
    """The guard of `silu(conv2d(x, weight, bias, ...))`: a plan, or why eager runs."""
    return _plan_conv(x, weight, bias, stride, padding, dilation, groups, False)


def plan_conv_bias_glu(x, weight, bias, stride, padding, dilation, groups, tier: str = "lossless"):
    """The guard of `h * silu(g)`, `h, g = conv2d(x, weight, bias, ...).chunk(2, dim=1)`."""
    return _plan_conv(x, weight, bias, stride, padding, dilation, groups, True)


def launch_conv(plan: ConvPlan, out=None, config=None) -> torch.Tensor:
    """The convolution as eager runs it (without its bias when the plan splits it off),
    then the epilogue kernel, into `out` if given; a fused plan: both in one kernel."""
    if plan.fused:
        return depthwise_glu(plan.x, plan.weight, plan.bias, out, config)
    y = F.conv2d(plan.x, plan.weight, None if plan.split else plan.bias, plan.stride, plan.padding,
                 plan.dilation, plan.groups)
    return _epilogue(y, plan.bias if plan.split else None, plan.glu, out, config)


def bind_conv(plan: ConvPlan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(x, weight, bias,
    stride, padding, dilation, groups)` for a call with the plan's shapes, strides,
    dtypes, devices and convolution arguments: the convolution (without its bias where
    the plan splits it off), then the epilogue."""
    split, glu = plan.split, plan.glu
    launches = {}  # y's shape and strides -> (the output's `Output`, the epilogue's Recipe)
    if plan.fused:
        bound = _bound_depthwise(plan.x, plan.weight, plan.bias)
        if bound is not None:
            output, recipe = bound

            def fused(x, weight, bias, stride, padding, dilation, groups):
                out = output()
                _launch_depthwise.launch(recipe, (x, weight, bias, out))
                return out

            return fused

        def unbound(x, weight, bias, stride, padding, dilation, groups):
            return depthwise_glu(x, weight, bias)

        return unbound

    def run(x, weight, bias, stride, padding, dilation, groups):
        y = F.conv2d(x, weight, None if split else bias, stride, padding, dilation, groups)
        b = bias if split else None
        key = (y.shape, y.stride())
        hit = launches.get(key)
        if hit is None:
            hit = _bound_epilogue(y, b, glu)
            if hit is None:
                return _epilogue(y, b, glu)
            if len(launches) >= 4:
                launches.clear()
            launches[key] = hit
        output, recipe = hit
        out = output()
        _launch.launch(recipe, (y, y if b is None else b, out))
        return out

    return run


def _bound_epilogue(y, bias, glu: bool):
    """What `_epilogue(y, bias, glu)` allocates and launches for y's geometry, as (an
    `Output` of eager's layout, the Recipe), where the SiLU's form is settled for y's
    device and dtype and the kernel takes the layout; else None. A bound convolution
    keeps it per geometry of its y (cuDNN's output layout for the bound inputs), so a
    call makes no cache keys."""
    form = _FORMS.get((y.get_device(), y.dtype, glu))
    if form is None:
        return None
    key = (y.shape, y.stride(), y.dtype, bias is None, glu)
    shape, stride = _strides_cache.get(key, _out_strides, y.shape, y.stride(), y.dtype, bias is not None, glu)
    recipe = _recipe(y, bias, torch.empty_strided(shape, stride, dtype=y.dtype, device="meta"), glu, form)
    if recipe.__class__ is str:
        return None
    return Output(shape, stride, y.dtype, y.get_device()), recipe


# ---------------------------------------------------------------- the depthwise convolution fused

#: whether `plan_conv_bias_glu` plans the fused depthwise kernel (each geometry is still
#: verified by the gate against the stock convolution and epilogue)
DEPTHWISE = True


def _depthwise_out(x):
    """(shape, strides) of eager's result for the depthwise convolution of a channels-last
    x: cuDNN's output is [B, 2C, H, W] channels-last, and the GLU's result takes
    TensorIterator's layout of its halves (`_out_strides`)."""
    B, C2, H, W = x.shape
    y_stride = (C2 * H * W, 1, W * C2, C2)
    key = (x.shape, y_stride, x.dtype, False, True)
    return _strides_cache.get(key, _out_strides, x.shape, y_stride, x.dtype, True, True)


def depthwise_launch_shape(C: int, H: int, W: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_W, BLOCK_C, ROWS, num_warps, VEC_C) of the fused depthwise kernel: 8 pixels
    by 64 channels on one warp, 2 channels a thread, 8 output rows a program. The fastest
    of 12 shapes at Sana's [2, 11200, 32, 32] bf16 on the H100 (68.2 us; (8, 128, 8, 2, 2)
    68.3, shapes with 16 or 32 pixels 81-101, 8 channels a thread 430; the kernel that
    summed each output's nine taps from nine loads 82.9, cuDNN's stock expression 206.9,
    a copy of the output 31.6; bench/NOTES.md)."""
    return max(1, min(8, next_pow2(W))), min(64, next_pow2(C)), min(8, H), 1, 2


def _depthwise_recipe(x, weight, bias, out, form, config=None):
    B, C2, H, W = x.shape
    C = C2 // 2
    block_w, block_c, rows, num_warps, vec_c = config or depthwise_launch_shape(C, H, W)
    so = out.stride()
    wide = needs_int64((B, x.stride(0)), (C2, x.stride(1)), (H, x.stride(2)), (W, x.stride(3)),
                       (B, so[0]), (C, so[1]), (H, so[2]), (W, so[3]))
    return Recipe((cdiv(H, rows) * cdiv(W, block_w), cdiv(C, block_c), B),
                  (C, H, W, *x.stride(), *so, weight.stride(0), bias.stride(0)),
                  (wide, block_w, block_c, rows, vec_c, form, INTERPRET), num_warps)


def depthwise_glu(x, weight, bias, out=None, config=None):
    """`h * silu(g)`, `h, g = conv2d(x, weight, bias, 1, 1, 1, 2C).chunk(2, dim=1)` in one
    kernel (ungated: the planner and the gate decide where it stands in for eager). x: [B,
    2C, H, W] channels-last; weight: [2C, 1, 3, 3] (each filter's taps contiguous); bias:
    [2C]; one dtype. Returns [B, C, H, W] in eager's layout, or writes `out`."""
    form = _FORMS.get((x.get_device(), x.dtype, True))
    if form is None:
        form = silu_form(x.device, x.dtype, True)
    if out is None:
        shape, stride = _depthwise_out(x)
        out = torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device)
    _launch_depthwise.launch(_depthwise_recipe(x, weight, bias, out, form, config), (x, weight, bias, out))
    return out


def _bound_depthwise(x, weight, bias):
    """(an `Output` of eager's layout, the Recipe) of the fused kernel for x's geometry,
    where the SiLU's form is settled; else None."""
    form = _FORMS.get((x.get_device(), x.dtype, True))
    if form is None:
        return None
    shape, stride = _depthwise_out(x)
    recipe = _depthwise_recipe(x, weight, bias, torch.empty_strided(shape, stride, dtype=x.dtype, device="meta"), form)
    return Output(shape, stride, x.dtype, x.get_device()), recipe


def conv_bias_silu_reference(x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """The stock expression: `silu(conv2d(x, weight, bias, ...))`."""
    return F.silu(F.conv2d(x, weight, bias, stride, padding, dilation, groups))


def conv_bias_glu_reference(x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """The stock expression: `hidden * silu(gate)`, `hidden, gate = conv2d(...).chunk(2, dim=1)`."""
    hidden, gate = torch.chunk(F.conv2d(x, weight, bias, stride, padding, dilation, groups), 2, dim=1)
    return hidden * F.silu(gate)


def conv_bias_silu(x, weight, bias, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
    """`silu(conv2d(x, weight, bias, ...))`, guarded but ungated (the sites gate it).
    x: [B, C_in, H, W]; weight: [C_out, C_in / groups, kh, kw]; bias: [C_out]."""
    args = (x, weight, bias, stride, padding, dilation, groups)
    plan = plan_conv_bias_silu(*args)
    return conv_bias_silu_reference(*args) if plan.__class__ is str else launch_conv(plan)


def conv_bias_glu(x, weight, bias, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
    """`h * silu(g)` for `h, g = conv2d(x, weight, bias, ...).chunk(2, dim=1)`, guarded but
    ungated. Returns [B, C_out / 2, H_out, W_out]."""
    args = (x, weight, bias, stride, padding, dilation, groups)
    plan = plan_conv_bias_glu(*args)
    return conv_bias_glu_reference(*args) if plan.__class__ is str else launch_conv(plan)


# ---------------------------------------------------------------- operands for verify, benchmarks, fuzz


def image_of(S: int) -> tuple[int, int]:
    """(H, W) with H * W = S, as square as S allows (a prime S: 1 x S)."""
    H = max(h for h in range(1, math.isqrt(S) + 1) if S % h == 0)
    return H, S // H


def _tensor4(case: cases.Case, gen, channels: int, scale: float = 1.0) -> torch.Tensor:
    """[B, channels, H, W] in the case's layout; `strided`: a channel slice of a wider tensor."""
    H, W = image_of(case.S)
    extra = 8 if case.strided else 0
    t = cases.draw((case.B, channels + extra, H, W), case.dtype, case.data, gen, case.device, scale)
    if case.layout == "channels-last":
        t = t.contiguous(memory_format=torch.channels_last)
    elif case.layout != "contiguous":
        raise ValueError(f"unknown layout {case.layout!r}; choose one of {', '.join(LAYOUTS)}")
    return t[:, :channels] if extra else t


def _make_bias_silu(case: cases.Case) -> tuple:
    gen = case.generator()
    y = _tensor4(case, gen, case.D, 2.0)
    return y, cases.draw((case.D,), case.dtype, case.data, gen, case.device)


def _make_bias_glu(case: cases.Case) -> tuple:
    gen = case.generator()
    y = _tensor4(case, gen, 2 * case.D, 2.0)
    return y, cases.draw((2 * case.D,), case.dtype, case.data, gen, case.device)


CONV_IN = 64  # input channels of the 1x1 convolution the conv_bias_silu cases draw


def _make_conv_bias_silu(case: cases.Case) -> tuple:
    gen = case.generator()
    x = _tensor4(case, gen, CONV_IN)
    weight = cases.draw((case.D, CONV_IN, 1, 1), case.dtype, "randn", gen, case.device, CONV_IN ** -0.5)
    bias = cases.draw((case.D,), case.dtype, case.data, gen, case.device)
    return x, weight, bias, (1, 1), (0, 0), (1, 1), 1


def _make_conv_bias_glu(case: cases.Case) -> tuple:
    gen = case.generator()
    C = 2 * case.D
    x = _tensor4(case, gen, C)
    weight = cases.draw((C, 1, 3, 3), case.dtype, "randn", gen, case.device, 1 / 3)
    bias = cases.draw((C,), case.dtype, case.data, gen, case.device)
    return x, weight, bias, (1, 1), (1, 1), (1, 1), C


_LAUNCH = {"lossless": launch_epilogue}
_CONV_LAUNCH = {"lossless": launch_conv}
_CONV_BIND = {"lossless": bind_conv}

SPECS = {
    spec.name: spec
    for spec in (
        OpSpec("bias_silu", bias_silu_reference, plan_bias_silu, _LAUNCH, make_args=_make_bias_silu,
               layouts=LAYOUTS),
        OpSpec("bias_glu", bias_glu_reference, plan_bias_glu, _LAUNCH, make_args=_make_bias_glu, layouts=LAYOUTS),
        OpSpec("conv_bias_silu", conv_bias_silu_reference, plan_conv_bias_silu, _CONV_LAUNCH,
               bind=_CONV_BIND, make_args=_make_conv_bias_silu, layouts=LAYOUTS),
        OpSpec("conv_bias_glu", conv_bias_glu_reference, plan_conv_bias_glu, _CONV_LAUNCH,
               bind=_CONV_BIND, make_args=_make_conv_bias_glu, layouts=LAYOUTS),
    )
}


# ---------------------------------------------------------------- torch.library


def _bias_silu_op(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_silu(y, bias)


def _bias_glu_op(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return bias_glu(y, bias)


bias_silu_op = register_op("bias_silu", _bias_silu_op, bias_silu_reference)
bias_glu_op = register_op("bias_glu", _bias_glu_op, bias_glu_reference)
