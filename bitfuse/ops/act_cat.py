"""An activation written into a concatenation: `torch.cat([a, act(m)], dim=-1)`, or
`act(m)` alone (a None).

FLUX's single-stream blocks end in

    mlp = act(proj_mlp(norm_x))            FLUX.1: nn.GELU(approximate="tanh")
    h = torch.cat([attn_output, mlp], -1)  the attention's output beside the MLP's
    proj_out(h)

and FLUX.2's parallel processor the same with `Flux2SwiGLU` (`silu(m[..., :half]) *
m[..., half:]`), which its feed-forwards also apply alone. Eager writes act(m) (the
SwiGLU: the SiLU, then the product), then reads it back with `a` for the
concatenation; the kernel reads `a` and `m` once and writes the concatenation. At
FLUX.1's single-block shape (4,608 rows, 3,072 + 12,288 columns, bf16) that is 97.2
against 175.9 us on the H100, and at FLUX.2's (6,144 + 2 x 18,432) 206 against 629 us
(bench/NOTES.md).

Ops (`ACTS`):
    cat_gelu_tanh(a, m)   torch.cat([a, F.gelu(m, approximate="tanh")], dim=-1)
    cat_swiglu(a, m)      torch.cat([a, F.silu(m[..., :h]) * m[..., h:]], dim=-1), h = m.shape[-1] // 2

EXACT BY A WHOLE-DOMAIN CHECK. Eager computes each activation in fp32 and rounds it
to the storage dtype (the SwiGLU's product is a second rounding, of two values of the
dtype: exact in fp32, then rounded, as the kernel does). A bf16 or fp16 activation is
therefore a function of 65,536 inputs: `form(device, dtype, act)` runs this kernel on
every one of them into a NaN-poisoned output, compared bitwise with eager (signed
zeros count, NaN equals NaN), once per device and dtype, outside tracing and
capture; the kernel runs in the first form equal on all of them (`_act`: the GELU's
FMA flag, the SiLU's cheaper forms before aten's own), or not at all (the reason
is the gate's verdict, eager runs). The concatenation itself is a copy. fp32
(2**32 inputs) takes eager. The gate still verifies every signature at first sight.

Shapes: m [B, S, Dm] or [N, Dm] (the SwiGLU: [.., 2 Dm], an even width); a None or
[B, S, Da] ([N, Da]) with m's leading sizes; rows of any strides, the last axis
contiguous (stride 1); one dtype (bf16 or fp16) and device. Output: a new contiguous
[B, S, Da + Dm] ([N, Da + Dm]) tensor, as eager's. Exact in every tier.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import cases
from ._act import DOMAIN, FAST_SILU_FORMS, GELU_FORMS, every_input, gelu_tanh, libdevice, silu
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
    next_pow2,
    probe_allowed,
    register_op,
    synchronous,
    tl,
)
from ._params import common_device_dtype, permuted, rows_of
from .spec import OpSpec

#: act -> the forms tried on every input, the likelier or faster first
_CANDIDATES = {"gelu_tanh": GELU_FORMS, "swiglu": (*FAST_SILU_FORMS, 0)}
ACTS = tuple(_CANDIDATES)
BLOCK, NUM_WARPS = 1024, 4  # level with 2048/8 and 4096/8 at both FLUX shapes on the H100

# ---------------------------------------------------------------- kernel


@jit
def _act_cat_kernel(
    a_ptr, m_ptr, out_ptr,
    S, Da, Dm,
    a_sb, a_ss, m_sb, m_ss,
    NA: tl.constexpr,  # column blocks of a (0: no a)
    NB: tl.constexpr,  # column blocks of a row of the output: NA + those of act(m)
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,  # Da and Dm multiples of BLOCK: no masks
    SWIGLU: tl.constexpr,  # else the tanh GELU
    FORM: tl.constexpr,  # the GELU's FMA flag, or the SiLU's form (`_act`)
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid // NB  # the row, then its column block j: a's blocks first, then act(m)'s
    j = pid - r * NB
    b = (r // S).to(tl.int64)
    s = (r % S).to(tl.int64)
    o_row = out_ptr + r.to(tl.int64) * (Da + Dm)
    if j < NA:  # (names apart in the two branches: Triton would merge a shared one)
        ca = j * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            v = tl.load(a_ptr + (b * a_sb + s * a_ss) + ca, eviction_policy="evict_first")
            tl.store(o_row + ca, v, cache_modifier=".cs")
        else:
            v = tl.load(a_ptr + (b * a_sb + s * a_ss) + ca, mask=ca < Da, eviction_policy="evict_first")
            tl.store(o_row + ca, v, mask=ca < Da, cache_modifier=".cs")
    else:
        cm = (j - NA) * BLOCK + tl.arange(0, BLOCK)
        mm = cm < Dm
        if EVEN:
            mm = None
        m_row = m_ptr + (b * m_sb + s * m_ss)
        dtype = out_ptr.dtype.element_ty
        x = tl.load(m_row + cm, mask=mm, eviction_policy="evict_first").to(tl.float32)
        if SWIGLU:
            up = tl.load(m_row + (Dm + cm), mask=mm, eviction_policy="evict_first").to(tl.float32)
            y = silu(x, FORM, INTERP).to(dtype).to(tl.float32) * up  # eager: silu(m[..., :h]) * m[..., h:]
        else:
            y = gelu_tanh(x, FORM, INTERP)  # eager: F.gelu(m, approximate="tanh")
        tl.store(o_row + (Da + cm), y.to(dtype), mask=mm, cache_modifier=".cs")


_launch = FastLaunch(_act_cat_kernel, ("NA", "NB", "BLOCK", "EVEN", "SWIGLU", "FORM", "INTERP"))


# ---------------------------------------------------------------- the whole-domain check

_FORMS: dict = {}
_ERRORS: dict = {}  # the check's exceptions, by the same key


def form(device, dtype: torch.dtype, act: str) -> int | None:
    """The form (`_CANDIDATES[act]`) in which this op's kernel equals eager's activation
    on all 65,536 inputs of `dtype` (bf16 or fp16) on `device`, found once and kept;
    None where no form does, and (not kept) where it can't be checked now: tracing,
    capture. The SwiGLU is checked with its second half 1.0 (the product then adds no
    rounding of its own); its kernel form is the SiLU's. A kernel that fails to compile
    or run settles None too (the error is kept for the guard's reason)."""
    from ..numerics import same_bits

    index = device_index(device)
    key = (index, dtype, act)
    if key in _FORMS:
        return _FORMS[key]
    if not probe_allowed(index):
        return None
    x = every_input(dtype, "cpu" if index < 0 else f"cuda:{index}").view(256, 256)
    swiglu = act == "swiglu"
    ref = F.silu(x) if swiglu else F.gelu(x, approximate="tanh")
    m = torch.cat([x, torch.ones_like(x)], dim=-1) if swiglu else x
    found = None
    try:
        with synchronous():  # compiled in place, even at a gate's first sight in the background
            for candidate in _CANDIDATES[act]:
                out = torch.full_like(ref, float("nan"))
                _launch.launch(_recipe(_geometry_of(None, m, swiglu)[0], swiglu, candidate), (m, m, out))
                if same_bits(out, ref):
                    found = candidate
                    break
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to build or run: eager's path, said why
        _ERRORS[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
    _FORMS[key] = found
    return found


# ---------------------------------------------------------------- planner and launcher


class ActCatPlan:
    """A call that passed the guard: operands, geometry (`_geometry_of`), the kernel's
    act and form, the default launch, the output's allocation and the gate key."""

    __slots__ = ("a", "m", "geometry", "swiglu", "found", "recipe", "output", "key")

    def __init__(self, a, m, geometry, swiglu, found, recipe, output, key):
        self.a, self.m, self.geometry, self.swiglu, self.found = a, m, geometry, swiglu, found
        self.recipe, self.output, self.key = recipe, output, key


_geometry = GeometryCache()


def _geometry_of(a, m, swiglu: bool):
    """The guard's per-layout work: ((S, Da, Dm, a_sb, a_ss, m_sb, m_ss, B), output shape),
    or why the call takes the reference."""
    rm = rows_of(m)
    if rm is None:
        return f"m must be 2-D or 3-D, got {m.dim()}-D"
    if m.numel() == 0:
        return "empty tensor"
    if rm.sd != 1 or permuted(m):
        return "m's last axis is not contiguous"
    Dm = rm.D // 2 if swiglu else rm.D
    if swiglu and rm.D % 2:
        return "odd width: the SwiGLU's halves differ in size (eager raises)"
    if a is None:
        Da, a_sb, a_ss = 0, 0, 0
    else:
        ra = rows_of(a)
        if ra is None or a.dim() != m.dim() or a.shape[:-1] != m.shape[:-1]:
            return "a and m differ in rank or leading sizes"
        if a.shape[-1] and (ra.sd != 1 or permuted(a)):
            return "a's last axis is not contiguous"
        Da, a_sb, a_ss = ra.D, ra.sb, ra.ss
    return (rm.S, Da, Dm, a_sb, a_ss, rm.sb, rm.ss, rm.B), (*m.shape[:-1], Da + Dm)


def _recipe(g, swiglu: bool, found: int, block: int | None = None, num_warps: int = NUM_WARPS) -> Recipe:
    S, Da, Dm, a_sb, a_ss, m_sb, m_ss, B = g
    if block is None:
        block = min(BLOCK, next_pow2(max(Da, Dm)))
    na = cdiv(Da, block)
    nb = na + cdiv(Dm, block)
    even = Da % block == 0 and Dm % block == 0
    return Recipe((B * S * nb, 1), (S, Da, Dm, a_sb, a_ss, m_sb, m_ss),
                  (na, nb, block, even, swiglu, found, INTERPRET), num_warps)


def _plan(a, m, act: str):
    if not HAS_TRITON or (libdevice is None and not INTERPRET):
        return "triton (with libdevice) is not installed"
    if not isinstance(m, torch.Tensor) or not (a is None or isinstance(a, torch.Tensor)):
        return "operand is not a tensor"
    why = common_device_dtype(m) if a is None else common_device_dtype(a, m)
    if why:
        return why
    cpu = m.get_device() < 0  # the interpreter's indexing checks (tests), any dtype
    if m.dtype not in DOMAIN and not cpu:
        return f"{m.dtype}: only 16-bit inputs can be checked whole (eager's kernels run)"
    swiglu = act == "swiglu"
    cache_key = (m.shape, m.stride(), None if a is None else (a.shape, a.stride()), m.dtype, m.get_device(), act)
    geometry = _geometry.get(cache_key, _geometry_of, a, m, swiglu)
    if geometry.__class__ is str:
        return geometry
    g, out_shape = geometry
    if g[0] * g[7] * (g[1] + g[2]) >= 2**31:
        return "output of 2**31 elements or more"
    found = 0 if cpu else form(m.device, m.dtype, act)  # the interpreter: plain products and sums
    if found is None:
        error = _ERRORS.get((device_index(m.device), m.dtype, act))
        return (f"no kernel form equals eager's {act} on all 65,536 {m.dtype} inputs on this device "
                + (f"(the check failed: {error})" if error else "(or it can't be checked now: tracing, capture)"))
    key = (m.dtype, m.get_device(), "cat" if a is not None else "alone", f"form={found}")
    output = Output(out_shape, contiguous_strides(out_shape), m.dtype, m.get_device())
    return ActCatPlan(a, m, g, swiglu, found, _recipe(g, swiglu, found), output, key)


def plan_cat_gelu_tanh(a, m, tier: str = "lossless"):
    """The guard of `cat_gelu_tanh`: a plan for the kernel, or the reason the call
    takes the reference."""
    return _plan(a, m, "gelu_tanh")


def plan_cat_swiglu(a, m, tier: str = "lossless"):
    """The guard of `cat_swiglu`: a plan for the kernel, or the reason the call takes
    the reference."""
    return _plan(a, m, "swiglu")


def launch_act_cat(plan: ActCatPlan, out=None, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, the result's shape) if
    given. `config` overrides (BLOCK, num_warps)."""
    a, m = plan.a, plan.m
    if out is None:
        out = plan.output()
    recipe = plan.recipe if config is None else _recipe(plan.geometry, plan.swiglu, plan.found, *config)
    _launch.launch(recipe, (m if a is None else a, m, out))
    return out


def bind_act_cat(plan: ActCatPlan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(a, m)` for a call
    with the plan's shapes, strides, dtype and device."""
    recipe, launch, output = plan.recipe, _launch.launch, plan.output

    def run(a, m):
        out = output()
        launch(recipe, (m if a is None else a, m, out))
        return out

    return run


def cat_gelu_tanh(a, m) -> torch.Tensor:
    """`torch.cat([a, F.gelu(m, approximate="tanh")], dim=-1)` (a None: the GELU alone),
    guarded but ungated: the kernel where eligible, else the eager reference."""
    plan = plan_cat_gelu_tanh(a, m)
    return cat_gelu_tanh_reference(a, m) if plan.__class__ is str else launch_act_cat(plan)


def cat_swiglu(a, m) -> torch.Tensor:
    """`torch.cat([a, F.silu(m[..., :h]) * m[..., h:]], dim=-1)` (h = m.shape[-1] // 2; a
    None: the SwiGLU alone), guarded but ungated."""
    plan = plan_cat_swiglu(a, m)
    return cat_swiglu_reference(a, m) if plan.__class__ is str else launch_act_cat(plan)


# ---------------------------------------------------------------- references


def gelu_tanh_reference(m) -> torch.Tensor:
    """nn.GELU(approximate="tanh")'s forward."""
    return F.gelu(m, approximate="tanh")


def swiglu_reference(m) -> torch.Tensor:
    """diffusers' `Flux2SwiGLU.forward` (its `gate_fn` an nn.SiLU)."""
    half = m.shape[-1] // 2
    return F.silu(m[..., :half]) * m[..., half:]


def cat_gelu_tanh_reference(a, m) -> torch.Tensor:
    """The eager expression: `torch.cat([a, F.gelu(m, approximate="tanh")], dim=-1)`."""
    y = gelu_tanh_reference(m)
    return y if a is None else torch.cat([a, y], dim=-1)


def cat_swiglu_reference(a, m) -> torch.Tensor:
    """The eager expression: `torch.cat([a, swiglu_reference(m)], dim=-1)`."""
    y = swiglu_reference(m)
    return y if a is None else torch.cat([a, y], dim=-1)


#: a: the attention output [B, S, D / 4] beside m; "alone": no a; "strided": a with
#: padded rows, m a column slice of a wider projection (FLUX.2's fused to_qkv_mlp_proj)
LAYOUTS = ("cat", "alone", "strided")


def _make_args(case: cases.Case, swiglu: bool) -> tuple:
    gen = case.generator()
    B, S, D = case.B, case.S, case.D
    width = 2 * D if swiglu else D
    da = max(1, D // 4)
    if case.layout == "strided":
        a = cases.draw((B, S, da + 3), case.dtype, case.data, gen, case.device)[..., 1 : da + 1]
        m = cases.draw((B, S, width + 96), case.dtype, case.data, gen, case.device, scale=2.0)[..., 96:]
    elif case.layout in ("cat", "alone"):
        a = None if case.layout == "alone" else cases.draw((B, S, da), case.dtype, case.data, gen, case.device)
        m = cases.draw((B, S, width), case.dtype, case.data, gen, case.device, scale=2.0)
    else:
        raise ValueError(f"unknown act_cat layout {case.layout!r}; choose one of {', '.join(LAYOUTS)}")
    return a, m


_LAUNCH = {"lossless": launch_act_cat}
_BIND = {"lossless": bind_act_cat}
SPECS = {
    "cat_gelu_tanh": OpSpec("cat_gelu_tanh", cat_gelu_tanh_reference, plan_cat_gelu_tanh, _LAUNCH, bind=_BIND,
                            make_args=lambda case: _make_args(case, False), layouts=LAYOUTS),
    "cat_swiglu": OpSpec("cat_swiglu", cat_swiglu_reference, plan_cat_swiglu, _LAUNCH, bind=_BIND,
                         make_args=lambda case: _make_args(case, True), layouts=LAYOUTS),
}
#: act -> its op
BY_ACT = {"gelu_tanh": SPECS["cat_gelu_tanh"], "swiglu": SPECS["cat_swiglu"]}


# ---------------------------------------------------------------- torch.library


def _cat_gelu_tanh_op(a: Optional[torch.Tensor], m: torch.Tensor) -> torch.Tensor:
    return cat_gelu_tanh(a, m)


def _cat_swiglu_op(a: Optional[torch.Tensor], m: torch.Tensor) -> torch.Tensor:
    return cat_swiglu(a, m)


cat_gelu_tanh_op = register_op("cat_gelu_tanh", _cat_gelu_tanh_op, cat_gelu_tanh_reference)
cat_swiglu_op = register_op("cat_swiglu", _cat_swiglu_op, cat_swiglu_reference)
