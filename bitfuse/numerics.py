"""Comparisons used by the gate, the tests and the reports."""

from __future__ import annotations

import torch

_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, with NaN equal to NaN: a NaN in the input must not count as a
    kernel mismatch, but a NaN where eager has a number must."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    a_nan, b_nan = a.isnan(), b.isnan()
    if not torch.equal(a_nan, b_nan) or not a_nan.any():
        return False
    return torch.equal(a[~a_nan], b[~b_nan])


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of the storage dtype
    (0 for equal values, NaN pairs count 0, NaN against a number is huge)."""
    int_dtype = _INT_OF[a.dtype]
    bits = torch.iinfo(int_dtype).bits

    def ordered(t):
        i = t.contiguous().view(int_dtype).to(torch.int64)
        # map sign-magnitude to a monotonic integer line (-0 and +0 both 0)
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    d = (ordered(a) - ordered(b)).abs()
    both_nan = a.isnan() & b.isnan()
    one_nan = a.isnan() ^ b.isnan()
    d = torch.where(both_nan, torch.zeros_like(d), d)
    return torch.where(one_nan, torch.full_like(d, 1 << 40), d)


def max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    return int(ulp_distance(a, b).max())


def within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and max_ulp(a, b) <= 1


_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def ulp_of(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at each |magnitude| (fp32 in, fp32 out)."""
    info = torch.finfo(dtype)
    _, exp = torch.frexp(magnitude.float().abs().clamp_min(info.tiny))
    return exp2i(exp - 1 - _MANTISSA[dtype])


def exp2i(k: torch.Tensor) -> torch.Tensor:
    """2**k in fp32, exactly, for integers k in [-149, 127], built from its bits.
    (Not `torch.ldexp`: its CUDA kernel can read out of bounds, pytorch/pytorch#189567;
    on two H200s it did with the operands on a device other than the current one.)"""
    k = k.to(torch.int32)
    normal = (k + 127).clamp_min(1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def within_one_ulp_at(a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor, ulps: int = 1) -> bool:
    """|a - b| <= `ulps` ULPs of `magnitude`, elementwise, NaNs where both are NaN.

    The high tier's criterion. No kernel that rounds differently from eager
    anywhere can be within one ULP of eager's *output* everywhere: where `n*t`
    and `shift` nearly cancel, a last-bit change of the intermediate is large
    relative to the small result. ULPs are therefore counted at the scale of
    the op's largest term (|n*t|, |shift|, |out|)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a_nan, b_nan = a.isnan(), b.isnan()
    if not torch.equal(a_nan, b_nan):
        return False
    ok = a_nan | (a.float() - b.float()).abs().le(ulps * ulp_of(magnitude, a.dtype)) | (a == b)
    return bool(ok.all())
