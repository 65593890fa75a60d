"""Gated residual: `x + y * gate`.

Exact mode reproduces eager's two roundings (after the product, after the
sum) with FMA contraction off; high mode is one FMA with one rounding.
`x` and `y` have the output's shape; `gate` broadcasts like an adaLN
parameter (per-sample, per-token, shared, strided views).
"""

from __future__ import annotations

import torch

from ._pointwise import (
    HAS_TRITON,
    broadcast_strides,
    cdiv,
    common_device_dtype,
    jit,
    launch_shape,
    layout_class,
    rows_of,
    tl,
)

# ---------------------------------------------------------------- kernel


@jit
def _gated_residual_kernel(
    x_ptr, y_ptr, gate_ptr, out_ptr,
    n_rows, S, D,
    x_sb, x_ss, x_sd,
    y_sb, y_ss, y_sd,
    g_sb, g_ss, g_sd,
    EXACT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r64 = rows.to(tl.int64)
    b = r64 // S
    s = r64 - b * S
    c64 = cols.to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]

    x_off = (b * x_sb + s * x_ss)[:, None] + (c64 * x_sd)[None, :]
    y_off = (b * y_sb + s * y_ss)[:, None] + (c64 * y_sd)[None, :]
    g_off = (b * g_sb + s * g_ss)[:, None] + (c64 * g_sd)[None, :]
    o_off = r64[:, None] * D + c64[None, :]

    x = tl.load(x_ptr + x_off, mask=mask, eviction_policy="evict_first").to(tl.float32)
    y = tl.load(y_ptr + y_off, mask=mask, eviction_policy="evict_first").to(tl.float32)
    gate = tl.load(gate_ptr + g_off, mask=mask, eviction_policy="evict_last").to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if EXACT:
        m = (y * gate).to(dtype).to(tl.float32)
        out = x + m
    else:
        out = x + y * gate
    tl.store(out_ptr + o_off, out.to(dtype), mask=mask)


# ---------------------------------------------------------------- launcher


class GatedResidualPlan:
    """A call that passed the guard: operands, their geometry, and the gate key."""

    __slots__ = ("x", "y", "gate", "rows", "y_rows", "g_strides", "key")

    def __init__(self, x, y, gate, rows, y_rows, g_strides, key):
        self.x, self.y, self.gate = x, y, gate
        self.rows, self.y_rows, self.g_strides = rows, y_rows, g_strides
        self.key = key


def plan_gated_residual(x, y, gate) -> GatedResidualPlan | str:
    """The guard: a plan for the kernel, or the reason the call takes the reference."""
    if not HAS_TRITON:
        return "triton is not installed"
    why = common_device_dtype(x, y, gate)
    if why:
        return why
    rows = rows_of(x)
    if rows is None:
        return f"x must be 2-D or 3-D, got {x.dim()}-D"
    if x.numel() == 0:
        return "empty tensor"
    if y.shape != x.shape:
        return "y must have x's shape"
    g = broadcast_strides(gate, x.shape)
    if g is None:
        return "gate does not broadcast to x's shape"
    key = (x.dtype, x.device.index, layout_class(g, gate))
    return GatedResidualPlan(x, y, gate, rows, rows_of(y), g, key)


def launch_gated_residual(plan: GatedResidualPlan, exact: bool = True, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan. `config` overrides (BLOCK_R, BLOCK_D, num_warps)."""
    x, r, yr = plan.x, plan.rows, plan.y_rows
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = r.B * r.S
    block_r, block_d, num_warps = config or launch_shape(r.D, n_rows, x.element_size())
    grid = (cdiv(n_rows, block_r), cdiv(r.D, block_d))
    _gated_residual_kernel[grid](
        x, plan.y, plan.gate, out,
        n_rows, r.S, r.D,
        r.sb, r.ss, r.sd,
        yr.sb, yr.ss, yr.sd,
        *plan.g_strides,
        EXACT=exact, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=num_warps, enable_fp_fusion=not exact,
    )
    return out


def gated_residual(x, y, gate, *, exact: bool = True) -> torch.Tensor:
    """Guarded, ungated: the kernel where eligible, else the eager reference."""
    plan = plan_gated_residual(x, y, gate)
    if isinstance(plan, str):
        return gated_residual_reference(x, y, gate)
    return launch_gated_residual(plan, exact)


# ---------------------------------------------------------------- torch.library


@torch.library.custom_op("bitfuse::gated_residual", mutates_args=())
def gated_residual_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Opaque op for torch.compile graphs and capture (eager callers launch directly)."""
    return gated_residual(x, y, gate)


@gated_residual_op.register_fake
def _(x, y, gate):
    return gated_residual_reference(x, y, gate)


# ---------------------------------------------------------------- reference


def gated_residual_reference(x, y, gate) -> torch.Tensor:
    """The eager expression, as models write it."""
    return x + y * gate
