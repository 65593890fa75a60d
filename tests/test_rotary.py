"""RoPE: the reference against diffusers, the guard, the site's dispatch, and the
kernels' indexing under Triton's interpreter in fp32 (exact there; bf16 is the
GPU tests' job)."""

import dataclasses
import os

import pytest
import torch

from bitfuse import policy, sites
from bitfuse.numerics import same_bits
from bitfuse.ops import rotary as R
from bitfuse.ops._launch import HAS_TRITON

ltx2 = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")

interpreter = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter (CPU runs)"
)


def _interleaved_freqs(B, S, C, g, broadcast=False):
    b = 1 if broadcast else B
    return torch.randn(b, S, C, generator=g), torch.randn(b, S, C, generator=g)


def _split_freqs(B, S, H, r, g):
    # as diffusers builds them: [B, S, H, r] swapped to [B, H, S, r] (a strided view)
    return (torch.randn(B, S, H, r, generator=g).swapaxes(1, 2), torch.randn(B, S, H, r, generator=g).swapaxes(1, 2))


def _two_roundings(x, freqs, rope_type):
    """Eager's CUDA roundings written as separate ops: CPU `addcmul_` fuses its
    multiply-add (one rounding), CUDA's rounds the product first."""
    cos, sin = freqs
    if rope_type == "interleaved":
        return R.rotary_reference(x, freqs, "interleaved")
    b, h, t, r = cos.shape
    xs = x.reshape(b, t, h, 2, r).swapaxes(1, 2).float()
    a, c = xs[..., 0, :], xs[..., 1, :]
    out = torch.stack([a * cos + (-sin) * c, c * cos + sin * a], -2)
    return out.swapaxes(1, 2).reshape(b, t, -1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_diffusers(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 24, generator=g).to(dtype)
    freqs = _interleaved_freqs(2, 7, 24, g)
    assert same_bits(R.rotary_reference(x, freqs, "interleaved"), ltx2.apply_interleaved_rotary_emb(x, freqs))
    freqs = _split_freqs(2, 7, 3, 4, g)
    assert same_bits(R.rotary_reference(x, freqs, "split"), ltx2.apply_split_rotary_emb(x, freqs))


def test_guard_reasons():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 24, generator=g)
    cos, sin = _interleaved_freqs(2, 5, 24, g)
    assert R.plan_rotary(x, (cos, sin), "interleaved") == "CPU tensor"
    assert "unknown rope_type" in R.plan_rotary(x, (cos, sin), "complex")
    assert R.plan_rotary(x, cos, "interleaved") == "freqs is not a (cos, sin) pair"
    geometry = R._geometry_of(x, None, cos[:, :, :12], sin, "interleaved")
    assert geometry == "cos/sin do not broadcast to x's shape"
    assert R._geometry_of(x[..., :23], None, cos[..., :23], sin[..., :23], "interleaved") == "odd channel count"
    cs, sn = _split_freqs(2, 5, 3, 4, g)
    assert R._geometry_of(x[:, :4], None, cs, sn, "split").startswith("x is not")
    assert R._geometry_of(x, None, cos, sin, "split").startswith("split RoPE expects")
    assert R._geometry_of(x, torch.randn(2, 6, 24), cos, sin, "interleaved") == "query and key shapes differ"
    assert R._geometry_of(x[:0], None, cos[:0], sin[:0], "interleaved") == "empty tensor"


def test_site_plain_under_compile_and_on_cpu(monkeypatch):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 6, 16, generator=g), torch.randn(1, 6, 16, generator=g)
    freqs = _interleaved_freqs(1, 6, 16, g)
    want = (ltx2.apply_interleaved_rotary_emb(q, freqs), ltx2.apply_interleaved_rotary_emb(k, freqs))
    got = sites.rotary_site(q, k, freqs, None, "interleaved")  # CPU tensors: the reference, no verdict
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert policy.verdicts() == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(R, "launch_rotary", lambda *a, **k: pytest.fail("kernel launched while compiling"))
    got = sites.rotary_site(q, k, freqs, freqs, "interleaved")
    assert all(same_bits(a, b) for a, b in zip(got, want))


def test_site_gates_the_shared_launch(monkeypatch):
    """One launch for query and key sharing frequencies, verified against the pair reference."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 6, 16, generator=g), torch.randn(1, 6, 16, generator=g)
    freqs = _interleaved_freqs(1, 6, 16, g)
    calls = []

    def plan(x, freqs, rope_type, y=None, tier="lossless"):
        calls.append(y is not None)
        return R.RotaryPlan(rope_type, x, y, *freqs, *R._geometry_of(x, y, *freqs, rope_type))

    def wrong(p, out=None):  # disagrees with eager
        return (p.x + 1, p.y) if p.y is not None else p.x + 1

    monkeypatch.setattr(R, "plan_rotary", plan)
    monkeypatch.setattr(sites, "_ROTARY", {t: dataclasses.replace(s, launch={"lossless": wrong})
                                          for t, s in sites._ROTARY.items()})
    with pytest.warns(policy.FallbackWarning, match="rotary"):
        got = sites.rotary_site(q, k, freqs, None, "interleaved")
    assert calls == [True]
    want = (R.rotary_reference(q, freqs, "interleaved"), R.rotary_reference(k, freqs, "interleaved"))
    assert all(same_bits(a, b) for a, b in zip(got, want))
    [verdict] = policy.verdicts()
    assert verdict.status == "mismatch" and "q+k" in verdict.signature
    # separate frequencies: two single launches (another signature: verified, and refused, anew)
    calls.clear()
    other = _interleaved_freqs(1, 6, 16, g)
    with pytest.warns(policy.FallbackWarning, match="rotary"):
        sites.rotary_site(q, k, freqs, other, "interleaved")
    assert calls == [False, False]


@interpreter
@pytest.mark.parametrize("B,S,C", [(1, 1, 2), (2, 7, 24), (3, 13, 258), (2, 5, 2240), (1, 3, 4096)])
@pytest.mark.parametrize("config", [None, (8, 4)])
def test_interleaved_kernel_fp32(B, S, C, config):
    g = torch.Generator().manual_seed(B * 100 + S + C)
    x, y = torch.randn(B, S, C, generator=g), torch.randn(B, S, C, generator=g)
    for broadcast in (False, True):
        freqs = _interleaved_freqs(B, S, C, g, broadcast)
        for wide in (False, True):
            plan = R.RotaryPlan("interleaved", x, y, *freqs, *R._geometry_of(x, y, *freqs, "interleaved"))
            plan = plan._replace(wide=wide)
            out = (torch.full_like(x, float("nan")), torch.full_like(y, float("nan")))
            R.launch_rotary(plan, out=out, config=config)
            assert same_bits(out[0], _two_roundings(x, freqs, "interleaved"))
            assert same_bits(out[1], _two_roundings(y, freqs, "interleaved"))


@interpreter
@pytest.mark.parametrize("B,S,H,r", [(1, 1, 1, 1), (2, 7, 3, 4), (2, 13, 35, 32), (1, 5, 32, 64)])
@pytest.mark.parametrize("config", [None, (16, 4)])
def test_split_kernel_fp32(B, S, H, r, config):
    g = torch.Generator().manual_seed(B * 100 + S + H + r)
    x, y = torch.randn(B, S, 2 * H * r, generator=g), torch.randn(B, S, 2 * H * r, generator=g)
    freqs = _split_freqs(B, S, H, r, g)
    dense = tuple(f.contiguous() for f in freqs)
    for f in (freqs, dense):
        for wide in (False, True):
            plan = R.RotaryPlan("split", x, None, *f, *R._geometry_of(x, None, *f, "split"))._replace(wide=wide)
            out = torch.full_like(x, float("nan"))
            R.launch_rotary(plan, out=out, config=config)
            assert same_bits(out, _two_roundings(x, f, "split"))
    plan = R.RotaryPlan("split", x, y, *freqs, *R._geometry_of(x, y, *freqs, "split"))
    xo, yo = R.launch_rotary(plan, config=config)
    assert same_bits(xo, _two_roundings(x, freqs, "split")) and same_bits(yo, _two_roundings(y, freqs, "split"))


@interpreter
def test_strided_x():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 40, generator=g)[:, :, 4:28]  # rows of 24 inside rows of 40
    freqs = _interleaved_freqs(2, 5, 24, g)
    plan = R.RotaryPlan("interleaved", x, None, *freqs, *R._geometry_of(x, None, *freqs, "interleaved"))
    assert same_bits(R.launch_rotary(plan, config=(8, 4)), _two_roundings(x, freqs, "interleaved"))


@interpreter
@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_signed_zeros_are_eagers(rope_type):
    """Exact zeros of both signs in x and in the tables: eager negates (-x_imag, -sin)
    with a true negation, -(+0.0) = -0.0; Triton's unary minus is 0 - x, which gives
    +0.0 (the fp16 difference the held-out fuzz run found). The kernels negate by a
    product, bit for bit eager's (fp32 in the interpreter, the same bits logic)."""
    g = torch.Generator().manual_seed(4)
    B, S, C = 2, 6, 16
    x = torch.randn(B, S, C, generator=g)
    x = torch.where(torch.rand(B, S, C, generator=g) < 0.5, x * 0.0, x)
    if rope_type == "interleaved":
        cos, sin = _interleaved_freqs(B, S, C, g)
    else:
        cos, sin = _split_freqs(B, S, 2, 4, g)
    cos = torch.where(torch.rand(cos.shape, generator=g) < 0.5, cos * 0.0, cos)
    sin = torch.where(torch.rand(sin.shape, generator=g) < 0.5, sin * 0.0, sin)
    plan = R.RotaryPlan(rope_type, x, None, cos, sin, *R._geometry_of(x, None, cos, sin, rope_type))
    want = _two_roundings(x, (cos, sin), rope_type)
    assert (want == 0).any() and torch.signbit(want[want == 0]).any()  # the case is there
    assert same_bits(R.launch_rotary(plan), want)
