"""Activations in fp32 as aten's CUDA kernels compute them, shared by the kernels
that apply one (`conv_epilogue`, `act_cat`), and the input set of their
whole-domain checks.

A bf16 or fp16 activation's input is a value of the storage dtype and its result
is rounded to that dtype, so it is a function of 65,536 inputs that can all be
compared with eager's on the running GPU (`every_input`). The kernels' cheaper
forms are kept only where such a check found them equal on every input; each
op runs that check itself, once per device and dtype, on its own kernel.

SILU (aten/src/ATen/native/cuda/ActivationSiluKernel.cu): `x / (1 + expf(-x))` in
fp32, built without fast math: `expf` (libdevice's `__nv_expf`) and IEEE division
(`div.rn.f32`). Triton's `tl.exp` is `ex2.approx` of `x * log2(e)` and its fp32 `/`
is `div.full.f32`, either of which changes bits: form 0 calls libdevice's `exp` and
divides with an inline `div.rn.f32`. Triton links libdevice with flush-to-zero on;
that changes `__nv_expf` only where its argument or result is subnormal (|x| below
2**-126, where exp(-x) is 1.0 either way, or x above 87, where 1 + exp(-x) rounds to
1.0 either way), so form 0 keeps eager's bits.

GELU, TANH APPROXIMATION (ActivationGeluKernel.cu, `GeluCUDAKernelImpl`), in fp32:
`0.5 * x * (1 + tanhf(kBeta * (x + kKappa * x**3)))`, kBeta = fp32(sqrt(2) * 2 /
sqrt(pi) * 0.5), kKappa = fp32(0.044715). nvcc contracts by default, so `x + kKappa
* x3` may be one FMA, and `tanhf` is CUDA's where the kernel calls libdevice's: the
FMA flag picks the form, and the whole-domain check decides (on the H100 and H200
both forms equal eager on every bf16 and fp16 input: bench/NOTES.md).

Under Triton's interpreter (CPU tests) libdevice is missing: `INTERP` stand-ins
(numpy's float32 exp; tanh through the sigmoid) check the indexing, the bits are
checked on the GPU.
"""

from __future__ import annotations

import torch

from ._launch import jit, tl

try:  # libdevice (CUDA's expf, tanhf): triton.language.extra.cuda.libdevice in Triton 3.x
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - another Triton layout, or no Triton
    try:
        from triton.language.extra import libdevice
    except ImportError:
        libdevice = None

DOMAIN = (torch.bfloat16, torch.float16)  # 65,536 inputs each: checked whole

#: the SiLU forms: 0 is aten's in fp32 (expf, IEEE division); the others are cheaper
#: and run only where an op's whole-domain check found them equal to eager
SILU_FORMS = {
    0: "aten's: x / (1 + expf(-x)), IEEE division (div.rn.f32)",
    1: "expf, the quotient from rcp.approx and one Newton step (no slow-path branch)",
    2: "ex2.approx of -x log2(e), x * rcp.approx(1 + e)",
}
FAST_SILU_FORMS = (2, 1)  # the fastest first

#: the tanh GELU's forms (its FMA flag): 1, the sum as one FMA; 0, product and sum rounded
GELU_FORMS = (1, 0)


def every_input(dtype: torch.dtype, device) -> torch.Tensor:
    """All 65,536 values of a 16-bit dtype (NaNs, infinities, signed zeros, subnormals)."""
    return torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


@jit
def rcp_approx(d):
    """rcp.approx.f32 (MUFU.RCP, subnormal results kept): 1/d within 1 ULP."""
    return tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=r,r", [d], dtype=tl.float32, is_pure=True,
                                     pack=1)


@jit
def silu(x, FORM: tl.constexpr, INTERP: tl.constexpr):
    """SiLU of fp32 `x` in fp32, in one of `SILU_FORMS` (0: aten's, bit for bit)."""
    if INTERP:
        return x / (1.0 + tl.exp(-x))
    elif FORM == 0:  # aten: x / (1 + expf(-x)), IEEE division
        e = libdevice.exp(-x)
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [x, 1.0 + e], dtype=tl.float32,
                                         is_pure=True, pack=1)
    elif FORM == 1:  # expf, then the quotient from rcp.approx and one Newton step, no branch
        d = 1.0 + libdevice.exp(-x)
        r = rcp_approx(d)
        q = x * r
        res = tl.fma(-q, d, x)
        # res NaN: d = inf (x < -88.7) or x = inf, where q is the quotient; res 0: q is
        # exact, and q + 0 would turn a -0.0 quotient into +0.0
        return tl.where((res == res) & (res != 0.0), tl.fma(res, r, q), q)
    else:  # FORM == 2: ex2.approx of -x log2(e), and x * rcp.approx(d)
        return x * rcp_approx(1.0 + tl.exp(-x))


@jit
def gelu_tanh(x, FMA: tl.constexpr, INTERP: tl.constexpr):
    """`F.gelu(x, approximate="tanh")` of fp32 `x` in fp32, aten's formula; FMA: the
    inner sum `x + kKappa * x**3` as one FMA (`GELU_FORMS`)."""
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
    return (0.5 * x) * (1.0 + t)
