"""Wan's kernel variants on CPU: guards, references, probes, and (under Triton's
interpreter, in fp32 or against an emulation of the interpreter's truncating bf16
store) the kernels' indexing, broadcasting and fp32 arithmetic:

- gated_residual_f32: `(x.float() + y * gate).type_as(x)`, fp32 gate or Folded;
- layer_norm_modulate_f32: `(layer_norm(x.float()) * (1 + scale) + shift).type_as(x)`;
- layer_norm_f32: `F.layer_norm(x.float(), w, b).type_as(x)` (aten's affine epilogue);
- qk_norm_rope with rope_type "wan".

The interpreter rounds fp32 -> bf16 by truncation, so a bf16 output is compared
with the fp32 value truncated; bf16 exactness against eager is the GPU tests' job."""

from __future__ import annotations

import os

import pytest
import torch

from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, cases
from bitfuse.ops import _params as params_module
from bitfuse.ops import gated_residual as G
from bitfuse.ops import layer_norm_modulate as LN
from bitfuse.ops import qk_norm_rope as Q
from bitfuse.ops._launch import HAS_TRITON
from bitfuse.ops._params import Folded, value32

interpreter = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs triton's interpreter (CPU runs)")
EPS = 1e-6


@pytest.fixture
def cpu_kernels(monkeypatch):
    monkeypatch.setattr(params_module, "INTERPRET_ON_CPU", True)
    monkeypatch.setitem(LN._AFFINE_FMA, -1, False)
    monkeypatch.setitem(Q._VIA_F32, -1, True)


def _trunc(t: torch.Tensor, dtype) -> torch.Tensor:
    """fp32 -> dtype as the interpreter stores it (bf16: truncation; fp32: itself)."""
    if dtype is torch.float32:
        return t
    return (t.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


# ---------------------------------------------------------------- references and guards (any machine)


def test_references_are_wans_expressions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    y = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    table, temb = torch.randn(1, 6, 64, generator=g), torch.randn(2, 6, 64, generator=g).to(torch.bfloat16)
    shift, scale, gate = (table + temb.float()).chunk(6, dim=1)[:3]
    norm = torch.nn.LayerNorm(64, 1e-6, elementwise_affine=False)
    from diffusers.models.normalization import FP32LayerNorm

    norm1 = FP32LayerNorm(64, 1e-6, elementwise_affine=False)
    norm2 = FP32LayerNorm(64, 1e-6, elementwise_affine=True)
    with torch.no_grad():
        norm2.weight.normal_(generator=g)
        norm2.bias.normal_(generator=g)
    assert same_bits(LN.layer_norm_modulate_f32_reference(x, scale, shift, 1e-6),
                     (norm1(x.float()) * (1 + scale) + shift).type_as(x))
    assert same_bits(LN.layer_norm_f32_reference(x, norm2.weight, norm2.bias, 1e-6), norm2(x.float()).type_as(x))
    assert same_bits(G.gated_residual_f32_reference(x, y, gate), (x.float() + y.float() * gate).type_as(x))
    folded = Folded(table[0, 2], temb[:, 2:3])
    assert same_bits(value32(folded), (table + temb.float())[:, 2:3])
    assert norm(x.float()).dtype is torch.float32  # (FP32LayerNorm on an fp32 input is F.layer_norm)


def test_wan_rope_reference_is_the_processors():
    """Wan's `apply_rotary_emb` on the [B, S, H, Dh] view equals the op's reference on
    the flat rows, for fp32 tables (as WanRotaryPosEmbed builds them) and float64."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    g = torch.Generator().manual_seed(1)
    rope = WanRotaryPosEmbed(24, (1, 2, 2), 32)
    cos, sin = rope(torch.zeros(1, 4, 3, 4, 6))
    S = cos.shape[1]
    x = torch.randn(2, S, 2 * 24, generator=g).to(torch.bfloat16)

    def stock(hidden_states, freqs_cos, freqs_sin):
        x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
        c = freqs_cos[..., 0::2]
        s = freqs_sin[..., 1::2]
        out = torch.empty_like(hidden_states)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x1 * s + x2 * c
        return out.type_as(hidden_states)

    for f in ((cos, sin), (cos.double(), sin.double())):
        assert same_bits(Q.rope_reference(x, f, "wan"), stock(x.unflatten(2, (2, -1)), *f).flatten(2))


def test_guard_reasons(cpu_kernels):
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    p32, p16 = torch.randn(2, 1, 64), torch.randn(2, 1, 64).to(torch.bfloat16)
    assert "fp32" in G.plan_gated_residual_f32(x, x, p16)
    assert "fp32" in LN.plan_layer_norm_modulate_f32(x, p16, p32, EPS)
    assert "multiple of 4" in LN.plan_layer_norm_modulate_f32(torch.randn(2, 3, 66), p32[..., :66], p32, EPS)
    assert "broadcast" in LN.plan_layer_norm_modulate_f32(x, torch.randn(4, 64), p32, EPS)
    assert "contiguous" in LN.plan_layer_norm_modulate_f32(x.transpose(1, 2), p32, p32, EPS)
    assert "[D]" in LN.plan_layer_norm_f32(x, torch.randn(32), torch.randn(64), EPS)
    bad = Folded(torch.randn(64, dtype=torch.float64), torch.randn(2, 1, 64))
    assert "dtype" in G.plan_gated_residual_f32(x, x, bad)
    mis = torch.randn(2 * 3 * 64 + 1)[1:].view(2, 3, 64)  # fp32, contiguous, 4-byte off a 16-byte line
    assert "aligned" in LN.plan_layer_norm_modulate_f32(mis, p32, p32, EPS)
    q = torch.randn(1, 4, 48).to(torch.bfloat16)
    w = torch.ones(48).to(torch.bfloat16)
    cos = torch.ones(1, 4, 1, 24, dtype=torch.float16)
    why = Q.plan_qk_norm_rope((q,), (q,), ((w, w),), EPS, (((cos, cos), (cos, cos)),), "wan", "aten")
    assert "float32" in why
    cos = torch.ones(1, 4, 1, 20)
    why = Q.plan_qk_norm_rope((q,), (q,), ((w, w),), EPS, (((cos, cos), (cos, cos)),), "wan", "aten")
    assert "divide C" in why


def test_cpu_tensors_take_the_reference():
    x = torch.randn(2, 3, 64)
    p = torch.randn(2, 1, 64)
    assert G.plan_gated_residual_f32(x, x, p) == "CPU tensor"
    assert LN.plan_layer_norm_modulate_f32(x, p, p, EPS) == "CPU tensor"
    assert same_bits(LN.layer_norm_f32(x, p[0, 0], p[1, 0], EPS), LN.layer_norm_f32_reference(x, p[0, 0], p[1, 0], EPS))


def test_specs_are_registered_with_their_layouts():
    for name in ("gated_residual_f32", "layer_norm_modulate_f32", "layer_norm_f32"):
        assert name in SPECS and SPECS[name].make_args is not None and SPECS[name].layouts
    for layout in cases.F32_PARAM_LAYOUTS:
        case = cases.Case(2, 3, 64, torch.bfloat16, layout, "randn", 0, "cpu")
        x, scale, shift, _ = SPECS["layer_norm_modulate_f32"].make_args(case)
        assert x.dtype is torch.bfloat16 and all(value32(p).dtype is torch.float32 for p in (scale, shift))
        assert value32(scale).shape in ((2, 1, 64), (2, 3, 64))


def test_probes_tell_the_forms_apart():
    """The CPU's answers (the GPU's are checked in tests/gpu/test_wan_gpu.py): the probes
    return a definite form and cache it per device."""
    LN._AFFINE_FMA.pop(-1, None)
    Q._VIA_F32.pop(-1, None)
    assert LN.layer_norm_affine_fma(-1) in (True, False)
    assert Q.f64_store_via_f32(-1) in (True, False)
    assert -1 in LN._AFFINE_FMA and -1 in Q._VIA_F32


# ---------------------------------------------------------------- kernels under the interpreter


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", cases.F32_PARAM_LAYOUTS)
@pytest.mark.parametrize("B,S,D,strided", [(2, 5, 256, False), (1, 7, 100, True), (1, 2, 5120, False)])
def test_gated_residual_f32(cpu_kernels, dtype, layout, B, S, D, strided):
    case = cases.Case(B, S, D, dtype, layout, "randn", B + S + D, "cpu", strided)
    x, y, gate = G.F32_SPEC.make_args(case)
    expect = _trunc(x.float() + y * value32(gate), dtype)
    for config, wide in ((None, False), (None, True), ((4, 32, 4), False)):
        plan = G.plan_gated_residual_f32(x, y, gate)
        assert not isinstance(plan, str), plan
        if wide:
            plan = plan._replace(recipe=G._recipe(plan.rows, plan.y_rows, plan.g_strides, True, plan.gate_table,
                                                  (1, 256, 4), True))
        out = torch.full(x.shape, float("nan"), dtype=dtype)
        G.launch_gated_residual(plan, out=out, config=config)
        assert same_bits(out, expect), (layout, config, wide)


def _ln_plain(x32, scale, shift):
    """The exact kernel's output on fp32 x with materialised fp32 parameters (the
    standard variant: aten's Welford, every op fp32): what the f32 variant computes
    before its one store."""
    plan = LN.plan_layer_norm_modulate(x32, value32(scale), value32(shift), EPS)
    assert not isinstance(plan, str), plan
    return LN.launch_layer_norm_modulate(plan)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", cases.F32_PARAM_LAYOUTS)
@pytest.mark.parametrize("B,S,D", [(2, 5, 256), (1, 3, 1000), (1, 2, 3072)])
def test_layer_norm_modulate_f32(cpu_kernels, dtype, layout, B, S, D):
    case = cases.Case(B, S, D, dtype, layout, "randn", B + S + D, "cpu")
    x, scale, shift, eps = LN.F32_SPEC.make_args(case)
    expect = _trunc(_ln_plain(x.float(), scale, shift), dtype)
    plan = LN.plan_layer_norm_modulate_f32(x, scale, shift, eps)
    assert not isinstance(plan, str), plan
    assert ("+table" in plan.key[2]) == layout.startswith("folded")
    for config in (None, (2, 4)):
        out = torch.full(x.shape, float("nan"), dtype=dtype)
        LN.launch_layer_norm_modulate(plan, out=out, config=config)
        assert same_bits(out, expect), config


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
@pytest.mark.parametrize("B,S,D", [(2, 5, 256), (1, 3, 1000), (1, 2, 5120)])
def test_layer_norm_f32_affine(cpu_kernels, dtype, wdtype, B, S, D):
    """The affine epilogue from the kernel's own per-row mean and rstd: `w * n + b` with
    the product rounded (the FMA form's arithmetic is the GPU tests')."""
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(B, S, D, generator=g) * 3 + 1).to(dtype)
    w = (torch.randn(D, generator=g) * 0.5 + 1).to(wdtype)
    b = (torch.randn(D, generator=g) * 0.5).to(wdtype)
    plan = LN.plan_layer_norm_f32(x, w, b, EPS)
    assert not isinstance(plan, str), plan
    assert plan.mode == 1 and plan.fma is False
    stats = torch.full((B * S, 2), float("nan"))
    out = torch.full(x.shape, float("nan"), dtype=dtype)
    LN.launch_layer_norm_modulate(plan, out=out, stats=stats)
    mean, rstd = stats[:, 0].view(B, S, 1), stats[:, 1].view(B, S, 1)
    n = rstd * (x.float() - mean)
    assert same_bits(out, _trunc(n * w.float() + b.float(), dtype))
    torch.testing.assert_close(out.float(), LN.layer_norm_f32_reference(x, w, b, EPS).float(), rtol=2e-2, atol=2e-2)


@interpreter
@pytest.mark.parametrize("fdtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("B,S,Sk,H,Dh", [(1, 6, 6, 2, 24), (2, 5, 3, 4, 64), (1, 3, 3, 40, 128)])
def test_qk_norm_wan_rope(cpu_kernels, fdtype, B, S, Sk, H, Dh):
    """torch.nn.RMSNorm over all H * Dh channels (aten's order), then Wan's RoPE per head:
    the output equals the rotation of the norm computed from the kernel's rsqrt. Sk != S:
    cross-attention's shape (its key without RoPE is the no-RoPE path; here both rotate)."""
    g = torch.Generator().manual_seed(S * H)
    C = H * Dh
    q = torch.randn(B, S, C, generator=g) * 2
    k = torch.randn(B, S, C, generator=g)
    wq, wk = torch.randn(C, generator=g) * 0.5 + 1, torch.randn(C, generator=g) * 0.5 + 1
    theta = torch.rand(1, S, 1, Dh // 2, generator=g, dtype=torch.float64) * 40 - 20
    cos, sin = (t.repeat_interleave(2, -1).to(fdtype) for t in (theta.cos(), theta.sin()))
    args = ((q,), (k,), ((wq, wk),), EPS, (((cos, sin), (cos, sin)),), "wan", "aten")
    plan = Q.plan_qk_norm_rope(*args)
    assert not isinstance(plan, str), plan
    assert plan.rope == (4, Dh, int(fdtype is torch.float64), int(fdtype is torch.float64))
    stats = torch.full((2 * B * S, 2), float("nan"))
    out = tuple(torch.full_like(t, float("nan")) for t in (q, k))
    Q.launch_qk_norm_rope(plan, out=out, stats=stats)
    for i, (x, w) in enumerate(((q, wq), (k, wk))):
        r = stats[i * B * S:(i + 1) * B * S, 1].view(B, S, 1)
        assert same_bits(out[i], Q.rope_reference(w * (x * r), (cos, sin), "wan"))
    if S == Sk:
        kk = torch.randn(B, Sk, C, generator=g)
        plan = Q.plan_qk_norm_rope((q,), (kk,), ((wq, wk),), EPS, None, None, "aten")
        assert not isinstance(plan, str), plan
