"""Sana's linear attention (ops.linear_attention) on the CPU: the reference is
diffusers' processor, line for line; the guard's reasons; under Triton's interpreter
(fp32: the interpreter truncates fp32 -> bf16) the kernels' indexing, masks, the row
of ones, the relu's sign of -0.0, strided operands and eager's output strides,
bitwise against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, cases
from bitfuse.ops import linear_attention as LA
from interpreted import cpu_kernels, interpreter



def test_reference_is_diffusers_processor():
    """The reference, between the projections and to_out, against diffusers'
    SanaLinearAttnProcessor2_0 run on an Attention whose projections are identities."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0

    C, heads = 64, 2
    attn = Attention(query_dim=C, heads=heads, dim_head=C // heads, bias=False,
                     processor=SanaLinearAttnProcessor2_0()).eval()
    with torch.no_grad():
        for lin in (attn.to_q, attn.to_k, attn.to_v, attn.to_out[0]):
            lin.weight.copy_(torch.eye(C))
            if lin.bias is not None:
                lin.bias.zero_()
    x = torch.randn(2, 10, C)
    with torch.no_grad():
        stock = attn(x)
        ours = attn.to_out[0](LA.linear_attention_reference(x, x, x, heads))
    assert same_bits(ours, stock)


def test_spec_is_registered():
    assert SPECS["linear_attention"] is LA.SPEC
    for layout in LA.LAYOUTS:
        q, k, v, heads = LA.SPEC.make_args(cases.Case(2, 9, 64, torch.float32, layout, "randn", device="cpu"))
        assert q.shape == k.shape == v.shape == (2, 9, 64) and heads == 2
        assert (q.stride(1) == 64) == (layout == "contiguous")


def test_guard_reasons():
    q = torch.randn(2, 8, 64)
    assert LA.plan_linear_attention(q, q, q, 2) == "CPU tensor"
    with cpu_kernels():
        assert LA.plan_linear_attention(q, q, q[:, :4], 2) == "q, k and v must be [B, N, C] of one shape"
        assert "does not divide" in LA.plan_linear_attention(q, q, q, 3)
        assert "powers of two" in LA.plan_linear_attention(torch.randn(1, 4, 48), torch.randn(1, 4, 48),
                                                           torch.randn(1, 4, 48), 2)
        t = torch.randn(2, 64, 8).transpose(1, 2)
        assert "not contiguous" in LA.plan_linear_attention(t, t, t, 2)
        assert LA.plan_linear_attention(q, q.half(), q, 2).__class__ is str
        g = q.clone().requires_grad_()
        assert "autograd" in LA.plan_linear_attention(g, g, g, 2)
        assert LA.plan_linear_attention(q, q, q, 2).__class__ is LA.LinearAttentionPlan


@interpreter
@pytest.mark.parametrize("B, N, C, heads", [(2, 64, 64, 2), (1, 37, 32, 1), (3, 130, 96, 3), (1, 1, 16, 4)])
@pytest.mark.parametrize("layout", LA.LAYOUTS)
def test_kernels_match_the_reference(B, N, C, heads, layout):
    """fp32 operands with zeros, -0.0, NaN and inf in places; the launch into a
    NaN-poisoned output of any strides and into eager's default strides."""
    g = torch.Generator().manual_seed(B * 1000 + N)
    qkv = torch.randn(B, N, 3 * C, generator=g)
    qkv[..., ::7] = 0.0
    qkv[..., 1::11] = -0.0
    if N > 3:
        qkv[0, 1, 5] = math.nan
        qkv[-1, 2, C + 3] = math.inf
    if layout == "contiguous":
        q, k, v = (t.contiguous() for t in qkv.split(C, dim=-1))
    else:
        q, k, v = qkv.split(C, dim=-1)
    ref = LA.linear_attention_reference(q, k, v, heads)
    with cpu_kernels():
        plan = LA.plan_linear_attention(q, k, v, heads)
        assert plan.__class__ is LA.LinearAttentionPlan, plan
        out = LA.launch_linear_attention(plan)
        assert out.stride() == ref.stride() and same_bits(out, ref)
        poisoned = torch.full((B, N, C), math.nan)
        assert same_bits(LA.launch_linear_attention(plan, out=poisoned), ref)
        bound = LA.bind_linear_attention(plan)(q, k, v, heads)
        assert same_bits(bound, ref)


@interpreter
def test_relu_sign_of_negative_zero_follows_the_probe(monkeypatch):
    """A key of -0.0 everywhere but one column: the scores' signed zeros reach the
    output, so a relu that made -0.0 into +0.0 where eager keeps it (or the reverse)
    differs; the kernel follows whichever the probe reports."""
    B, N, C, heads = 1, 8, 16, 1
    q = torch.randn(B, N, C)
    k = torch.full((B, N, C), -0.0)
    v = torch.randn(B, N, C)
    for keep in (True, False):
        monkeypatch.setitem(LA._NEG_ZERO, (-1, torch.float32), keep)
        with cpu_kernels():
            plan = LA.plan_linear_attention(q, k, v, heads)
            out = LA.launch_linear_attention(plan)
        kk = k if keep else torch.zeros_like(k)
        ref = LA.linear_attention_reference(q, kk, v, heads)
        assert same_bits(out, ref)
    LA._NEG_ZERO.clear()


def test_probe_of_relu():
    LA._NEG_ZERO.clear()
    assert LA.relu_keeps_negative_zero("cpu", torch.float32) is bool(torch.relu(torch.tensor(-0.0)).signbit())
    assert (-1, torch.float32) in LA._NEG_ZERO
    LA._NEG_ZERO.clear()
