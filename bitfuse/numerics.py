"""Comparisons used by the gate, the tests and the reports."""

from __future__ import annotations

import torch

_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
           torch.float64: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, the lossless contract: same shape, dtype and bits, so
    signed zeros count (-0.0 is not +0.0); a NaN equals any NaN (its payload is
    not a value), but a NaN where the other has a number does not."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    int_dtype = _INT_OF.get(a.dtype)
    if int_dtype is None:
        return torch.equal(a, b)
    ai, bi = a.view(int_dtype), b.view(int_dtype)
    if torch.equal(ai, bi):
        return True
    return bool(((ai == bi) | (a.isnan() & b.isnan())).all())


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ bitwise (NaN against NaN: equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    int_dtype = _INT_OF.get(a.dtype)
    if int_dtype is None:
        return int((a != b).sum())
    return int((~((a.view(int_dtype) == b.view(int_dtype)) | (a.isnan() & b.isnan()))).sum())


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


_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def ulp_of(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at each |magnitude| (fp32 in, fp32 out)."""
    info = torch.finfo(dtype)
    _, exp = torch.frexp(magnitude.float().abs().clamp(info.tiny, info.max))
    return exp2i(exp - 1 - _MANTISSA[dtype])


def exp2i(k: torch.Tensor) -> torch.Tensor:
    """2**k in fp32, exactly, for integers k in [-149, 127], built from its bits.
    (Not `torch.ldexp`: its CUDA kernel can read out of bounds, pytorch/pytorch#189567;
    on two H200s it did with the operands on a device other than the current one.)"""
    k = k.to(torch.int32)
    normal = (k + 127).clamp_min(1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def ulp_errors(out: torch.Tensor, ref64: torch.Tensor, terms64: torch.Tensor) -> torch.Tensor:
    """|out - ref64| in ULPs of out's dtype at the scale max(terms64, |ref64|), float64,
    elementwise: the high tier's error measure. Counted at the scale of the op's
    largest term, not of the result: where terms nearly cancel, eager's own
    roundings of the terms are large next to the small result."""
    scale = terms64.abs().maximum(ref64.abs()).clamp_max(torch.finfo(torch.float32).max)
    return (out.double() - ref64).abs() / ulp_of(scale, out.dtype).double()


HIGH_MAX_ULP = 1.0


def high_contract(out: torch.Tensor, eager: torch.Tensor, ref64: torch.Tensor, terms64: torch.Tensor) -> str | None:
    """The high tier's contract, or why `out` breaks it (None: it holds).

    Where the float64 value of the expression rounds to a finite value of out's
    dtype: every element of `out` within HIGH_MAX_ULP ULP of it (at the terms'
    scale, `ulp_errors`), and the mean of that error no larger than eager's over
    the elements where eager's result is finite (where eager overflowed or gave NaN
    on a finite value, eager's error is unbounded). Where it rounds to NaN or an
    infinity (NaN or inf inputs, a result beyond the dtype's range), `out` must be
    that value, bit for bit (any NaN for NaN).

    Checked CONTRACT_CHUNK elements at a time, so that the float64 temporaries stay
    small beside the operands: the gate runs this at first sight inside the model's
    forward, where whole-tensor temporaries of a [2, 6144, 4096] output would add
    gigabytes to its peak."""
    if out.shape != eager.shape or out.dtype != eager.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, eager {tuple(eager.shape)} {eager.dtype}"
    o, e, r, t = (torch.broadcast_to(v, out.shape).reshape(-1) for v in (out, eager, ref64, terms64))
    err_sum = eager_sum = 0.0
    counted_n = 0
    for i in range(0, o.numel(), CONTRACT_CHUNK):
        oc, ec, rc, tc = (v[i:i + CONTRACT_CHUNK] for v in (o, e, r, t))
        rounded = rc.to(out.dtype)
        finite = torch.isfinite(rounded)
        if not bool(finite.all()):
            if not same_bits(oc[~finite], rounded[~finite]):
                return "differs from the float64 value where that is NaN or infinite"
            oc, ec, rc, tc = oc[finite], ec[finite], rc[finite], tc[finite]
            if oc.numel() == 0:
                continue
        err = ulp_errors(oc, rc, tc)
        worst = float(err.max())
        if not worst <= HIGH_MAX_ULP:  # (also catches NaN)
            return f"{worst:.3g} ULP from the float64 value (the contract: <= {HIGH_MAX_ULP:g})"
        eager_err = ulp_errors(ec, rc, tc)
        counted = torch.isfinite(eager_err)
        n = int(counted.sum())
        if n:
            err_sum += float(err[counted].sum())
            eager_sum += float(eager_err[counted].sum())
            counted_n += n
    if counted_n and err_sum > eager_sum:  # the means, over the same count
        return f"mean error {err_sum / counted_n:.3g} ULP, above eager's {eager_sum / counted_n:.3g}"
    return None


CONTRACT_CHUNK = 1 << 22  # elements a step of `high_contract`: its float64 temporaries are 32 MB each
