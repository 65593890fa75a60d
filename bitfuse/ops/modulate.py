"""adaLN modulation: `x * (1 + scale) + shift`.

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

from ._pointwise import (
    HAS_TRITON,
    FastLaunch,
    Recipe,
    Rows,
    broadcast_strides,
    cdiv,
    common_device_dtype,
    jit,
    launch_shape,
    layout_class,
    needs_int64,
    rows_of,
    tables_of,
    tl,
    value,
)

# ---------------------------------------------------------------- kernel


@jit
def _param(ptr, off, mask, table_ptr, t_off, t_mask, TABLE: tl.constexpr, dtype: tl.constexpr, KEEP: tl.constexpr):
    """A parameter in fp32; with TABLE, `temb + table_row` first, rounded to the
    storage dtype as eager's add in diffusers' get_mod_params rounds it. The row
    (1-D, along the columns) broadcasts against a 2-D tile of rows. KEEP: a parameter
    read by every program, kept in L2. (Every argument is passed: Triton 3.6 does not
    wrap a jit helper's default values as constexprs.)"""
    if KEEP:
        p = tl.load(ptr + off, mask=mask, eviction_policy="evict_last")
    else:
        p = tl.load(ptr + off, mask=mask)
    if TABLE:
        row = tl.load(table_ptr + t_off, mask=t_mask, eviction_policy="evict_last")
        p = (p.to(tl.float32) + row.to(tl.float32)).to(dtype)
    return p.to(tl.float32)


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
    NCB: tl.constexpr,  # column blocks a row (a constant: no integer division before the loads)
):
    # program (row chunk * NCB + column block, sample b): column blocks fastest, so
    # consecutive programs read consecutive memory (2048-column blocks, 6144 x 4096
    # bf16 on the H200: 26.3 us, against 27.1 with rows fastest in an earlier run)
    b = tl.program_id(2)
    pid = tl.program_id(0)
    rc = pid // NCB
    s = rc * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid - rc * NCB) * BLOCK_D + tl.arange(0, BLOCK_D)
    if INT64:
        b = b.to(tl.int64)
        s = s.to(tl.int64)
        cols = cols.to(tl.int64)
    if EVEN:  # S % BLOCK_R == 0 and D % BLOCK_D == 0: no masks, as Inductor's kernels
        col_ok = None
        mask = None
    else:
        col_ok = cols < D
        mask = (s < S)[:, None] & col_ok[None, :]

    dtype = out_ptr.dtype.element_ty
    x_off = (b * x_sb + s * x_ss)[:, None] + (cols * x_sd)[None, :]
    x = tl.load(x_ptr + x_off, mask=mask).to(tl.float32)
    # a parameter that doesn't vary along S is loaded once per program and kept in L2
    if SCALE_PER_ROW:
        c_off = (b * c_sb + s * c_ss)[:, None] + (cols * c_sd)[None, :]
        scale = _param(scale_ptr, c_off, mask, scale_table_ptr, cols * ct_sd, col_ok, SCALE_TABLE, dtype, False)
    else:
        scale = _param(scale_ptr, b * c_sb + cols * c_sd, col_ok, scale_table_ptr, cols * ct_sd, col_ok,
                       SCALE_TABLE, dtype, True)[None, :]
    if SHIFT_PER_ROW:
        h_off = (b * h_sb + s * h_ss)[:, None] + (cols * h_sd)[None, :]
        shift = _param(shift_ptr, h_off, mask, shift_table_ptr, cols * ht_sd, col_ok, SHIFT_TABLE, dtype, False)
    else:
        shift = _param(shift_ptr, b * h_sb + cols * h_sd, col_ok, shift_table_ptr, cols * ht_sd, col_ok,
                       SHIFT_TABLE, dtype, True)[None, :]

    t = (1.0 + scale).to(dtype).to(tl.float32)  # eager: 1 + scale
    p = (x * t).to(dtype).to(tl.float32)  # eager: x * t
    y = p + shift  # eager: p + shift
    o_off = ((b * S + s) * D)[:, None] + cols[None, :]
    tl.store(out_ptr + o_off, y.to(dtype), mask=mask)


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


_geometry: dict = {}  # (shapes, strides, dtype, device, tables) -> the guard's work and launch, once per layout


def plan_modulate(x, scale, shift) -> ModulatePlan | str:
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
    geometry = _geometry.get(cache_key)
    if geometry is None:
        geometry = _geometry_of(x, scale, shift, scale_table, shift_table)
        if len(_geometry) >= 4096:
            _geometry.clear()
        _geometry[cache_key] = geometry
    if geometry.__class__ is str:
        return geometry
    return ModulatePlan(x, scale, shift, *geometry, scale_table, shift_table)


def _geometry_of(x, scale, shift, scale_table=None, shift_table=None, wide=None):
    """The guard's per-layout work and the default launch (`wide`: force int64 offsets, for tests)."""
    r = rows_of(x)
    if r is None:
        return f"x must be 2-D or 3-D, got {x.dim()}-D"
    if x.numel() == 0:
        return "empty tensor"
    c = broadcast_strides(scale, x.shape)
    h = broadcast_strides(shift, x.shape)
    if c is None or h is None:
        return "scale/shift do not broadcast to x's shape"
    wide = wide or r.B * r.S * r.D >= 2**31 or needs_int64(
        (r.B, r.sb), (r.S, r.ss), (r.D, r.sd), (r.B, c[0]), (r.S, c[1]), (r.D, c[2]), (r.B, h[0]), (r.S, h[1]), (r.D, h[2])
    )
    key = (x.dtype, x.get_device(), layout_class(c, scale) + ("+table" if scale_table is not None else ""),
           layout_class(h, shift) + ("+table" if shift_table is not None else ""))
    streams = 2 + (c[1] != 0) + (h[1] != 0)
    config = launch_shape(r.D, r.B * r.S, x.element_size(), streams)
    return r, c, h, key, wide, _recipe(r, c, h, wide, scale_table, shift_table, config)


def _recipe(r: Rows, c, h, wide, ct, ht, config) -> Recipe:
    block_r, block_d, num_warps = config
    return Recipe(
        (cdiv(r.S, block_r) * cdiv(r.D, block_d), 1, r.B),
        (r.S, r.D, r.sb, r.ss, r.sd, *c, *h, 0 if ct is None else ct.stride(0), 0 if ht is None else ht.stride(0)),
        (c[1] != 0, h[1] != 0, ct is not None, ht is not None, r.S % block_r == 0 and r.D % block_d == 0, wide,
         block_r, block_d, cdiv(r.D, block_d)),
        num_warps,
    )


def launch_modulate(plan: ModulatePlan, config=None, out=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (BLOCK_R, BLOCK_D, num_warps)."""
    x, ct, ht = plan.x, plan.scale_table, plan.shift_table
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    recipe = plan.recipe if config is None else _recipe(plan.rows, plan.c_strides, plan.h_strides, plan.wide, ct, ht,
                                                        config)
    _launch.launch(recipe, (x, plan.scale, plan.shift, out, plan.scale if ct is None else ct,
                            plan.shift if ht is None else ht))
    return out


def modulate(x, scale, shift) -> torch.Tensor:
    """Guarded, ungated: the kernel where eligible, else the eager reference.
    `scale`/`shift` may be Folded (table row + temb, added with eager's rounding)."""
    plan = plan_modulate(x, scale, shift)
    if isinstance(plan, str):
        return modulate_reference(x, scale, shift)
    return launch_modulate(plan)


# ---------------------------------------------------------------- torch.library


@torch.library.custom_op("bitfuse::modulate", mutates_args=())
def modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Opaque op for torch.compile graphs and capture (eager callers launch directly:
    this boundary costs tens of microseconds a call)."""
    return modulate(x, scale, shift)


@modulate_op.register_fake
def _(x, scale, shift):
    return modulate_reference(x, scale, shift)


# ---------------------------------------------------------------- reference


def modulate_reference(x, scale, shift) -> torch.Tensor:
    """The eager expression, as models write it (Folded parameters materialised first)."""
    return x * (1 + value(scale)) + value(shift)
