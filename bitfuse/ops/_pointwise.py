"""Shared plumbing for the row-wise adaLN kernels: Triton import, operand
geometry, broadcast strides and launch shapes.

Every op views its operands as rows: `x` of shape [B, S, D] (or [N, D], read
as B=1, S=N) and parameters that broadcast against it. A broadcast parameter
is passed to the kernel as (stride_b, stride_s, stride_d) with stride 0 on
broadcast axes, so the strided views diffusers makes by `unbind` are read in
place, without a densifying copy.
"""

from __future__ import annotations

import inspect
import os
from typing import NamedTuple

import torch

try:  # triton is optional: without it every op takes its eager reference
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

HAS_TRITON = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (host side: `triton.next_power_of_2` is a
    constexpr function in Triton 3.6 and costs about a microsecond a call)."""
    return 1 << max(n - 1, 0).bit_length()


def jit(fn):
    """`triton.jit`, or the plain function where Triton is missing (never launched then)."""
    return triton.jit(fn) if HAS_TRITON else fn


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
    """

    __slots__ = ("table", "temb")

    def __init__(self, table: torch.Tensor, temb: torch.Tensor):
        self.table = table  # [D]: one row of the table
        self.temb = temb  # [B, T, D]: a view of the timestep embedding

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


def table_of(p, x: torch.Tensor):
    """(tensor read with x's broadcast, table row or None, why-not or None) for one
    parameter: a Folded one folds when its table row is a [D] row of x's dtype and
    device (anything else, e.g. a promoting dtype, is materialised by the caller)."""
    if p.__class__ is not Folded:
        return p, None, None
    t = p.table
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != x.shape[-1]:
        return None, None, "table row is not [D]"
    if t.dtype is not x.dtype or p.temb.dtype is not x.dtype:
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
    if device < 0:
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


def needs_int64(*extents) -> bool:
    """Whether offsets may pass 2**31: extents are (size, stride) pairs of every operand."""
    return sum(abs(stride) * (size - 1) for size, stride in extents) >= 2**31 - 1


def _no_hooks(hook) -> bool:
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


class Recipe:
    """One launch with everything but the tensors fixed: grid, integer arguments,
    constexprs and warps. Built once per cached geometry, it keeps the compiled
    kernel per pointer-alignment pattern, so a call is a dict lookup and the launch."""

    __slots__ = ("grid", "ints", "consts", "num_warps", "entries")

    def __init__(self, grid, ints: tuple, consts: tuple, num_warps: int):
        self.grid = (grid[0], grid[1], grid[2] if len(grid) > 2 else 1)
        self.ints, self.consts, self.num_warps = ints, consts, num_warps
        self.entries = {}  # pointer alignments -> (run, head, metadata)


class FastLaunch:
    """Launch a Triton kernel without re-binding its arguments on every call.

    `JITFunction.run` re-derives the specialization of every argument on each
    launch (~10 us of host time for a kernel with 17 arguments). The first call
    with a given key goes through it and keeps the compiled kernel; later calls
    with the same key launch that kernel directly. The key holds every integer
    argument's value and every pointer's 16-byte alignment, which determine
    Triton's specialization, so a replayed kernel is the one Triton would pick.
    Launch hooks (a Python profiler such as Proton) installed when a key is first
    launched keep that key on Triton's own path, so the hooks see every call.

    `launch(recipe, tensors)` is the same for a launch whose integers are fixed
    (`Recipe`): it skips building and hashing the key.

    Operands on a CUDA device other than the current one launch under that device
    (eager PyTorch runs them wherever they are; Triton compiles for, and launches
    on, the current device).
    """

    MAX_KEYS = 4096

    def __init__(self, fn, constexpr_names: tuple[str, ...] = (), fp_fusion: bool = False):
        self.fn = fn
        self.names = constexpr_names
        self.fp_fusion = fp_fusion  # exact kernels keep eager's roundings: no FMA contraction
        self.compiled = {}
        self.direct = _knobs is not None and not INTERPRET

    def __call__(self, grid, tensors, ints: tuple, consts, num_warps):
        if consts.__class__ is dict:  # (constexprs: dict, options: dict) form
            self.names, consts = tuple(consts), tuple(consts.values())
            self.fp_fusion = num_warps.get("enable_fp_fusion", False)
            num_warps = num_warps["num_warps"]
        device = tensors[0].get_device()
        if device >= 0 and device != torch._C._cuda_getDevice():
            with torch.cuda.device(device):
                return self(grid, tensors, ints, consts, num_warps)
        ptrs = [t.data_ptr() for t in tensors]
        key = (tuple([p & 15 == 0 for p in ptrs]), ints, consts, num_warps, tensors[0].dtype, device)
        entry = self.compiled.get(key)
        if entry is None:
            self._first(key, grid, tensors, ints, consts, num_warps)
            return
        # pointers as ints: Triton's launcher takes them as they are, where for a
        # tensor it calls data_ptr() and cuPointerGetAttribute (the guard has
        # already checked every operand is on this CUDA device)
        run, head, metadata = entry
        run(grid[0], grid[1], grid[2] if len(grid) > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
            *head, metadata, None, None, None, *ptrs, *ints, *consts)

    def launch(self, recipe: Recipe, tensors) -> None:
        """Launch `recipe` on `tensors` (every one of the dtype and device the recipe
        was built for: the caller's geometry cache is keyed by them)."""
        device = tensors[0].get_device()
        if device >= 0 and device != torch._C._cuda_getDevice():
            with torch.cuda.device(device):
                return self.launch(recipe, tensors)
        ptrs = [t.data_ptr() for t in tensors]
        aligned = tuple([p & 15 == 0 for p in ptrs])
        entry = recipe.entries.get(aligned)
        if entry is None:
            key = (aligned, recipe.ints, recipe.consts, recipe.num_warps, tensors[0].dtype, device)
            entry = self.compiled.get(key)
            if entry is None:
                self._first(key, recipe.grid, tensors, recipe.ints, recipe.consts, recipe.num_warps)
                entry = self.compiled.get(key)
                if entry is not None:
                    recipe.entries[aligned] = entry
                return
            recipe.entries[aligned] = entry
        run, head, metadata = entry
        grid = recipe.grid
        run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device),
            *head, metadata, None, None, None, *ptrs, *recipe.ints, *recipe.consts)

    def _first(self, key, grid, tensors, ints, consts, num_warps) -> None:
        """Launch through Triton (compiling if needed) and keep the kernel for `key`."""
        k = self.fn[grid](*tensors, *ints, **dict(zip(self.names, consts)), num_warps=num_warps,
                          enable_fp_fusion=self.fp_fusion)
        if not self.direct or k is None:
            return
        try:
            hooks_off = _no_hooks(_knobs.runtime.launch_enter_hook) and _no_hooks(_knobs.runtime.launch_exit_hook)
            c_launch = _c_launch(k.run)
            if c_launch is None:
                entry = (k.run, (k.function,), k.packed_metadata)
            else:
                entry = (c_launch, (k.function, k.run.launch_cooperative_grid, k.run.launch_pdl, None, None),
                         k.packed_metadata)
        except AttributeError:  # another Triton's launcher: keep its own path
            self.direct = False
            return
        if hooks_off:
            if len(self.compiled) >= self.MAX_KEYS:
                self.compiled.clear()
            self.compiled[key] = entry


def _c_launch(run):
    """The C `launch` behind Triton's launcher object `run`, when calling it directly
    is what `run(...)` does: no scratch buffers to allocate, and a `__call__` whose
    source passes (cooperative, pdl, global scratch, profile scratch) and then its
    arguments unchanged (Triton 3.6's; any other source keeps `run`). Saves the
    Python frame of `__call__`, about a microsecond a launch."""
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    cls = type(run)
    ok = _C_LAUNCH_OK.get(cls)
    if ok is None:
        try:
            src = "".join(inspect.getsource(cls.__call__).split())
        except (OSError, TypeError):
            src = ""
        ok = _C_LAUNCH_OK[cls] = _C_LAUNCH_CALL in src
    return getattr(run, "launch", None) if ok else None


_C_LAUNCH_CALL = ("self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,"
                  "global_scratch,profile_scratch,*args)")
_C_LAUNCH_OK: dict = {}


try:
    from triton import knobs as _knobs
except Exception:  # pragma: no cover - older Triton: no direct launch
    _knobs = None
