"""Operands seen as rows, and the adaLN parameters that broadcast against them.

Every row-wise op views `x` as rows: shape [B, S, D] (or [N, D], read as B=1,
S=N), and parameters that broadcast against it. A broadcast parameter is
passed to a kernel as (stride_b, stride_s, stride_d) with stride 0 on
broadcast axes, so the strided views diffusers makes by `unbind` are read in
place, without a densifying copy. A parameter may also be `Folded(table_row,
temb)`: eager's `table + temb`, not yet added, which the kernels add with
eager's rounding (`load_param`).

Also here: the jit helpers every row-wise kernel shares (the pointwise tile
prologue, parameter loads) and the pointwise launch shape.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._launch import cdiv, jit, needs_int64, next_pow2, tl

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# CPU tensors take the reference: Triton kernels run on CUDA devices. The CPU tests
# switch this on to run the kernels in Triton's interpreter (fp32 exact there).
INTERPRET_ON_CPU = False


class Rows(NamedTuple):
    """x seen as B x S rows of D elements, with its strides."""

    B: int
    S: int
    D: int
    sb: int
    ss: int
    sd: int


def rows_of(x: torch.Tensor) -> Rows | None:
    """Row geometry of a 2-D or 3-D operand, or None for any other rank."""
    shape, stride = x.shape, x.stride()
    if len(shape) == 3:
        return Rows(shape[0], shape[1], shape[2], stride[0], stride[1], stride[2])
    if len(shape) == 2:
        return Rows(1, shape[0], shape[1], 0, stride[0], stride[1])
    return None


def pointwise_rows(x: torch.Tensor, name: str = "x") -> Rows | str:
    """The opening of every row-wise pointwise guard: `x`'s rows, or why `x` takes
    the reference (rank, empty, a permuted view)."""
    r = rows_of(x)
    if r is None:
        return f"{name} must be 2-D or 3-D, got {x.dim()}-D"
    if x.numel() == 0:
        return "empty tensor"
    if permuted(x):
        return f"{name} is a permuted view: eager's result keeps its layout, the kernel writes row-major"
    return r


def wide_offsets(r: Rows, *extents: tuple[int, int]) -> bool:
    """Whether a tile kernel over `r`'s rows needs int64 offsets: the output's size,
    x's span or the span of any other operand's (size, stride) `extents` reaches 2**31."""
    return r.B * r.S * r.D >= 2**31 or needs_int64((r.B, r.sb), (r.S, r.ss), (r.D, r.sd), *extents)


def over_rows(r: Rows, strides: tuple[int, int, int]) -> tuple:
    """The (size, stride) extents of an operand with (stride_b, stride_s, stride_d)
    `strides` broadcast over `r`'s B x S x D."""
    return (r.B, strides[0]), (r.S, strides[1]), (r.D, strides[2])


def tile_launch(r: Rows, block_r: int, block_d: int) -> tuple[tuple[int, int, int], bool, int]:
    """(grid, EVEN, NCB) of a `pointwise_tile` kernel over `r`'s rows in BLOCK_R x
    BLOCK_D tiles: tiles of a sample along axis 0, samples along axis 2; EVEN when
    the tiles cover the rows exactly (no masks); NCB column blocks a row."""
    ncb = cdiv(r.D, block_d)
    return (cdiv(r.S, block_r) * ncb, 1, r.B), r.S % block_r == 0 and r.D % block_d == 0, ncb


def permuted(t: torch.Tensor) -> bool:
    """Whether `t`'s dimensions of size > 1, taken left to right, do not have
    non-increasing strides (a transposed or permuted view). Eager's pointwise result
    then takes `t`'s layout (TensorIterator lays its output out as its first operand),
    where the row kernels write row-major: the same values in another layout, which a
    GEMM or a convolution reading the result picks its algorithm (and its bits) by.
    The pointwise planners send such an x to eager."""
    last = None
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if last is not None and stride > last:
            return True
        last = stride
    return False


def broadcast_strides(p: torch.Tensor, x_shape: torch.Size) -> tuple[int, int, int] | None:
    """(stride_b, stride_s, stride_d) of `p` broadcast to `x_shape` (rank 2 or 3),
    or None when `p` does not broadcast to exactly that shape."""
    pshape, pstride = p.shape, p.stride()
    n, k = len(x_shape), len(pshape)
    if k > n:
        return None
    out = [0, 0, 0]
    base = 3 - n  # a rank-2 x has no batch axis: its rows map to axis S
    for i in range(k):
        xi = n - k + i
        size = pshape[i]
        if size == x_shape[xi]:
            # a size-1 axis carries no offset, whatever stride it reports
            out[base + xi] = pstride[i] if size != 1 else 0
        elif size != 1:
            return None
    return out[0], out[1], out[2]


class Folded:
    """An adaLN parameter `table_row + temb` that eager would materialise first.

    diffusers' `get_mod_params` adds a [n, D] scale/shift table to the timestep
    embedding reshaped to [B, T, n, D] (one eager op, one rounding) and unbinds
    the sum. Passed as the two operands instead, a kernel adds them on the fly
    with the same rounding, and the [B, T, n, D] tensor is never written.
    `value()` is eager's tensor (elementwise, so the same bits as the unbind view).
    `meta`: the call-key metadata the sites would read of the two tensors, given by a
    maker whose tensors are its own views (their metadata cannot change:
    `sites.folded_with_meta`); None: read on every call.
    """

    __slots__ = ("table", "temb", "meta")

    def __init__(self, table: torch.Tensor, temb: torch.Tensor, meta: tuple | None = None):
        self.table = table  # [D]: one row of the table
        self.temb = temb  # [B, T, D]: a view of the timestep embedding
        self.meta = meta

    def value(self) -> torch.Tensor:
        return self.table + self.temb

    @property
    def shape(self) -> torch.Size:
        t, e = self.table.shape, self.temb.shape
        if len(t) == 1 and len(e) >= 1 and e[-1] == t[0]:  # the [D] row of a [B, T, D] view
            return e
        return torch.broadcast_shapes(t, e)  # (a slow Python helper: ~20 us a call)

    def squeeze(self, dim: int):
        """`value().squeeze(dim)`, kept folded when `dim` is not of size 1 (a no-op)."""
        return self if self.shape[dim] != 1 else self.value().squeeze(dim)

    def __repr__(self) -> str:
        return f"Folded(table {tuple(self.table.shape)} + temb {tuple(self.temb.shape)})"


def value(p):
    """A parameter's eager tensor (Folded or not)."""
    return p.value() if p.__class__ is Folded else p


def value32(p):
    """A parameter's fp32 tensor as Wan's eager computes it: a Folded one is
    `table + temb.float()` (an fp32 sum, rounded once; the same bits as
    `table.float() + temb.float()` for any table dtype up to fp32)."""
    return p.table.float() + p.temb.float() if p.__class__ is Folded else p


def table_of(p, x: torch.Tensor, f32: bool = False):
    """(tensor read with x's broadcast, table row or None, why-not or None) for one
    parameter: a Folded one folds when its table row is a [D] row of x's dtype and
    device (anything else, e.g. a promoting dtype, is materialised by the caller).
    f32: the fp32-compute ops' Folded (`value32`): table and temb of any 16/32-bit
    float dtype, summed in fp32."""
    if p.__class__ is not Folded:
        return p, None, None
    t = p.table
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != x.shape[-1]:
        return None, None, "table row is not [D]"
    if not isinstance(p.temb, torch.Tensor):
        return None, None, "temb is not a tensor"
    if f32:
        if t.dtype not in SUPPORTED_DTYPES or p.temb.dtype not in SUPPORTED_DTYPES:
            return None, None, "table/temb dtype is not bf16, fp16 or fp32"
        if p.temb.get_device() != x.get_device():
            return None, None, "temb on another device"
    elif t.dtype is not x.dtype or p.temb.dtype is not x.dtype:
        return None, None, "table/temb dtype differs from x's (eager promotes)"
    if t.get_device() != x.get_device():
        return None, None, "table on another device"
    if t.requires_grad and torch.is_grad_enabled():
        return None, None, "autograd needs the eager graph"
    return p.temb, t, None


def tables_of(scale, shift, x: torch.Tensor):
    """`table_of` for a (scale, shift) pair: (scale, shift, scale_table, shift_table),
    or a why-not string."""
    if scale.__class__ is not Folded and shift.__class__ is not Folded:
        return scale, shift, None, None
    scale, scale_table, why = table_of(scale, x)
    if why:
        return why
    shift, shift_table, why = table_of(shift, x)
    if why:
        return why
    return scale, shift, scale_table, shift_table


def layout_class(strides: tuple[int, int, int], p: torch.Tensor) -> str:
    """Name the parameter layout for gate signatures: what varies across rows, and
    whether the view is dense. e.g. 'per-sample', 'per-token/strided'."""
    sb, ss, _ = strides
    if ss:
        kind = "per-token"
    elif sb:
        kind = "per-sample"
    else:
        kind = "shared"
    return kind if p.is_contiguous() else kind + "/strided"


def common_device_dtype(*tensors) -> str | None:
    """Why these operands can't share one kernel launch, or None if they can.
    Runs on every call: kept to a few cheap attribute reads."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return "operand is not a tensor"
    first = tensors[0]
    device, dtype = first.get_device(), first.dtype
    if device < 0 and not INTERPRET_ON_CPU:
        return "CPU tensor"
    if dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {dtype}"
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.get_device() != device:
            return "operands on different devices"
        if t.dtype is not dtype:
            return "mixed dtypes (eager type promotion applies)"
        if grad and t.requires_grad:
            return "autograd needs the eager graph"
    return None


def launch_shape(D: int, rows: int, elem_bytes: int, streams: int = 2) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for the streaming row-wise kernels; `rows`: B x S,
    `streams`: full-size tensors read or written (x and out: 2; per-token parameters
    and the gated residual's y add one each).

    One row per program and a column block that divides D (no masked-off lanes),
    with warps for one 16-byte vector per thread: 2048 columns on 8 warps, 1024 on
    4 (bf16/fp16). Measured on the H200 (bench/NOTES.md, "Pointwise"): at 6144 x
    4096 bf16 per-sample modulate 26.3 us against 26.9 for 4096 columns on 4 warps
    (four vectors a thread), 29.3 for 1024 on 8 (one 8-byte vector) and 45.8 for
    512 on 8; per-token 47.7 against 49.0. For 16-bit rows of 4096 columns, two
    refinements from the same sweeps (interleaved with Inductor's kernel): up to
    1024 rows, whole rows on 8 warps (two vectors a thread, half the programs:
    gated residual at 1024 x 4096 7.26 us against 7.55); with three or more streams,
    whole rows on 16 warps (gated residual at 6144 x 4096 36.7 against 36.9; for
    modulate per-sample at 24576 rows it was 1.5 us slower). Other D: one block of
    the next power of two (masked), up to 4096 columns."""
    if elem_bytes == 2 and D % 4096 == 0:
        if rows <= 1024:
            return 1, 4096, 8
        if streams >= 3:
            return 1, 4096, 16
    for block_d in (2048, 1024):
        if D % block_d == 0:
            return 1, block_d, max(1, min(8, block_d * elem_bytes // 512))
    block_d = min(next_pow2(D), 4096)
    return 1, block_d, 8 if block_d == 2048 else 4


def bound_param_launch(launch, recipe, operands, folded_c: bool, folded_h: bool, output, checks=()):
    """The bound launch (`OpSpec.bind`) of an op taking (x, scale, shift, ...): `run(x,
    scale, shift, *scalars)` -> a new output from `output` (an `Output`: contiguous, x's
    shape), or None where a pointer misses an alignment the guard requires (`checks`:
    (argument index, bytes) pairs). `operands(x, scale, shift, out, scale_table,
    shift_table)` orders the kernel's tensors; a Folded parameter (folded_c / folded_h) is
    unpacked into its temb view and table row. The closure holds no tensor of the call
    that bound it."""

    def run(*args):
        for i, align in checks:
            if args[i].data_ptr() % align:
                return None
        x, scale, shift = args[0], args[1], args[2]
        ct = ht = None
        if folded_c:
            ct, scale = scale.table, scale.temb
        if folded_h:
            ht, shift = shift.table, shift.temb
        out = output()
        launch(recipe, operands(x, scale, shift, out, ct, ht))
        return out

    return run


# ---------------------------------------------------------------- jit helpers


@jit
def load_param(ptr, off, mask, table_ptr, t_off, t_mask, TABLE: tl.constexpr, dtype: tl.constexpr, KEEP: tl.constexpr):
    """A parameter in fp32; with TABLE, `temb + table_row` first, rounded to the
    storage dtype as eager's add in diffusers' get_mod_params rounds it. KEEP: a
    parameter read by every program, kept in L2. (Every argument is passed: Triton
    3.6 does not wrap a jit helper's default values as constexprs.)"""
    if KEEP:
        p = tl.load(ptr + off, mask=mask, eviction_policy="evict_last")
    else:
        p = tl.load(ptr + off, mask=mask)
    if TABLE:
        row = tl.load(table_ptr + t_off, mask=t_mask, eviction_policy="evict_last")
        p = (p.to(tl.float32) + row.to(tl.float32)).to(dtype)
    return p.to(tl.float32)


@jit
def load_row_param(ptr, b, s, cols, sb, ss, sd, mask, col_ok, table_ptr, t_sd, PER_ROW: tl.constexpr,
                   TABLE: tl.constexpr, dtype: tl.constexpr):
    """A parameter for a [BLOCK_R, BLOCK_D] tile of rows s of sample b: a full tile
    when it varies along S (PER_ROW), else one row loaded once per program, kept in
    L2, broadcast over the tile."""
    if PER_ROW:
        off = (b * sb + s * ss)[:, None] + (cols * sd)[None, :]
        return load_param(ptr, off, mask, table_ptr, cols * t_sd, col_ok, TABLE, dtype, False)
    else:
        return load_param(ptr, b * sb + cols * sd, col_ok, table_ptr, cols * t_sd, col_ok, TABLE, dtype, True)[None, :]


@jit
def pointwise_tile(INT64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, NCB: tl.constexpr):
    """This program's tile of a pointwise op: sample b, rows s, columns cols.
    Program (row chunk * NCB + column block, 1, sample b): column blocks fastest, so
    consecutive programs read consecutive memory; NCB (column blocks a row) is a
    constant, so no integer division by a run-time value comes before the loads."""
    b = tl.program_id(2)
    pid = tl.program_id(0)
    rc = pid // NCB
    s = rc * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid - rc * NCB) * BLOCK_D + tl.arange(0, BLOCK_D)
    if INT64:
        b = b.to(tl.int64)
        s = s.to(tl.int64)
        cols = cols.to(tl.int64)
    return b, s, cols
