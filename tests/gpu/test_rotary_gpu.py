"""Bit-exactness of the RoPE kernels against diffusers' eager functions, on the GPU.

Fresh random inputs, NaN-poisoned outputs, odd sizes (S prime, C not a power
of two, B > 1), batch-broadcast and strided frequencies as diffusers builds
them, query and key in one launch."""

import pytest
import torch

from bitfuse import policy, sites
from bitfuse.numerics import differing, same_bits
from bitfuse.ops import rotary as R

ltx2 = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DIFFUSERS = {"interleaved": ltx2.apply_interleaved_rotary_emb, "split": ltx2.apply_split_rotary_emb}


def _angles(*shape, gen):
    # like the RoPE module: cos/sin of fp32 angles spread over several turns
    theta = torch.rand(*shape, device="cuda", generator=gen) * 40 - 20
    return theta.cos(), theta.sin()


def _poisoned(x):
    return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)


def _check(rope_type, x, y, freqs):
    ref_x, ref_y = DIFFUSERS[rope_type](x, freqs), DIFFUSERS[rope_type](y, freqs)
    plan = R.plan_rotary(x, freqs, rope_type)
    assert not isinstance(plan, str), plan
    out = _poisoned(ref_x)
    R.launch_rotary(plan, out=out)
    assert same_bits(out, ref_x), f"{differing(out, ref_x)} of {out.numel()} differ"
    plan = R.plan_rotary(x, freqs, rope_type, y=y)
    assert not isinstance(plan, str), plan
    out = (_poisoned(ref_x), _poisoned(ref_y))
    R.launch_rotary(plan, out=out)
    assert same_bits(out[0], ref_x) and same_bits(out[1], ref_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,C", [(1, 6144, 4096), (2, 1031, 2048), (2, 126, 2240), (1, 1, 64), (2, 7, 130)])
def test_interleaved_exact(dtype, B, S, C):
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), B, S, C)) % 2**31)
    x = torch.randn(B, S, C, device="cuda", dtype=dtype, generator=gen) * 4
    y = torch.randn(B, S, C, device="cuda", dtype=dtype, generator=gen)
    _check("interleaved", x, y, _angles(B, S, C, gen=gen))
    # the same angle for each pair, as diffusers' repeat_interleave builds it
    cos, sin = _angles(B, S, C // 2, gen=gen)
    _check("interleaved", x, y, (cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)))
    if B > 1:  # frequencies shared across the batch
        _check("interleaved", x, y, _angles(1, S, C, gen=gen))
    wide = torch.randn(B, S, C + 6, device="cuda", dtype=dtype, generator=gen)
    _check("interleaved", wide[..., 2:C + 2], y, _angles(B, S, C, gen=gen))  # strided x
    _check("interleaved", *_signed_zeros(x, y, gen), _zeroed(_angles(B, S, C, gen=gen), gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,H,r", [(1, 6144, 32, 64), (2, 1031, 32, 32), (2, 126, 35, 32), (1, 1, 1, 8), (2, 7, 3, 5)])
def test_split_exact(dtype, B, S, H, r):
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), B, S, H, r)) % 2**31)
    x = torch.randn(B, S, 2 * H * r, device="cuda", dtype=dtype, generator=gen) * 4
    y = torch.randn(B, S, 2 * H * r, device="cuda", dtype=dtype, generator=gen)
    cos, sin = _angles(B, S, H, r, gen=gen)
    _check("split", x, y, (cos.swapaxes(1, 2), sin.swapaxes(1, 2)))  # diffusers' view
    _check("split", x, y, (cos.swapaxes(1, 2).contiguous(), sin.swapaxes(1, 2).contiguous()))
    _check("split", *_signed_zeros(x, y, gen), _zeroed((cos.swapaxes(1, 2), sin.swapaxes(1, 2)), gen))


def _signed_zeros(x, y, gen):
    """About half the elements exact zeros of x's sign (the fp16 case where Triton's
    unary minus, 0 - x, once returned +0.0 for eager's -0.0)."""
    return tuple(torch.where(torch.rand(t.shape, device="cuda", generator=gen) < 0.5, t * 0, t) for t in (x, y))


def _zeroed(freqs, gen):
    return tuple(torch.where(torch.rand(f.shape, device="cuda", generator=gen) < 0.3, f * 0, f) for f in freqs)


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_site_verifies_and_matches(rope_type):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 257, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 257, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    freqs = _angles(2, 257, 2048, gen=gen) if rope_type == "interleaved" else tuple(
        f.swapaxes(1, 2) for f in _angles(2, 257, 32, 32, gen=gen))
    for _ in range(3):  # first sight, then the verified direct launch
        got = sites.rotary_site(q, k, freqs, None, rope_type)
        assert same_bits(got[0], DIFFUSERS[rope_type](q, freqs))
        assert same_bits(got[1], DIFFUSERS[rope_type](k, freqs))
    assert [v.status for v in policy.verdicts()] == ["verified"]
