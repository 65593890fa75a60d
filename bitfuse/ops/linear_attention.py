"""Sana's linear attention around its two batched matmuls: what eager computes before
and after them, fused into one kernel each side.

diffusers' `SanaLinearAttnProcessor2_0` (attention_processor.py, 0.42.1), from the
projections q, k, v [B, N, C] to the input of `to_out`:

    query = q.transpose(1, 2).unflatten(1, (heads, -1))                 [B, H, d, N]
    key = k.transpose(1, 2).unflatten(1, (heads, -1)).transpose(2, 3)   [B, H, N, d]
    value = v.transpose(1, 2).unflatten(1, (heads, -1))                 [B, H, d, N]
    query, key = F.relu(query), F.relu(key)
    query, key, value = query.float(), key.float(), value.float()
    value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)       [B, H, d + 1, N]
    scores = torch.matmul(value, key)                                    [B, H, d + 1, d]
    hidden = torch.matmul(scores, query)                                 [B, H, d + 1, N]
    hidden = hidden[:, :, :-1] / (hidden[:, :, -1:] + 1e-15)
    hidden = hidden.flatten(1, 2).transpose(1, 2).to(q.dtype)            [B, N, C]

WHAT THE MATMULS SEE. `torch.matmul` of two 4-D tensors is `at::bmm` on each operand
`expand(...).reshape(B * H, rows, cols)`; a reshape that cannot be a view copies into
a contiguous tensor. So eager's two bmm calls take: value padded, contiguous
[B*H, d + 1, N] (a view of F.pad's contiguous output); key as a contiguous
[B*H, N, d] copy (its [B, H] axes do not merge in q's layout); scores contiguous;
query as a contiguous [B*H, d, N] copy. The kernels write exactly these three
tensors (shapes, strides, fp32 values) and call `torch.bmm` as aten does, so cuBLAS
sees the same problem; everything else is elementwise:

- prep: relu in the storage dtype (exact), the cast to fp32 (exact), the transposes
  and the row of ones: q, k and v read once, the three bmm operands written once
  (eager: two relus, three casts, the pad and two reshape copies, 9 passes);
- epilogue: the denominator `last row + 1e-15` rounded in fp32, an IEEE division
  (`div.rn.f32`, as aten's division), the rounding to q's dtype, written with
  eager's strides ([B, N, C] viewed from [B, H, d, N]: strides (C*N, 1, N)), which
  `to_out` then reads as it does in eager (eager: the add, the division and the
  cast, 3 passes).

The sign of relu(-0.0) is aten's (`relu_keeps_negative_zero`, probed once per device
and dtype: aten's CUDA relu is `max(x, 0)`, whose sign for -0.0 is the hardware's).

Shapes: q, k, v [B, N, C] of one dtype (bf16, fp16, fp32), on one CUDA device, the
last dimension contiguous, the row stride a multiple of nothing in particular;
heads dividing C. Output: [B, N, C] in q's dtype, strides (C*N, 1, N), or written
into `out` (any strides) if given. Exact in every tier.
"""

from __future__ import annotations

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
    contiguous_strides,
    device_index,
    jit,
    needs_int64,
    probe_allowed,
    register_op,
    tl,
)
from ._params import common_device_dtype
from .spec import OpSpec

EPS = 1e-15  # diffusers' denominator guard, added in fp32

# ---------------------------------------------------------------- kernels


@jit
def _relu(x, KEEP_NEG_ZERO: tl.constexpr):
    """aten's relu (NaN stays NaN): -0.0 kept or made +0.0 as the running build does."""
    if KEEP_NEG_ZERO:
        return tl.where(x < 0.0, 0.0, x)
    else:
        return tl.where((x > 0.0) | (x != x), x, 0.0)


@jit
def _prep_kernel(
    q_ptr, k_ptr, v_ptr, qt_ptr, kc_ptr, vp_ptr,
    N, H,
    q_sb, q_sn, k_sb, k_sn, v_sb, v_sn,
    HEAD: tl.constexpr,
    KEEP_NEG_ZERO: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: tokens [n0, n0 + BLOCK_N) of head h of sample b (grid: n blocks, B*H).
    qt [BH, d, N] = relu(q)^T, kc [BH, N, d] = relu(k), vp [BH, d + 1, N] = (v^T; 1)."""
    bh = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, HEAD)
    if INT64:
        bh = bh.to(tl.int64)
        n = n.to(tl.int64)
    b = bh // H
    h = bh - b * H
    m = (n < N)[:, None]
    col = (h * HEAD + j)[None, :]
    q = tl.load(q_ptr + (b * q_sb + (n * q_sn)[:, None] + col), mask=m, other=0.0)
    k = tl.load(k_ptr + (b * k_sb + (n * k_sn)[:, None] + col), mask=m, other=0.0)
    v = tl.load(v_ptr + (b * v_sb + (n * v_sn)[:, None] + col), mask=m, other=0.0)
    # eager: relu in the storage dtype, then .float(): both exact, in either order
    q = _relu(q.to(tl.float32), KEEP_NEG_ZERO)
    k = _relu(k.to(tl.float32), KEEP_NEG_ZERO)
    v = v.to(tl.float32)
    tl.store(kc_ptr + ((bh * N + n) * HEAD)[:, None] + j[None, :], k, mask=m)
    tl.store(qt_ptr + (bh * HEAD * N + n)[:, None] + (j * N)[None, :], q, mask=m)
    vrow = bh * (HEAD + 1) * N + n
    tl.store(vp_ptr + vrow[:, None] + (j * N)[None, :], v, mask=m)
    tl.store(vp_ptr + (vrow + HEAD * N), tl.full((BLOCK_N,), 1.0, tl.float32), mask=n < N)


@jit
def _epilogue_kernel(
    hid_ptr, out_ptr,
    N, H,
    o_sb, o_sn, o_sc,
    eps,
    HEAD: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One program: tokens [n0, n0 + BLOCK_N) of head h of sample b. hidden [BH, d + 1, N]
    fp32 -> out[b, n, h * d + j] = hidden[bh, j, n] / (hidden[bh, d, n] + eps)."""
    bh = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, HEAD)
    if INT64:
        bh = bh.to(tl.int64)
        n = n.to(tl.int64)
    b = bh // H
    h = bh - b * H
    nm = n < N
    base = bh * (HEAD + 1) * N
    num = tl.load(hid_ptr + (base + (j * N)[:, None] + n[None, :]), mask=nm[None, :], other=1.0)
    den = tl.load(hid_ptr + (base + HEAD * N + n), mask=nm, other=1.0) + eps  # eager: one fp32 add
    if INTERP:
        y = num / den[None, :]
    else:  # aten's division: IEEE, round to nearest
        y = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [num, tl.broadcast_to(den[None, :],
                                      num.shape)], dtype=tl.float32, is_pure=True, pack=1)
    off = b * o_sb + (n * o_sn)[None, :] + ((h * HEAD + j) * o_sc)[:, None]
    tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=nm[None, :])


_prep = FastLaunch(_prep_kernel, ("HEAD", "KEEP_NEG_ZERO", "INT64", "BLOCK_N"))
_post = FastLaunch(_epilogue_kernel, ("HEAD", "INT64", "BLOCK_N", "INTERP"))


# ---------------------------------------------------------------- a probe of the running build

_NEG_ZERO: dict = {}


def relu_keeps_negative_zero(device, dtype: torch.dtype) -> bool | None:
    """Whether eager's relu returns -0.0 for -0.0 in `dtype` on `device` (aten's CUDA
    relu is `max(x, 0)`), probed once per device and dtype; None where it can't be
    probed now (tracing, capture)."""
    index = device_index(device)
    key = (index, dtype)
    known = _NEG_ZERO.get(key)
    if known is not None:
        return known
    if not probe_allowed(index):
        return None
    x = torch.tensor([-0.0, 1.0], dtype=dtype, device="cpu" if index < 0 else f"cuda:{index}")
    result = bool(torch.relu(x)[0].signbit().item())
    _NEG_ZERO[key] = result
    return result


# ---------------------------------------------------------------- planner and launcher


class LinearAttentionPlan:
    """A call that passed the guard: operands, geometry, launches and the gate key."""

    __slots__ = ("q", "k", "v", "heads", "head", "keep", "prep", "post", "key")

    def __init__(self, q, k, v, heads, head, keep, prep, post, key):
        self.q, self.k, self.v, self.heads, self.head, self.keep = q, k, v, heads, head, keep
        self.prep, self.post, self.key = prep, post, key


BLOCK_N, NUM_WARPS = 64, 4  # 64 tokens of one head a program


def _recipes(B, N, C, heads, head, keep, strides, wide):
    """The prep kernel's launch, and the epilogue's into eager's output strides."""
    (q_sb, q_sn), (k_sb, k_sn), (v_sb, v_sn) = strides
    grid = (cdiv(N, BLOCK_N), B * heads, 1)
    prep = Recipe(grid, (N, heads, q_sb, q_sn, k_sb, k_sn, v_sb, v_sn), (head, keep, wide, BLOCK_N), NUM_WARPS)
    post = Recipe(grid, (N, heads, C * N, 1, N, EPS), (head, wide, BLOCK_N, INTERPRET), NUM_WARPS)
    return prep, post


_geometry = GeometryCache()


def plan_linear_attention(q, k, v, heads, tier: str = "lossless"):
    """The guard of `linear_attention` (q, k, v [B, N, C], one dtype, last dimension
    contiguous, `heads` dividing C into heads of a power of two up to 128 channels): a
    plan, or the reason the call takes the reference."""
    if not HAS_TRITON:
        return "triton is not installed"
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return "q, k and v must be tensors"
    why = common_device_dtype(q, k, v)
    if why:
        return why
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        return "q, k and v must be [B, N, C] of one shape"
    if not isinstance(heads, int) or heads < 1 or q.shape[2] % heads:
        return f"heads={heads!r} does not divide C={q.shape[2]}"
    B, N, C = q.shape
    head = C // heads
    if head & (head - 1) or head > 128:
        return f"heads of {head} channels (the kernels take powers of two up to 128)"
    if q.numel() == 0:
        return "empty tensor"
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        return "a last dimension is not contiguous"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "autograd needs the eager graph"
    keep = relu_keeps_negative_zero(q.device, q.dtype)
    if keep is None:
        return "relu's sign of -0.0 can't be probed now (tracing, capture)"
    strides = ((q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)), (v.stride(0), v.stride(1)))
    wide = needs_int64((B, q.stride(0)), (N, q.stride(1)), (B, k.stride(0)), (N, k.stride(1)), (B, v.stride(0)),
                       (N, v.stride(1)), (B * heads * (head + 1), N), (B, C * N), (C, N))
    prep, post = _geometry.get((B, N, C, heads, head, keep, strides, wide), _recipes, B, N, C, heads, head, keep,
                               strides, wide)
    key = (q.dtype, q.get_device(), f"heads of {head}", "wide" if wide else "narrow")
    return LinearAttentionPlan(q, k, v, heads, head, keep, prep, post, key)


def _outputs(q, heads, head) -> tuple:
    """The three bmm operands the prep kernel writes and the output (eager's strides),
    as `Output`s for q's geometry."""
    B, N, C = q.shape
    device, f32 = q.get_device(), torch.float32
    return (Output((B * heads, head, N), contiguous_strides((B * heads, head, N)), f32, device),
            Output((B * heads, N, head), contiguous_strides((B * heads, N, head)), f32, device),
            Output((B * heads, head + 1, N), contiguous_strides((B * heads, head + 1, N)), f32, device),
            Output((B, N, C), (C * N, 1, N), q.dtype, device))


def _run(q, k, v, heads, head, prep, post, out, outputs=None):
    """The prep kernel into the three bmm operands eager builds, its two bmm calls, the
    epilogue kernel into `out` (default: eager's strides). `outputs`: `_outputs` of q's
    geometry, where the caller keeps them."""
    B, N, C = q.shape
    qt_of, kc_of, vp_of, out_of = outputs or _outputs(q, heads, head)
    qt, kc, vp = qt_of(), kc_of(), vp_of()
    _prep.launch(prep, (q, k, v, qt, kc, vp))
    hidden = torch.bmm(torch.bmm(vp, kc), qt)  # eager's two matmuls, on the operands it builds
    if out is None:
        out = out_of()
        _post.launch(post, (hidden, out))
        return out
    wide = prep.consts[2] or needs_int64((B, out.stride(0)), (N, out.stride(1)), (C, out.stride(2)))
    _post(post.grid, (hidden, out), (N, heads, *out.stride(), EPS), (head, wide, BLOCK_N, INTERPRET), NUM_WARPS)
    return out


def launch_linear_attention(plan: LinearAttentionPlan, out=None) -> torch.Tensor:
    """The prep kernel, eager's two bmm calls, the epilogue kernel, into `out` ([B, N, C],
    any strides) if given."""
    return _run(plan.q, plan.k, plan.v, plan.heads, plan.head, plan.prep, plan.post, out)


def bind_linear_attention(plan: LinearAttentionPlan):
    """The plan's launches bound to its geometry (`OpSpec.bind`): `run(q, k, v, heads)`
    for a call with the plan's shapes, strides, dtypes and devices."""
    head, prep, post = plan.head, plan.prep, plan.post
    outputs = _outputs(plan.q, plan.heads, head)

    def run(q, k, v, heads):
        return _run(q, k, v, heads, head, prep, post, None, outputs)

    return run


def linear_attention(q, k, v, heads: int) -> torch.Tensor:
    """Sana's linear attention from the projections to `to_out`'s input, guarded but
    ungated: the kernels where eligible, else the eager reference. q, k, v: [B, N, C];
    heads dividing C. Returns [B, N, C] in q's dtype, strides (C*N, 1, N)."""
    plan = plan_linear_attention(q, k, v, heads)
    if plan.__class__ is str:
        return linear_attention_reference(q, k, v, heads)
    return launch_linear_attention(plan)


# ---------------------------------------------------------------- reference


def linear_attention_reference(q, k, v, heads: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The eager expression, line for line as `SanaLinearAttnProcessor2_0` writes it
    between the projections (and their norms) and `to_out`; `dtype`: the processor's
    `original_dtype` (default q's)."""
    original_dtype = q.dtype if dtype is None else dtype
    query = q.transpose(1, 2).unflatten(1, (heads, -1))
    key = k.transpose(1, 2).unflatten(1, (heads, -1)).transpose(2, 3)
    value = v.transpose(1, 2).unflatten(1, (heads, -1))

    query = F.relu(query)
    key = F.relu(key)

    query, key, value = query.float(), key.float(), value.float()

    value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)
    scores = torch.matmul(value, key)
    hidden_states = torch.matmul(scores, query)

    hidden_states = hidden_states[:, :, :-1] / (hidden_states[:, :, -1:] + 1e-15)
    hidden_states = hidden_states.flatten(1, 2).transpose(1, 2)
    return hidden_states.to(original_dtype)


LAYOUTS = ("contiguous", "strided")  # q, k, v: [B, N, C] each, or slices of one [B, N, 3C] projection


def heads_for(C: int) -> int:
    """Heads for a width in test and benchmark cases: heads of 32 channels (Sana's) where
    C allows, else of the largest power of two dividing C (up to 128)."""
    if C % 32 == 0:
        return C // 32
    head = min(128, C & -C)
    return C // head


def _make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    B, N, C = case.B, case.S, case.D
    if case.layout == "contiguous":
        q, k, v = (cases.draw((B, N, C), case.dtype, case.data, gen, case.device) for _ in range(3))
    elif case.layout == "strided":
        qkv = cases.draw((B, N, 3 * C), case.dtype, case.data, gen, case.device)
        q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
    else:
        raise ValueError(f"unknown linear-attention layout {case.layout!r}; choose one of {', '.join(LAYOUTS)}")
    return q, k, v, heads_for(C)


SPEC = OpSpec(
    name="linear_attention",
    reference=linear_attention_reference,
    plan=plan_linear_attention,
    launch={"lossless": launch_linear_attention},
    bind={"lossless": bind_linear_attention},
    make_args=_make_args,
    layouts=LAYOUTS,
)


# ---------------------------------------------------------------- torch.library


def _linear_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    return linear_attention(q, k, v, heads)


linear_attention_op = register_op("linear_attention", _linear_attention_op, linear_attention_reference)
