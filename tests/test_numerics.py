"""The gate's comparisons, on CPU."""

import math

import pytest
import torch

from bitfuse import numerics
from bitfuse.numerics import (
    differing,
    exp2i,
    high_contract,
    same_bits,
    ulp_distance,
    ulp_errors,
    ulp_of,
)


def test_exp2i_is_ldexp_over_the_whole_fp32_range():
    k = torch.arange(-149, 128)
    assert torch.equal(exp2i(k), torch.ldexp(torch.ones(k.shape), k))


def test_ulp_of_is_the_gap_to_the_next_value():
    g = torch.Generator().manual_seed(0)
    for dtype, int_dtype in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32)):
        v = (torch.randn(4096, generator=g) * 100).abs().to(dtype)
        v = v[v.isfinite() & (v >= torch.finfo(dtype).tiny)]
        next_up = (v.view(int_dtype) + 1).view(dtype)  # positive: one more in the bits is the next value
        assert torch.equal(next_up.float() - v.float(), ulp_of(v, dtype))


def test_same_bits_counts_signed_zeros_and_equates_nans():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        a = torch.tensor([0.0, 1.0, math.nan, -math.inf], dtype=dtype)
        assert same_bits(a, a.clone())
        b = a.clone()
        b[0] = -0.0
        assert torch.equal(a[:2], b[:2]) and not same_bits(a, b) and differing(a, b) == 1
        c = a.clone()
        c[2] = -math.nan  # another NaN: still NaN
        assert same_bits(a, c)
        d = a.clone()
        d[2] = 0.0  # a number where the other has NaN
        assert not same_bits(a, d)
        assert not same_bits(a, a.to(torch.float32 if dtype != torch.float32 else torch.float64))
    strided = torch.zeros(4, 6)[:, ::2]
    assert same_bits(strided, torch.zeros(4, 3)) and not same_bits(strided, -torch.zeros(4, 3))


def test_ulps_at_the_terms_scale():
    a = torch.tensor([1.0, 1.0078125, 0.0078125], dtype=torch.bfloat16)
    ref64 = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    err = ulp_errors(a, ref64, torch.ones(3, dtype=torch.float64))
    assert err.tolist() == [0.0, 1.0, 1.0]  # at the scale of 1.0, 2**-7 is one bf16 ULP
    assert int(ulp_distance(a, ref64.to(torch.bfloat16)).max()) > 1  # yet many ULPs of the result itself


@pytest.mark.parametrize("chunk", [1 << 22, 3, 1])
def test_high_contract(chunk, monkeypatch):
    """The same verdicts whether the elements are checked at once or a few at a time
    (`CONTRACT_CHUNK`: the gate's first sight keeps its float64 temporaries small)."""
    monkeypatch.setattr(numerics, "CONTRACT_CHUNK", chunk)
    eager = torch.tensor([1.0, 2.0, math.nan, math.inf], dtype=torch.bfloat16)
    ref64 = torch.tensor([1.0, 2.0, math.nan, math.inf], dtype=torch.float64)
    terms = ref64.abs()
    assert high_contract(eager.clone(), eager, ref64, terms) is None
    off = eager.clone()
    off[2] = 1.0  # a number where the exact value is NaN
    assert "NaN or infinite" in high_contract(off, eager, ref64, terms)
    # where eager overflowed on a finite exact value, an accurate result is better, not wrong
    over = torch.tensor([1.0, 3.0e38], dtype=torch.bfloat16) * 2  # eager: 6e38 overflows bf16 to inf
    exact64 = torch.tensor([2.0, 6.0e38 / 4], dtype=torch.float64)
    assert high_contract(exact64.to(torch.bfloat16), over, exact64, exact64.abs()) is None
    worse = eager.clone()
    worse[0] = 1.0078125  # one ULP: within the bound, but eager was exact
    assert "mean error" in high_contract(worse, eager, ref64, terms)
    far = eager.clone()
    far[1] = 2.0625  # four ULPs of 2.0
    assert "ULP from the float64 value" in high_contract(far, eager, ref64, terms)


def test_high_contract_mean_over_chunks(monkeypatch):
    """The mean-error comparison is over every counted element, not per chunk: an
    output better than eager's in one chunk and worse in another is judged on both."""
    up = 1.0078125  # 1 + 2**-7, one bf16 ULP above 1
    ref64 = torch.full((2,), 1.0 + 2**-9, dtype=torch.float64)  # a quarter ULP above 1
    eager = torch.tensor([up, 1.0], dtype=torch.bfloat16)  # errors 0.75, 0.25 ULP
    out = torch.tensor([1.0, up], dtype=torch.bfloat16)  # 0.25, 0.75: the same mean
    monkeypatch.setattr(numerics, "CONTRACT_CHUNK", 1)
    assert high_contract(out, eager, ref64, ref64.abs()) is None
    out[0] = up  # 0.75, 0.75: above eager's mean
    assert "mean error" in high_contract(out, eager, ref64, ref64.abs())
