"""Per-head gate: `(y.unflatten(-1, (H, -1)) * gate.unsqueeze(-1)).flatten(-2)`.

LTX-2.3's gated attention scales each head of the attention output by its own
gate (`2 * sigmoid(to_gate_logits(x))`, one value per token and head) before
the output projection. Eager runs the product as a broadcast multiply, which
TensorIterator cannot vectorise (the gate's stride-0 axis): on the H200 it moved
37% of the copy bandwidth, the kernel 84% (bench/NOTES.md). The kernel reads y in
place and the gate once per head.

Shapes: y [B, S, C] or [N, C], any strides (not permuted); gate [B, S, H]
([N, H]) or any shape broadcasting to it (per-sample [B, 1, H], strided views),
H dividing C: heads of C / H channels. One dtype throughout: bf16, fp16 or
fp32 (mixed dtypes take eager's promotion, the reference). Output: a new
contiguous tensor of y's shape and dtype.

Exact in every tier: eager computes the product in fp32 and rounds it once;
the kernel does the same (for bf16 and fp16 operands the fp32 product is
exact, for fp32 both round it to nearest even).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import cases
from ._launch import (
    HAS_TRITON,
    FastLaunch,
    GeometryCache,
    Output,
    Recipe,
    jit,
    register_op,
    tl,
)
from ._params import (
    Rows,
    broadcast_strides,
    common_device_dtype,
    launch_shape,
    layout_class,
    pointwise_rows,
    pointwise_tile,
    tile_launch,
    wide_offsets,
)
from .spec import OpSpec

# ---------------------------------------------------------------- kernel


@jit
def _head_gate_kernel(
    y_ptr, gate_ptr, out_ptr,
    S, C,
    y_sb, y_ss, y_sc,
    g_sb, g_ss, g_sh,
    HEAD_DIM: tl.constexpr,
    EVEN: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NCB: tl.constexpr,
):
    b, s, cols = pointwise_tile(INT64, BLOCK_R, BLOCK_D, NCB)
    if EVEN:  # S % BLOCK_R == 0 and C % BLOCK_D == 0: no masks
        mask = None
    else:
        mask = (s < S)[:, None] & (cols < C)[None, :]

    dtype = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + ((b * y_sb + s * y_ss)[:, None] + (cols * y_sc)[None, :]), mask=mask).to(tl.float32)
    head = cols // HEAD_DIM  # a constant divisor: a shift for powers of two
    g = tl.load(gate_ptr + ((b * g_sb + s * g_ss)[:, None] + (head * g_sh)[None, :]), mask=mask).to(tl.float32)
    tl.store(out_ptr + (((b * S + s) * C)[:, None] + cols[None, :]), (y * g).to(dtype), mask=mask)  # eager: y * g


_launch = FastLaunch(_head_gate_kernel, ("HEAD_DIM", "EVEN", "INT64", "BLOCK_R", "BLOCK_D", "NCB"))


# ---------------------------------------------------------------- launcher


class HeadGatePlan(NamedTuple):
    """A call that passed the guard: operands, geometry, launch constants, gate key."""

    y: torch.Tensor
    gate: torch.Tensor
    rows: Rows
    g_strides: tuple  # the gate's (batch, row, head) strides, 0 where it broadcasts
    head_dim: int
    key: tuple
    wide: bool  # offsets may pass 2**31: index in int64
    recipe: Recipe  # the default launch


_geometry = GeometryCache()


def plan_head_gate(y, gate, tier: str = "lossless") -> HeadGatePlan | str:
    """The guard: a plan for the kernel, or the reason the call takes the reference."""
    if not HAS_TRITON:
        return "triton is not installed"
    why = common_device_dtype(y, gate)
    if why:
        return why
    cache_key = (y.shape, y.stride(), gate.shape, gate.stride(), y.dtype, y.get_device())
    geometry = _geometry.get(cache_key, _geometry_of, y, gate)
    if geometry.__class__ is str:
        return geometry
    return HeadGatePlan(y, gate, *geometry)


def _geometry_of(y, gate, wide=None):
    """The guard's per-layout work and the default launch (`wide`: force int64 offsets, for tests)."""
    r = pointwise_rows(y, "y")
    if r.__class__ is str:
        return r
    if gate.dim() == 0:
        return "gate has no heads axis"
    heads = gate.shape[-1]
    if heads == 0 or r.D % heads:
        return f"y's {r.D} channels do not split into the gate's {heads} heads"
    g = broadcast_strides(gate, y.shape[:-1] + (heads,))
    if g is None:
        return "gate does not broadcast to y's rows"
    wide = wide or wide_offsets(r, (r.B, g[0]), (r.S, g[1]), (heads, g[2]))
    head_dim = r.D // heads
    key = (y.dtype, y.get_device(), layout_class(g, gate), f"heads of {head_dim}")
    config = launch_shape(r.D, r.B * r.S, y.element_size(), 2)
    return r, g, head_dim, key, wide, _recipe(r, g, head_dim, wide, config)


def _recipe(r: Rows, g, head_dim, wide, config) -> Recipe:
    block_r, block_d, num_warps = config
    grid, even, ncb = tile_launch(r, block_r, block_d)
    return Recipe(grid, (r.S, r.D, r.sb, r.ss, r.sd, *g), (head_dim, even, wide, block_r, block_d, ncb), num_warps)


def launch_head_gate(plan: HeadGatePlan, out=None, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, y's shape) if given.
    `config` overrides (BLOCK_R, BLOCK_D, num_warps)."""
    y = plan.y
    if out is None:
        out = torch.empty_like(y, memory_format=torch.contiguous_format)
    recipe = plan.recipe if config is None else _recipe(plan.rows, plan.g_strides, plan.head_dim, plan.wide, config)
    _launch.launch(recipe, (y, plan.gate, out))
    return out


def bind_head_gate(plan: HeadGatePlan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(y, gate)` for a call
    with the plan's shapes, strides, dtypes and devices."""
    recipe, launch = plan.recipe, _launch.launch
    output = Output.contiguous_like(plan.y)

    def run(y, gate):
        out = output()
        launch(recipe, (y, gate, out))
        return out

    return run


def head_gate(y, gate) -> torch.Tensor:
    """`y` scaled per head by `gate`, guarded but ungated: the kernel where eligible,
    else the eager reference. y: [B, S, C] or [N, C]; gate: [B, S, H] or broadcasting
    to it, H dividing C. Returns a tensor of y's shape and dtype."""
    plan = plan_head_gate(y, gate)
    if plan.__class__ is str:
        return head_gate_reference(y, gate)
    return launch_head_gate(plan)


# ---------------------------------------------------------------- reference


def head_gate_reference(y, gate) -> torch.Tensor:
    """The eager expression, as LTX-2.3's processors write it (H = gate.shape[-1])."""
    return (y.unflatten(-1, (gate.shape[-1], -1)) * gate.unsqueeze(-1)).flatten(-2)


def _reference64(y, gate) -> torch.Tensor:
    return head_gate_reference(y.double(), gate.double())


def _terms(y, gate) -> torch.Tensor:
    return _reference64(y, gate).abs()


LAYOUTS = ("per-token", "per-sample", "strided")  # the gate: [B, S, H], [B, 1, H], a view of [B, S, H + 3]


def heads_for(C: int) -> int:
    """Heads for a width in test and benchmark cases: heads of 128 or 64 channels
    where C allows (LTX-2.3's video and audio attentions), else 4 or 1."""
    for head_dim in (128, 64):
        if C % head_dim == 0:
            return C // head_dim
    return 4 if C % 4 == 0 else 1


def _make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    y = cases.activation(case, gen, scale=1.0)
    B, S, H = case.B, case.S, heads_for(case.D)
    if case.layout == "per-token":
        gate = cases.draw((B, S, H), case.dtype, case.data, gen, case.device)
    elif case.layout == "per-sample":
        gate = cases.draw((B, 1, H), case.dtype, case.data, gen, case.device)
    elif case.layout == "strided":
        gate = cases.draw((B, S, H + 3), case.dtype, case.data, gen, case.device)[..., 1 : H + 1]
    else:
        raise ValueError(f"unknown head-gate layout {case.layout!r}; choose one of {', '.join(LAYOUTS)}")
    return y, gate


SPEC = OpSpec(
    name="head_gate",
    reference=head_gate_reference,
    plan=plan_head_gate,
    launch={"lossless": launch_head_gate},
    bind={"lossless": bind_head_gate},
    reference64=_reference64,
    terms=_terms,
    make_args=_make_args,
    layouts=LAYOUTS,
)


# ---------------------------------------------------------------- torch.library


def _head_gate_op(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return head_gate(y, gate)


head_gate_op = register_op("head_gate", _head_gate_op, head_gate_reference)
