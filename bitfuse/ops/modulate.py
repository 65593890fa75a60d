"""adaLN modulation: `x * (1 + scale) + shift`.

Shapes: x [B, S, D] or [N, D], any strides; scale and shift broadcast to x
(per-sample [B, 1, D], per-token [B, S, D], shared [D], or strided views such
as diffusers' `unbind` and `chunk` results, read in place), or `Folded`. One
dtype throughout: bf16, fp16 or fp32 (mixed dtypes take eager's promotion, the
reference). Output: a new contiguous tensor of x's shape and dtype.

The kernel reproduces eager PyTorch bit for bit: eager runs three ops, each
computing in fp32 ("opmath") and rounding to the storage dtype once, so the
kernel rounds after `1 + scale`, after the product and after the sum. FMA
contraction is switched off at compile time, or Triton fuses the product and
the sum into one FMA and the middle rounding is lost (6.8M of 25M elements
differed on an H200 with it on).

There is no separate high-tier kernel: the op is bound by memory traffic, so
eager's roundings cost nothing and every tier gets the exact result.
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
    bound_param_launch,
    broadcast_strides,
    common_device_dtype,
    launch_shape,
    layout_class,
    load_row_param,
    over_rows,
    pointwise_rows,
    pointwise_tile,
    tables_of,
    tile_launch,
    value,
    wide_offsets,
)
from .spec import OpSpec

# ---------------------------------------------------------------- kernel


@jit
def _modulate_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr, scale_table_ptr, shift_table_ptr,
    S, D,
    x_sb, x_ss, x_sd,
    c_sb, c_ss, c_sd,
    h_sb, h_ss, h_sd,
    ct_sd, ht_sd,
    SCALE_PER_ROW: tl.constexpr,
    SHIFT_PER_ROW: tl.constexpr,
    SCALE_TABLE: tl.constexpr,
    SHIFT_TABLE: tl.constexpr,
    EVEN: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NCB: tl.constexpr,
):
    b, s, cols = pointwise_tile(INT64, BLOCK_R, BLOCK_D, NCB)
    if EVEN:  # S % BLOCK_R == 0 and D % BLOCK_D == 0: no masks, as Inductor's kernels
        col_ok = None
        mask = None
    else:
        col_ok = cols < D
        mask = (s < S)[:, None] & col_ok[None, :]

    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + ((b * x_sb + s * x_ss)[:, None] + (cols * x_sd)[None, :]), mask=mask).to(tl.float32)
    scale = load_row_param(scale_ptr, b, s, cols, c_sb, c_ss, c_sd, mask, col_ok, scale_table_ptr, ct_sd,
                           SCALE_PER_ROW, SCALE_TABLE, dtype)
    shift = load_row_param(shift_ptr, b, s, cols, h_sb, h_ss, h_sd, mask, col_ok, shift_table_ptr, ht_sd,
                           SHIFT_PER_ROW, SHIFT_TABLE, dtype)

    t = (1.0 + scale).to(dtype).to(tl.float32)  # eager: 1 + scale
    p = (x * t).to(dtype).to(tl.float32)  # eager: x * t
    y = p + shift  # eager: p + shift
    tl.store(out_ptr + (((b * S + s) * D)[:, None] + cols[None, :]), y.to(dtype), mask=mask)


_launch = FastLaunch(_modulate_kernel, ("SCALE_PER_ROW", "SHIFT_PER_ROW", "SCALE_TABLE", "SHIFT_TABLE", "EVEN", "INT64",
                                        "BLOCK_R", "BLOCK_D", "NCB"))


# ---------------------------------------------------------------- launcher


class ModulatePlan(NamedTuple):
    """A call that passed the guard: operands, geometry, launch constants, gate key."""

    x: torch.Tensor
    scale: torch.Tensor  # for a Folded parameter: its temb view
    shift: torch.Tensor
    rows: Rows
    c_strides: tuple
    h_strides: tuple
    key: tuple
    wide: bool  # offsets may pass 2**31: index in int64
    recipe: Recipe  # the default launch
    scale_table: torch.Tensor | None = None  # Folded: the table row added on the fly
    shift_table: torch.Tensor | None = None


_geometry = GeometryCache()


def plan_modulate(x, scale, shift, tier: str = "lossless") -> ModulatePlan | str:
    """The guard: a plan for the kernel, or the reason the call takes the reference."""
    if not HAS_TRITON:
        return "triton is not installed"
    unpacked = tables_of(scale, shift, x)
    if unpacked.__class__ is str:
        return unpacked
    scale, shift, scale_table, shift_table = unpacked
    why = common_device_dtype(x, scale, shift)
    if why:
        return why
    cache_key = (x.shape, x.stride(), scale.shape, scale.stride(), shift.shape, shift.stride(), x.dtype,
                 x.get_device(), scale_table is None or scale_table.stride(), shift_table is None or shift_table.stride())
    geometry = _geometry.get(cache_key, _geometry_of, x, scale, shift, scale_table, shift_table)
    if geometry.__class__ is str:
        return geometry
    return ModulatePlan(x, scale, shift, *geometry, scale_table, shift_table)


def _geometry_of(x, scale, shift, scale_table=None, shift_table=None, wide=None):
    """The guard's per-layout work and the default launch (`wide`: force int64 offsets, for tests)."""
    r = pointwise_rows(x)
    if r.__class__ is str:
        return r
    c = broadcast_strides(scale, x.shape)
    h = broadcast_strides(shift, x.shape)
    if c is None or h is None:
        return "scale/shift do not broadcast to x's shape"
    wide = wide or wide_offsets(r, *over_rows(r, c), *over_rows(r, h))
    key = (x.dtype, x.get_device(), layout_class(c, scale) + ("+table" if scale_table is not None else ""),
           layout_class(h, shift) + ("+table" if shift_table is not None else ""))
    streams = 2 + (c[1] != 0) + (h[1] != 0)
    config = launch_shape(r.D, r.B * r.S, x.element_size(), streams)
    return r, c, h, key, wide, _recipe(r, c, h, wide, scale_table, shift_table, config)


def _recipe(r: Rows, c, h, wide, ct, ht, config) -> Recipe:
    block_r, block_d, num_warps = config
    grid, even, ncb = tile_launch(r, block_r, block_d)
    return Recipe(
        grid,
        (r.S, r.D, r.sb, r.ss, r.sd, *c, *h, 0 if ct is None else ct.stride(0), 0 if ht is None else ht.stride(0)),
        (c[1] != 0, h[1] != 0, ct is not None, ht is not None, even, wide, block_r, block_d, ncb),
        num_warps,
    )


def _operands(x, scale, shift, out, ct, ht) -> tuple:
    return x, scale, shift, out, scale if ct is None else ct, shift if ht is None else ht


def launch_modulate(plan: ModulatePlan, out=None, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (BLOCK_R, BLOCK_D, num_warps)."""
    x, ct, ht = plan.x, plan.scale_table, plan.shift_table
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    recipe = plan.recipe if config is None else _recipe(plan.rows, plan.c_strides, plan.h_strides, plan.wide, ct, ht,
                                                        config)
    _launch.launch(recipe, _operands(x, plan.scale, plan.shift, out, ct, ht))
    return out


def bind_modulate(plan: ModulatePlan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(x, scale, shift)` for
    a call with the plan's shapes, strides, dtypes and devices (Folded where the plan's were)."""
    return bound_param_launch(_launch.launch, plan.recipe, _operands, plan.scale_table is not None,
                              plan.shift_table is not None, Output.contiguous_like(plan.x))


def modulate(x, scale, shift) -> torch.Tensor:
    """`x * (1 + scale) + shift`, guarded but ungated: the kernel where eligible,
    else the eager reference. `scale`/`shift` may be Folded."""
    plan = plan_modulate(x, scale, shift)
    if plan.__class__ is str:
        return modulate_reference(x, scale, shift)
    return launch_modulate(plan)


# ---------------------------------------------------------------- reference


def modulate_reference(x, scale, shift) -> torch.Tensor:
    """The eager expression, as models write it (Folded parameters materialised first)."""
    return x * (1 + value(scale)) + value(shift)


def modulate_reference64(x, scale, shift) -> torch.Tensor:
    return x.double() * (1 + value(scale).double()) + value(shift).double()


def modulate_terms(x, scale, shift) -> torch.Tensor:
    """|x * (1 + scale)| and |shift|, the larger, in float64."""
    return (x.double() * (1 + value(scale).double())).abs().maximum(value(shift).double().abs())


def _make_args(case: cases.Case) -> tuple:
    gen = case.generator()
    x = cases.activation(case, gen)
    scale, shift = cases.param(case, gen, 2)
    return x, scale, shift


SPEC = OpSpec(
    name="modulate",
    reference=modulate_reference,
    plan=plan_modulate,
    launch={"lossless": launch_modulate},
    bind={"lossless": bind_modulate},
    reference64=modulate_reference64,
    terms=modulate_terms,
    make_args=_make_args,
    layouts=cases.PARAM_LAYOUTS,
)


# ---------------------------------------------------------------- torch.library


def _modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return modulate(x, scale, shift)


modulate_op = register_op("modulate", _modulate_op, modulate_reference)
