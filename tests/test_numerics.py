"""The gate's comparisons, on CPU."""

import torch

from bitfuse.numerics import exp2i, ulp_distance, ulp_of, within_one_ulp_at


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


def test_within_one_ulp_at_the_terms_scale():
    a = torch.tensor([1.0, 1.0, 0.0078125], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 1.0078125, 0.0], dtype=torch.bfloat16)  # equal; one ULP of 1; far below 1's ULP
    magnitude = torch.ones(3)
    assert within_one_ulp_at(a, b, magnitude)
    assert not within_one_ulp_at(a, b, torch.full((3,), 0.01))
    assert int(ulp_distance(a, b).max()) > 1  # yet many ULPs of the output itself
