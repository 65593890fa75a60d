"""Gated residual: `x + y * gate`.

The kernel reproduces eager's two roundings (after the product, after the
sum) with FMA contraction off; as for modulate, every tier gets the exact
result. `x` and `y` have the output's shape; `gate` broadcasts like an adaLN
parameter (per-sample, per-token, shared, strided views).
"""

from __future__ import annotations

import torch

from ._pointwise import (
    HAS_TRITON,
    FastLaunch,
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
    S, D, chunks,
    x_sb, x_ss, x_sd,
    y_sb, y_ss, y_sd,
    g_sb, g_ss, g_sd,
    GATE_PER_ROW: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # program (b * chunks + chunk, column block): BLOCK_R rows of sample b
    pid = tl.program_id(0)
    b = (pid // chunks).to(tl.int64)
    s = (pid % chunks) * BLOCK_R + tl.arange(0, BLOCK_R)
    s64 = s.to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    col_ok = cols < D
    mask = (s < S)[:, None] & col_ok[None, :]

    x_off = (b * x_sb + s64 * x_ss)[:, None] + (cols * x_sd)[None, :]
    y_off = (b * y_sb + s64 * y_ss)[:, None] + (cols * y_sd)[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, eviction_policy="evict_first").to(tl.float32)
    y = tl.load(y_ptr + y_off, mask=mask, eviction_policy="evict_first").to(tl.float32)
    if GATE_PER_ROW:
        g_off = (b * g_sb + s64 * g_ss)[:, None] + (cols * g_sd)[None, :]
        gate = tl.load(gate_ptr + g_off, mask=mask).to(tl.float32)
    else:  # loaded once per program
        gate = tl.load(gate_ptr + b * g_sb + cols * g_sd, mask=col_ok, eviction_policy="evict_last")
        gate = gate.to(tl.float32)[None, :]

    dtype = out_ptr.dtype.element_ty
    m = (y * gate).to(dtype).to(tl.float32)  # eager: y * gate
    out = x + m  # eager: x + m
    o_off = ((b * S + s64) * D)[:, None] + cols[None, :]
    tl.store(out_ptr + o_off, out.to(dtype), mask=mask)


_launch = FastLaunch(_gated_residual_kernel)


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
    key = (x.dtype, x.get_device(), layout_class(g, gate))
    return GatedResidualPlan(x, y, gate, rows, rows_of(y), g, key)


def launch_gated_residual(plan: GatedResidualPlan, config=None, out=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (BLOCK_R, BLOCK_D, num_warps)."""
    x, r, yr, g = plan.x, plan.rows, plan.y_rows, plan.g_strides
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_r, block_d, num_warps = config or launch_shape(r.D, r.S, x.element_size())
    chunks = cdiv(r.S, block_r)
    _launch(
        (r.B * chunks, cdiv(r.D, block_d)),
        (x, plan.y, plan.gate, out),
        (r.S, r.D, chunks, r.sb, r.ss, r.sd, yr.sb, yr.ss, yr.sd, *g),
        dict(GATE_PER_ROW=g[1] != 0, BLOCK_R=block_r, BLOCK_D=block_d),
        dict(num_warps=num_warps, enable_fp_fusion=False),
    )
    return out


def gated_residual(x, y, gate) -> torch.Tensor:
    """Guarded, ungated: the kernel where eligible, else the eager reference."""
    plan = plan_gated_residual(x, y, gate)
    if isinstance(plan, str):
        return gated_residual_reference(x, y, gate)
    return launch_gated_residual(plan)


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
