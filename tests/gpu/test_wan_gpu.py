"""Wan at full width on the GPU: bitfuse lossless is bitwise diffusers' output, every
fast path verified (the fp32-compute adaLN, gated residuals and norm2, the fused q/k
RMSNorm + Wan RoPE); the op variants bitwise against their eager references on
strided, odd and special (NaN/inf, zeros, subnormal) operands, into poisoned outputs.

Wan 2.1 14B's width (40 heads x 128 = 5120, ffn 13824, text 512 x 4096) with 2 of its
40 layers at 832 x 480 x 81 frames (32,760 tokens), B=1 as WanPipeline calls it, and
B=2 on a shorter video; Wan 2.2 TI2V 5B's width (3072, ffn 14336, 48 channels) with 2
layers at 1280 x 704 x 121 frames (27,280 tokens), per-token timestep
(`expand_timesteps`): its block parameters reach the kernels Folded (table row + temb)."""

from __future__ import annotations

import time

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import policy  # noqa: E402
from bitfuse.models.wan_configs import (  # noqa: E402
    build_model,
    full_config,
    make_inputs,
    video_tokens,
)
from bitfuse.numerics import differing, max_ulp, same_bits  # noqa: E402
from bitfuse.ops import SPECS, cases  # noqa: E402
from bitfuse.ops import layer_norm_modulate as LN  # noqa: E402
from bitfuse.ops import qk_norm_rope as Q  # noqa: E402

pytestmark = pytest.mark.gpu

LAYERS = 2
WAN21 = (480, 832, 81)  # 32,760 tokens
WAN22 = (704, 1280, 121)  # 27,280 tokens
WAN_OPS = {"layer_norm_modulate_f32", "gated_residual_f32", "layer_norm_f32", "qk_norm_rope"}

_models: dict = {}


def _model(variant: str):
    if variant not in _models:
        _models.clear()  # one full-width model at a time
        torch.cuda.empty_cache()
        _models[variant] = build_model(full_config(variant, LAYERS), device="cuda", dtype=torch.bfloat16, seed=0)
    return _models[variant]


def _run(model, kw):
    with torch.no_grad():
        out = model(**kw)
    torch.cuda.synchronize()
    return out


def _describe(o, r) -> str:
    return f"{differing(o, r)}/{r.numel()} differ, max {max_ulp(o, r)} ULP"


def _verdicts() -> str:
    return ", ".join(f"{v.signature}={v.status}" for v in policy.verdicts()) or "(none)"


def _assert_all_verified():
    bad = [v for v in policy.verdicts() if not v.active]
    assert not bad, "fast paths broke their contract on this GPU: " + "; ".join(
        f"{v.signature}: {v.status} {v.detail}" for v in bad)


def _verified(op: str, text: str = "") -> bool:
    return any(v.op == op and v.active and text in v.signature for v in policy.verdicts())


def _check_lossless(model, calls, quality="lossless"):
    refs = [_run(model, kw)[0] for kw in calls]
    assert all(torch.isfinite(r).all() for r in refs)
    with bitfuse.accelerate(model, quality=quality):
        for kw, ref in zip(calls, refs):
            first = _run(model, kw)[0]  # first call: new kernels compile in the background (eager's bits meanwhile)
            steady = _run(model, kw)[0]  # first sights verified here, then the kernels run
            assert same_bits(first, ref), _describe(first, ref)
            assert same_bits(steady, ref), _describe(steady, ref)
    print(f"\nverdicts: {_verdicts()}")
    _assert_all_verified()
    assert {v.op for v in policy.verdicts()} >= WAN_OPS, _verdicts()
    for kw, ref in zip(calls, refs):
        assert same_bits(_run(model, kw)[0], ref)  # restored


# ---------------------------------------------------------------- the models


def test_probes_find_a_form_on_this_gpu():
    """aten's affine LayerNorm epilogue (FMA or not) and the float64 -> 16-bit store
    (through fp32 or not) are each one known form here (else those paths fall back)."""
    fma, via32 = LN.layer_norm_affine_fma(0), Q.f64_store_via_f32(0)
    print(f"\naffine epilogue FMA: {fma}; float64 store through fp32: {via32}")
    assert fma is not None and via32 is not None


def test_lossless_wan21_at_480p_81_frames():
    """Wan 2.1 14B width, 32,760 tokens, B=1 (the conditional and the unconditional pass
    are separate calls): per-sample fp32 parameters, [B, 1, D] chunks read in place."""
    model = _model("2.1-14b")
    assert video_tokens("2.1-14b", *WAN21) == 32760
    _check_lossless(model, [make_inputs(model, 1, *WAN21, seed=0), make_inputs(model, 1, *WAN21, seed=1)])
    # B=1: the [1, 1, D] chunks are the "shared" layout class
    assert _verified("layer_norm_modulate_f32", "shared") and _verified("gated_residual_f32", "shared")
    assert _verified("qk_norm_rope", "wan") and _verified("qk_norm_rope", "none")


def test_lossless_wan21_batch_2_and_high_tier():
    """B=2 (samples 6D apart), a shorter video (17 frames: 7,800 tokens); quality="high"
    mounts (every Wan site is exact in both tiers) and gives the same bits."""
    model = _model("2.1-14b")
    calls = [make_inputs(model, 2, 480, 832, 17, seed=2)]
    _check_lossless(model, calls)
    assert _verified("layer_norm_modulate_f32", "per-sample") and _verified("gated_residual_f32", "per-sample")
    policy.reset_verdicts()
    _check_lossless(model, calls, quality="high")


def test_lossless_wan22_5b_per_token_at_720p():
    """Wan 2.2 TI2V 5B width, 27,280 tokens, the per-token timestep: the six block
    parameters are Folded (fp32 table row + bf16 temb view), summed in the kernels."""
    model = _model("2.2-5b")
    assert video_tokens("2.2-5b", *WAN22) == 27280
    _check_lossless(model, [make_inputs(model, 1, *WAN22, seed=3)])
    assert _verified("layer_norm_modulate_f32", "+table") and _verified("gated_residual_f32", "+table")
    assert _verified("layer_norm_modulate_f32", "per-token")  # the head's [B, S, D] chunks


def test_lossless_wan22_5b_per_sample_batch_2():
    model = _model("2.2-5b")
    _check_lossless(model, [make_inputs(model, 2, 704, 1280, 21, per_token_timestep=False, seed=4)])


def test_lossless_is_faster_than_eager_wan21():
    """A sanity check of the speed (bench/models.py measures it properly): 2 layers at
    32,760 tokens, median of 5 forwards each."""
    model = _model("2.1-14b")
    kw = make_inputs(model, 1, *WAN21, seed=5)

    def median_ms():
        _run(model, kw)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            _run(model, kw)
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[2]

    eager = median_ms()
    with bitfuse.accelerate(model):
        lossless = median_ms()
    _assert_all_verified()
    print(f"\nWan 2.1 width, {LAYERS} layers, 32,760 tokens: eager {eager:.2f} ms, lossless {lossless:.2f} ms "
          f"({eager / lossless:.3f}x)")
    assert lossless < eager


# ---------------------------------------------------------------- the op variants


def _poisoned_launch(spec, args):
    plan = spec.plan(*args)
    assert not isinstance(plan, str), plan
    ref = spec.reference(*args)
    if isinstance(ref, tuple):
        out = tuple(torch.full_like(r, float("nan")) for r in ref)
    else:
        out = torch.full_like(ref, float("nan"))
    got = spec.launch["lossless"](plan, out=out)
    return got, ref


@pytest.mark.parametrize("data", cases.DATA)
@pytest.mark.parametrize("name", ["gated_residual_f32", "layer_norm_modulate_f32", "layer_norm_f32"])
def test_op_variants_bitwise_on_every_layout_and_draw(name, data):
    """Every layout of each fp32-compute op, bf16/fp16/fp32 x, Wan's widths and odd
    ones, strided rows, NaN/inf/zeros/subnormals: bitwise eager, outputs poisoned."""
    spec = SPECS[name]
    shapes = [(1, 1560, 5120), (2, 300, 3072), (1, 37, 1000), (2, 5, 100)]
    for B, S, D in shapes:
        if name != "gated_residual_f32" and D % 4:
            continue
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for layout in spec.layouts:
                for strided in (False, True):
                    case = cases.Case(B, S, D, dtype, layout, data, B * S + D, "cuda", strided)
                    args = spec.make_args(case)
                    got, ref = _poisoned_launch(spec, args)
                    assert same_bits(got, ref), (name, case, _describe(got, ref))


@pytest.mark.parametrize("fdtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("data", ["randn", "outlier", "special"])
@pytest.mark.parametrize("B,S,Sk,H", [(1, 4096, 512, 40), (2, 777, 512, 24), (1, 33, 33, 2)])
def test_qk_norm_wan_rope_bitwise(fdtype, data, B, S, Sk, H):
    """torch.nn.RMSNorm(H * 128, weight) of query and key + Wan's RoPE (fp32 tables as
    diffusers builds them, float64 too), and the cross-attention's norms alone (key of
    512 text tokens): bitwise the eager reference, outputs poisoned."""
    g = torch.Generator(device="cuda").manual_seed(S)
    C, Dh = H * 128, 128
    q = cases.draw((B, S, C), torch.bfloat16, data, g, "cuda", 2.0)
    k = cases.draw((B, S, C), torch.bfloat16, data, g, "cuda")
    kx = cases.draw((B, Sk, C), torch.bfloat16, data, g, "cuda")
    wq, wk = (cases.draw((C,), torch.bfloat16, "randn", g, "cuda", 0.5) + 1 for _ in range(2))
    theta = torch.rand(1, S, 1, Dh // 2, generator=g, device="cuda", dtype=torch.float64) * 40 - 20
    cos, sin = (t.repeat_interleave(2, -1).to(fdtype) for t in (theta.cos(), theta.sin()))
    spec = SPECS["qk_norm_rope"]
    for args in (((q,), (k,), ((wq, wk),), 1e-6, (((cos, sin), (cos, sin)),), "wan", "aten"),
                 ((q,), (kx,), ((wq, wk),), 1e-6, None, None, "aten")):
        got, ref = _poisoned_launch(spec, args)
        for o, r in zip(got, ref):
            assert same_bits(o, r), (args[5], fdtype, data, _describe(o, r))


def test_wan_sites_verify_through_the_gate_on_a_strided_fused_projection():
    """A fused qkv projection's chunks (views 3C apart) go through the site and the gate."""
    from bitfuse import sites

    g = torch.Generator(device="cuda").manual_seed(0)
    C, S = 5120, 2048
    qkv = cases.draw((1, S, 3 * C), torch.bfloat16, "randn", g, "cuda")
    q, k, _ = qkv.chunk(3, dim=-1)
    nq, nk = (torch.nn.RMSNorm(C, eps=1e-6).cuda().to(torch.bfloat16) for _ in range(2))
    theta = torch.rand(1, S, 1, 64, generator=g, device="cuda") * 40 - 20
    freqs = tuple(t.repeat_interleave(2, -1) for t in (theta.cos(), theta.sin()))
    with torch.no_grad():
        ref = (Q.rope_reference(nq(q), freqs, "wan"), Q.rope_reference(nk(k), freqs, "wan"))
        got = sites.qk_norm_rope_site(nq, nk, q, k, freqs, None, "wan")
    assert all(same_bits(o, r) for o, r in zip(got, ref))
    _assert_all_verified()
    assert _verified("qk_norm_rope", "wan")
