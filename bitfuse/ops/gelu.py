"""GELU with the tanh approximation, `F.gelu(x, approximate="tanh")`: the activation
between the two GEMMs of LTX-2's feed-forwards (diffusers' `GELU(..., approximate="tanh")`).

WHAT EAGER COMPUTES (aten/src/ATen/native/cuda/ActivationGeluKernel.cu,
`GeluCUDAKernelImpl`, tanh branch), per element in fp32:

    x3    = x * x * x
    inner = kBeta * (x + kKappa * x3)    kBeta = fp32(M_SQRT2 * M_2_SQRTPI * 0.5), kKappa = fp32(0.044715)
    y     = 0.5 * x * (1 + tanhf(inner))  rounded once to x's dtype

nvcc contracts by default, so `x + kKappa * x3` may be one FMA, and `tanhf` is CUDA's,
while the kernel's is the libdevice Triton links. Neither is assumed:

EXHAUSTIVE CHECK. A bf16 or fp16 x takes 65,536 values, so the kernel's function can
be compared with eager's on every input it will ever see. `form(device, dtype)` runs
each candidate (FMA 1: the sum as one FMA; 0: product and sum rounded) over all
65,536 inputs into a NaN-poisoned output and compares it with eager's `F.gelu`
bitwise (signed zeros count, NaN equals NaN), once per device and dtype, outside
capture and compile; the kernel runs in the form that equals eager on all of them,
or not at all (eager's kernel then takes every call, with the reason in the gate's
verdict). For this op the lossless claim is a check of the whole input domain, not a
sample; the gate still verifies each signature at first sight as for every op.
fp32 (2**32 inputs) takes eager.

Shapes: x any shape, contiguous, bf16 or fp16. Output: a new contiguous tensor of
x's shape and dtype. Exact in every tier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cases
from ._launch import (
    HAS_TRITON,
    INTERPRET,
    FastLaunch,
    Recipe,
    cdiv,
    device_index,
    jit,
    probe_allowed,
    register_op,
    tl,
)
from ._params import common_device_dtype
from .spec import OpSpec

try:  # libdevice's tanhf: triton.language.extra.cuda.libdevice in Triton 3.x
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - another Triton layout
    try:
        from triton.language.extra import libdevice
    except ImportError:
        libdevice = None

BLOCK, NUM_WARPS = 2048, 8
FORMS = (1, 0)  # FMA flags, the likelier first
DOMAIN = (torch.bfloat16, torch.float16)  # 65,536 inputs each: checked whole

# ---------------------------------------------------------------- kernel


@jit
def _gelu_tanh_kernel(
    x_ptr, out_ptr, N,
    FMA: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK == 0: no masks
    WIDE: tl.constexpr,  # int64 offsets
    BLOCK: tl.constexpr,
    INTERP: tl.constexpr,  # Triton's interpreter has no libdevice: a stand-in tanh (indexing checks only)
):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        x = tl.load(x_ptr + i, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(x_ptr + i, mask=i < N, other=0.0, eviction_policy="evict_first").to(tl.float32)
    x3 = (x * x) * x
    if FMA:
        s = tl.fma(0.044714998453855515, x3, x)  # fp32(0.044715)
    else:
        s = x + 0.044714998453855515 * x3
    inner = 0.7978845834732056 * s  # fp32(M_SQRT2 * M_2_SQRTPI * 0.5)
    if INTERP:
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
    else:
        t = libdevice.tanh(inner)
    y = (0.5 * x) * (1.0 + t)
    if EVEN:
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), cache_modifier=".cs")
    else:
        tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=i < N, cache_modifier=".cs")


_launch = FastLaunch(_gelu_tanh_kernel, ("FMA", "EVEN", "WIDE", "BLOCK", "INTERP"))


def _recipe(N: int, fma: int, block: int = BLOCK, num_warps: int = NUM_WARPS) -> Recipe:
    return Recipe((cdiv(N, block), 1), (N,), (fma, N % block == 0, N + block >= 2**31, block, INTERPRET), num_warps)


# ---------------------------------------------------------------- the exhaustive check

_FORMS: dict = {}


def every_input(dtype: torch.dtype, device) -> torch.Tensor:
    """All 65,536 values of a 16-bit dtype (NaNs, infinities, signed zeros, subnormals)."""
    return torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


def form(device, dtype: torch.dtype) -> int | None:
    """The FMA flag of the kernel form that equals eager's `F.gelu(x, approximate="tanh")`
    on every input of `dtype` (bf16 or fp16) on `device` (found once, then kept); None
    where no form does, or where it can't be checked now (tracing, capture: not kept)."""
    from ..numerics import same_bits

    index = device_index(device)
    key = (index, dtype)
    if key in _FORMS:
        return _FORMS[key]
    if not probe_allowed(index):
        return None
    x = every_input(dtype, "cpu" if index < 0 else f"cuda:{index}")
    ref = F.gelu(x, approximate="tanh")
    found = None
    for fma in FORMS:
        out = torch.full_like(x, float("nan"))
        _launch.launch(_recipe(x.numel(), fma), (x, out))
        if same_bits(out, ref):
            found = fma
            break
    _FORMS[key] = found
    return found


# ---------------------------------------------------------------- planner and launcher


class GeluPlan:
    """A call that passed the guard: x, the kernel form, the launch, the gate key."""

    __slots__ = ("x", "fma", "recipe", "key")

    def __init__(self, x, fma, recipe, key):
        self.x, self.fma, self.recipe, self.key = x, fma, recipe, key


def plan_gelu_tanh(x, tier: str = "lossless"):
    """The guard of `gelu_tanh` (x any shape, contiguous, bf16 or fp16): a plan for the
    kernel, or the reason the call takes the reference."""
    if not HAS_TRITON or (libdevice is None and not INTERPRET):
        return "triton (with libdevice) is not installed"
    if not isinstance(x, torch.Tensor):
        return "x is not a tensor"
    why = common_device_dtype(x)
    if why:
        return why
    cpu = x.get_device() < 0  # the interpreter's indexing checks (tests), any dtype
    if x.dtype not in DOMAIN and not cpu:
        return f"{x.dtype}: only 16-bit inputs can be checked whole (eager's kernel runs)"
    if x.numel() == 0:
        return "empty tensor"
    if not x.is_contiguous():
        return "x is not contiguous"
    if torch.is_grad_enabled() and x.requires_grad:
        return "autograd needs the eager graph"
    fma = 1 if cpu else form(x.device, x.dtype)
    if fma is None:
        return (f"no kernel form equals eager's GELU on all 65,536 {x.dtype} inputs on this device "
                "(or it can't be checked now: tracing, capture)")
    key = (x.dtype, x.get_device(), f"form={fma}", "wide" if x.numel() + BLOCK >= 2**31 else "narrow")
    return GeluPlan(x, fma, _recipe(x.numel(), fma), key)


def launch_gelu_tanh(plan: GeluPlan, out=None, config=None) -> torch.Tensor:
    """Run the kernel for a guarded plan, into `out` (contiguous, x's shape) if given.
    `config` overrides (BLOCK, num_warps)."""
    x = plan.x
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    recipe = plan.recipe if config is None else _recipe(x.numel(), plan.fma, *config)
    _launch.launch(recipe, (x, out))
    return out


def bind_gelu_tanh(plan: GeluPlan):
    """The plan's launch bound to its geometry (`OpSpec.bind`): `run(x)` for a call with
    the plan's shape, dtype and device (contiguous)."""
    recipe, launch = plan.recipe, _launch.launch

    def run(x):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        launch(recipe, (x, out))
        return out

    return run


def gelu_tanh(x) -> torch.Tensor:
    """`F.gelu(x, approximate="tanh")`, guarded but ungated: the kernel where eligible,
    else the eager reference."""
    plan = plan_gelu_tanh(x)
    if plan.__class__ is str:
        return gelu_tanh_reference(x)
    return launch_gelu_tanh(plan)


# ---------------------------------------------------------------- reference


def gelu_tanh_reference(x) -> torch.Tensor:
    """The eager expression: `F.gelu(x, approximate="tanh")`."""
    return F.gelu(x, approximate="tanh")


LAYOUTS = ("contiguous",)


def _make_args(case: cases.Case) -> tuple:
    """x [B, S, D] as the feed-forward's first GEMM hands it over (scale 2: GELU's bend)."""
    return (cases.activation(case, case.generator(), scale=2.0).contiguous(),)


SPEC = OpSpec(
    name="gelu_tanh",
    reference=gelu_tanh_reference,
    plan=plan_gelu_tanh,
    launch={"lossless": launch_gelu_tanh},
    bind={"lossless": bind_gelu_tanh},
    make_args=_make_args,
    layouts=LAYOUTS,
)


# ---------------------------------------------------------------- torch.library


def _gelu_tanh_op(x: torch.Tensor) -> torch.Tensor:
    return gelu_tanh(x)


gelu_tanh_op = register_op("gelu_tanh", _gelu_tanh_op, gelu_tanh_reference)
