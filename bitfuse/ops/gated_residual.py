"""Gated residual: `x + y * gate`.

Shapes: x and y [B, S, D] or [N, D] (the same shape, any strides); gate
broadcasts to x like an adaLN parameter (per-sample, per-token, shared, strided
views, or `Folded`). One dtype throughout: bf16, fp16 or fp32. Output: a new
contiguous tensor of x's shape and dtype.

The kernel reproduces eager's two roundings (after the product, after the
sum) with FMA contraction off. Written `gate * y` (FLUX's
`gate.unsqueeze(1) * out`), the product is the same: floating-point
multiplication commutes bitwise. As for modulate, every tier gets the exact
result.
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
    Folded,
    Rows,
    broadcast_strides,
    common_device_dtype,
    launch_shape,
    layout_class,
    load_param,
    load_row_param,
    over_rows,
    pointwise_rows,
    pointwise_tile,
    rows_of,
    table_of,
    tile_launch,
    value,
    value32,
    wide_offsets,
)
from .spec import OpSpec

# ---------------------------------------------------------------- kernel


@jit
def _gated_residual_kernel(
    x_ptr, y_ptr, gate_ptr, out_ptr, gate_table_ptr, y_table_ptr,
    S, D,
    x_sb, x_ss, x_sd,
    y_sb, y_ss, y_sd,
    g_sb, g_ss, g_sd,
    gt_sd, yt_sd,
    GATE_PER_ROW: tl.constexpr,
    GATE_TABLE: tl.constexpr,
    Y_TABLE: tl.constexpr,  # Folded y: `y + bias row`, rounded to x's dtype as eager's add_ of a bias
    F32: tl.constexpr,  # the fp32-compute variant: no rounding before the store
    EVEN: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NCB: tl.constexpr,
):
    b, s, cols = pointwise_tile(INT64, BLOCK_R, BLOCK_D, NCB)
    if EVEN:  # S % BLOCK_R == 0 and D % BLOCK_D == 0: no masks
        col_ok = None
        mask = None
    else:
        col_ok = cols < D
        mask = (s < S)[:, None] & col_ok[None, :]

    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + ((b * x_sb + s * x_ss)[:, None] + (cols * x_sd)[None, :]), mask=mask).to(tl.float32)
    y = load_param(y_ptr, (b * y_sb + s * y_ss)[:, None] + (cols * y_sd)[None, :], mask, y_table_ptr, cols * yt_sd,
                   col_ok, Y_TABLE, dtype, False)
    if F32:  # eager: (x.float() + y * gate).type_as(x), gate fp32 (a Folded one: table + temb.float())
        gate = load_row_param(gate_ptr, b, s, cols, g_sb, g_ss, g_sd, mask, col_ok, gate_table_ptr, gt_sd,
                              GATE_PER_ROW, GATE_TABLE, tl.float32)
        m = y * gate  # fp32 product, rounded in fp32
    else:
        gate = load_row_param(gate_ptr, b, s, cols, g_sb, g_ss, g_sd, mask, col_ok, gate_table_ptr, gt_sd,
                              GATE_PER_ROW, GATE_TABLE, dtype)
        m = (y * gate).to(dtype).to(tl.float32)  # eager: y * gate
    out = x + m  # eager: x + m
    tl.store(out_ptr + (((b * S + s) * D)[:, None] + cols[None, :]), out.to(dtype), mask=mask)


_launch = FastLaunch(_gated_residual_kernel, ("GATE_PER_ROW", "GATE_TABLE", "Y_TABLE", "F32", "EVEN", "INT64",
                                              "BLOCK_R", "BLOCK_D", "NCB"))


# ---------------------------------------------------------------- launcher


class GatedResidualPlan(NamedTuple):
    """A call that passed the guard: operands, geometry, launch constants, gate key."""

    x: torch.Tensor
    y: torch.Tensor
    gate: torch.Tensor
    rows: Rows
    y_rows: Rows
    g_strides: tuple
    key: tuple
    wide: bool  # offsets may pass 2**31: index in int64
    recipe: Recipe  # the default launch
    gate_table: torch.Tensor | None = None  # Folded gate: the table row added on the fly
    f32: bool = False  # the fp32-compute variant (`gated_residual_f32`)
    y_table: torch.Tensor | None = None  # Folded y: its bias row added on the fly


_geometry = GeometryCache()


def plan_gated_residual(x, y, gate, tier: str = "lossless") -> GatedResidualPlan | str:
    """The guard: a plan for the kernel, or the reason the call takes the reference.
    `gate` may be Folded (table row + temb, added with eager's rounding), and so may
    `y` (a [D] bias row + the branch's output of x's shape: a layer's output whose bias
    eager adds as a separate op, `sites.linear_bias_split`)."""
    if not HAS_TRITON:
        return "triton is not installed"
    table = y_table = None
    if gate.__class__ is Folded:
        gate, table, why = table_of(gate, x)
        if why:
            return why
    if y.__class__ is Folded:
        y, y_table, why = table_of(y, x)
        if why:
            return "y: " + why
    why = common_device_dtype(x, y, gate)
    if why:
        return why
    cache_key = (x.shape, x.stride(), y.shape, y.stride(), gate.shape, gate.stride(), x.dtype, x.get_device(),
                 table is None or table.stride(), y_table is None or y_table.stride())
    geometry = _geometry.get(cache_key, _geometry_of, x, y, gate, table, None, False, y_table)
    if geometry.__class__ is str:
        return geometry
    return GatedResidualPlan(x, y, gate, *geometry, table, False, y_table)


def plan_gated_residual_f32(x, y, gate, tier: str = "lossless") -> GatedResidualPlan | str:
    """The guard of the fp32-compute variant `(x.float() + y * gate).type_as(x)`: x and y
    of one dtype (bf16, fp16 or fp32), gate fp32 (or Folded, summed in fp32 as
    `value32`); a plan, or the reason the call takes the reference."""
    if not HAS_TRITON:
        return "triton is not installed"
    table = None
    if gate.__class__ is Folded:
        gate, table, why = table_of(gate, x, f32=True)
        if why:
            return why
    elif not isinstance(gate, torch.Tensor):
        return "gate is not a tensor"
    elif gate.dtype is not torch.float32:
        return "gate is not fp32 (the fp32-compute variant)"
    why = common_device_dtype(x, y) or _same_device_no_grad(x, gate, table)
    if why:
        return why
    cache_key = (x.shape, x.stride(), y.shape, y.stride(), gate.shape, gate.stride(), x.dtype, x.get_device(),
                 table is None or (table.stride(), table.dtype), gate.dtype, "f32")
    geometry = _geometry.get(cache_key, _geometry_of, x, y, gate, table, None, True)
    if geometry.__class__ is str:
        return geometry
    return GatedResidualPlan(x, y, gate, *geometry, table, True)


def _same_device_no_grad(x, *params) -> str | None:
    grad = torch.is_grad_enabled()
    for p in params:
        if p is None:
            continue
        if p.get_device() != x.get_device():
            return "operands on different devices"
        if grad and p.requires_grad:
            return "autograd needs the eager graph"
    return None


def _geometry_of(x, y, gate, table=None, wide=None, f32=False, y_table=None):
    """The guard's per-layout work and the default launch (`wide`: force int64 offsets, for tests)."""
    r = pointwise_rows(x)
    if r.__class__ is str:
        return r
    if y.shape != x.shape:
        return "y must have x's shape"
    g = broadcast_strides(gate, x.shape)
    if g is None:
        return "gate does not broadcast to x's shape"
    yr = rows_of(y)
    wide = wide or wide_offsets(r, *over_rows(r, (yr.sb, yr.ss, yr.sd)), *over_rows(r, g))
    key = (x.dtype, x.get_device(), layout_class(g, gate) + ("+table" if table is not None else ""))
    if y_table is not None:
        key += ("y+bias",)
    if f32:
        key += (f"f32 {gate.dtype}" + ("" if table is None else f"+{table.dtype}"),)
    config = launch_shape(r.D, r.B * r.S, x.element_size(), 3 + (g[1] != 0))
    return r, yr, g, key, wide, _recipe(r, yr, g, wide, table, config, f32, y_table)


def _recipe(r: Rows, yr: Rows, g, wide, gt, config, f32=False, yt=None) -> Recipe:
    block_r, block_d, num_warps = config
    grid, even, ncb = tile_launch(r, block_r, block_d)
    return Recipe(
        grid,
        (r.S, r.D, r.sb, r.ss, r.sd, yr.sb, yr.ss, yr.sd, *g, 0 if gt is None else gt.stride(0),
         0 if yt is None else yt.stride(0)),
        (g[1] != 0, gt is not None, yt is not None, f32, even, wide, block_r, block_d, ncb),
        num_warps,
    )


def launch_gated_residual(plan: GatedResidualPlan, out=None, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (BLOCK_R, BLOCK_D, num_warps)."""
    x, gt, yt = plan.x, plan.gate_table, plan.y_table
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    recipe = plan.recipe if config is None else _recipe(plan.rows, plan.y_rows, plan.g_strides, plan.wide, gt, config,
                                                        plan.f32, yt)
    _launch.launch(recipe, (x, plan.y, plan.gate, out, plan.gate if gt is None else gt, plan.y if yt is None else yt))
    return out


def bind_gated_residual(plan: GatedResidualPlan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(x, y, gate)` for a
    call with the plan's shapes, strides, dtypes and devices (a Folded gate, or y, where
    the plan's was)."""
    recipe, launch = plan.recipe, _launch.launch
    folded, y_folded = plan.gate_table is not None, plan.y_table is not None
    output = Output.contiguous_like(plan.x)

    def run(x, y, gate):
        gt = yt = None
        if folded:
            gt, gate = gate.table, gate.temb
        if y_folded:
            yt, y = y.table, y.temb
        out = output()
        launch(recipe, (x, y, gate, out, gate if gt is None else gt, y if yt is None else yt))
        return out

    return run


def gated_residual(x, y, gate) -> torch.Tensor:
    """`x + y * gate`, guarded but ungated: the kernel where eligible, else the eager reference."""
    plan = plan_gated_residual(x, y, gate)
    if plan.__class__ is str:
        return gated_residual_reference(x, y, gate)
    return launch_gated_residual(plan)


def gated_residual_f32(x, y, gate) -> torch.Tensor:
    """`(x.float() + y * gate).type_as(x)` (Wan), guarded but ungated. x, y: [B, S, D] or
    [N, D] of one dtype (bf16, fp16 or fp32); gate: fp32 broadcasting to x, or Folded
    (`table + temb.float()`). Returns a tensor of x's shape and dtype, row-major."""
    plan = plan_gated_residual_f32(x, y, gate)
    if plan.__class__ is str:
        return gated_residual_f32_reference(x, y, gate)
    return launch_gated_residual(plan)


# ---------------------------------------------------------------- reference


def gated_residual_reference(x, y, gate) -> torch.Tensor:
    """The eager expression, as models write it (a Folded gate or y materialised first)."""
    return x + value(y) * value(gate)


def gated_residual_f32_reference(x, y, gate) -> torch.Tensor:
    """Wan's eager expression: `(x.float() + y * gate).type_as(x)` with an fp32 gate
    (`y * gate` promotes y exactly, so `y.float() * gate`, Wan's feed-forward form, is
    the same); a Folded gate is `table + temb.float()` (`value32`)."""
    return (x.float() + y * value32(gate)).type_as(x)


def _reference64(x, y, gate) -> torch.Tensor:
    return x.double() + value(y).double() * value(gate).double()


def _terms(x, y, gate) -> torch.Tensor:
    return x.double().abs().maximum((value(y).double() * value(gate).double()).abs())


def _make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    x = cases.activation(case, gen)
    y = cases.draw((case.B, case.S, case.D), case.dtype, case.data, gen, case.device)
    (gate,) = cases.param(case, gen, 1)
    return x, y, gate


def _f32_reference64(x, y, gate) -> torch.Tensor:
    return x.double() + y.double() * value32(gate).double()


def _f32_terms(x, y, gate) -> torch.Tensor:
    return x.double().abs().maximum((y.double() * value32(gate).double()).abs())


def _f32_make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    x = cases.activation(case, gen)
    y = cases.draw((case.B, case.S, case.D), case.dtype, case.data, gen, case.device)
    (gate,) = cases.param_f32(case, gen, 1)
    return x, y, gate


SPEC = OpSpec(
    name="gated_residual",
    reference=gated_residual_reference,
    plan=plan_gated_residual,
    launch={"lossless": launch_gated_residual},
    bind={"lossless": bind_gated_residual},
    reference64=_reference64,
    terms=_terms,
    make_args=_make_args,
    layouts=cases.PARAM_LAYOUTS,
)


# ---------------------------------------------------------------- torch.library


def _gated_residual_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return gated_residual(x, y, gate)


gated_residual_op = register_op("gated_residual", _gated_residual_op, gated_residual_reference)


# ---------------------------------------------------------------- the fp32-compute variant (Wan)

F32_SPEC = OpSpec(
    name="gated_residual_f32",
    reference=gated_residual_f32_reference,
    plan=plan_gated_residual_f32,
    launch={"lossless": launch_gated_residual},
    bind={"lossless": bind_gated_residual},
    reference64=_f32_reference64,
    terms=_f32_terms,
    make_args=_f32_make_args,
    layouts=cases.F32_PARAM_LAYOUTS,
)


def _gated_residual_f32_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return gated_residual_f32(x, y, gate)


gated_residual_f32_op = register_op("gated_residual_f32", _gated_residual_f32_op, gated_residual_f32_reference)
