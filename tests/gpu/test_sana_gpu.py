"""Sana on the GPU: the convolution epilogues bitwise eager's on every kind of data (op
and site level), and the full-width model with bitfuse lossless bitwise diffusers'
output, every fast path verified; bitfuse high keeps its contract.

The model integration routes the adaLN sites (block norm1/norm2 + modulate, the gated
residuals, the head's SanaModulatedNorm) and GLUMBConv's two convolution epilogues
(conv_bias_silu_site, conv_bias_glu_site; see bitfuse/models/sana.py for the layout
fixes that made the full model bitwise stock), so the model tests cover routing with
the epilogues and assert that both conv verdicts are present and active. The op and
site level tests below check the epilogues on their own.

Op tests need no diffusers: the epilogue kernels (bias + SiLU, bias + gated SiLU) on
random, outlier, zero, subnormal, NaN/inf, large and tiny data, odd sizes,
channels-last, contiguous and strided, each launch into a NaN-poisoned output; every
16-bit value through the SiLU; the conv-level ops at Sana 1.6B's FF shapes, with the
backend aten picks and the strides eager's result has.

Model tests: Sana 1.6B at full width (2240 = 70 heads x 32, cross-attention 20 x 112,
mlp_ratio 2.5), 2 layers, random weights, bf16, 1024 x 1024 (32 x 32 = 1024 tokens),
300 caption tokens, batch 2 as SanaPipeline runs CFG."""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from bitfuse import policy, sites
from bitfuse.numerics import differing, max_ulp, same_bits
from bitfuse.ops import SPECS, cases
from bitfuse.ops import conv_epilogue as E
from bitfuse.ops import linear_attention as LA
from bitfuse.ops._params import value

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
D, HID = 2240, 5600  # Sana 1.6B: inner dim, GLUMBConv hidden channels (2.5 x D)


def _describe(o, r) -> str:
    return f"{differing(o, r)}/{r.numel()} differ, max {max_ulp(o, r)} ULP"


def _poisoned(ref):
    return torch.full(ref.shape, math.nan, dtype=ref.dtype, device=ref.device)


def _tokens_as_nchw(B, H, W, C, dtype, scale=1.0, seed=0):
    """[B, H*W, C] tokens viewed as NCHW, as Sana's FF sees them (channels-last, no copy)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(B, H * W, C, device="cuda", generator=g) * scale
    return t.to(dtype).unflatten(1, (H, W)).permute(0, 3, 1, 2)


# ---------------------------------------------------------------- the epilogue kernels


def _check_spec(name, case):
    spec = SPECS[name]
    args = spec.make_args(case)
    plan = spec.plan(*args)
    assert plan.__class__ is not str, f"{name} {case}: {plan}"
    ref = spec.reference(*args)
    for _ in range(2):  # the compiling launch, then the direct one
        out = spec.launch["lossless"](plan, out=_poisoned(ref))
        assert same_bits(out, ref), f"{name} {case}: {_describe(out, ref)}"
    out = spec.launch["lossless"](plan)
    assert same_bits(out, ref) and out.stride() == ref.stride(), f"{name} {case}: default output"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", ["bias_silu", "bias_glu"])
@pytest.mark.parametrize("layout", E.LAYOUTS)
def test_epilogues_every_data_draw(name, layout, dtype):
    for i, data in enumerate(cases.DATA):
        for B, S, C, strided in ((2, 1024, 5600, False), (1, 1031, 100, True), (3, 7, 257, False), (2, 1, 64, True)):
            _check_spec(name, cases.Case(B, S, C, dtype, layout, data, seed=i, strided=strided))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_silu_of_every_16_bit_value(dtype):
    """All 65,536 bit patterns through the SiLU (bias -0.0: y + -0.0 is y for every y),
    and as the gate of the gated SiLU."""
    y = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    y = y.reshape(1, 1, 256, 256)
    bias = torch.full((1,), -0.0, dtype=dtype, device="cuda")
    plan = E.plan_bias_silu(y, bias)
    out, ref = E.launch_epilogue(plan, out=_poisoned(y)), E.bias_silu_reference(y, bias)
    assert same_bits(out, ref), _describe(out, ref)
    hidden = torch.randn(1, 1, 256, 256, device="cuda").to(dtype)
    y2 = torch.cat([hidden, y], 1)
    bias2 = torch.full((2,), -0.0, dtype=dtype, device="cuda")
    out, ref = E.launch_epilogue(E.plan_bias_glu(y2, bias2)), E.bias_glu_reference(y2, bias2)
    assert same_bits(out, ref), _describe(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("glu", [False, True], ids=["silu", "glu"])
def test_silu_form_is_the_first_equal_on_every_input(dtype, glu):
    """silu_form's choice, checked again from scratch: every form run over all 65,536
    inputs, the chosen one equal to eager on all of them and no faster form before it."""
    E._FORMS.clear()
    chosen = E.silu_form("cuda", dtype, glu)
    assert (torch.cuda.current_device(), dtype, glu) in E._FORMS
    g = E.every_input(dtype, "cuda").view(1, 1, 256, 256)
    ref = F.silu(g)
    y = torch.cat([torch.randn_like(g, dtype=torch.float32).to(dtype), g], 1) if glu else g
    bias = torch.full((y.shape[1],), -0.0, dtype=dtype, device="cuda")
    if glu:
        ref = y[:, :1] * ref
    equal = {}
    for form in E.SILU_FORMS:
        out = E._epilogue(y, bias, glu, _poisoned(ref), form=form)
        equal[form] = same_bits(out, ref)
        print(f"\n{dtype} glu={glu} form {form}: {'equal' if equal[form] else _describe(out, ref)}")
    assert equal[0], "aten's form must equal eager on every input"
    assert equal[chosen], f"form {chosen} was chosen but differs"
    earlier = E.FAST_FORMS[:E.FAST_FORMS.index(chosen)] if chosen in E.FAST_FORMS else E.FAST_FORMS
    assert not any(equal[f] for f in earlier), f"a faster form equal on every input was passed over: {equal}"


def test_silu_fp32_over_the_exponent_range():
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 1 << 22
    x = torch.randn(n, device="cuda", generator=g) * torch.exp2(
        torch.randint(-149, 9, (n,), device="cuda", generator=g).float())
    bits = torch.randint(-2**31, 2**31 - 1, (n,), device="cuda", generator=g, dtype=torch.int64)
    bias = torch.full((1,), -0.0, device="cuda")
    for y in (x, bits.to(torch.int32).view(torch.float32)):
        y = y.reshape(1, 1, 2048, 2048)
        out, ref = E.launch_epilogue(E.plan_bias_silu(y, bias)), E.bias_silu_reference(y, bias)
        assert same_bits(out, ref), _describe(out, ref)


# ---------------------------------------------------------------- the linear attention


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("layout", LA.LAYOUTS)
def test_linear_attention_every_data_draw(layout, dtype):
    """Sana 1.6B's self-attention (B = 2, 1,024 tokens, 70 heads of 32) and odd sizes, on
    every data draw, into a NaN-poisoned output and into eager's strides."""
    spec = SPECS["linear_attention"]
    for i, data in enumerate(cases.DATA):
        for B, S, C in ((2, 1024, 2240), (1, 1031, 96), (3, 7, 64), (1, 1, 32)):
            args = spec.make_args(cases.Case(B, S, C, dtype, layout, data, seed=i))
            plan = spec.plan(*args)
            assert plan.__class__ is not str, plan
            ref = spec.reference(*args)
            for _ in range(2):
                out = spec.launch["lossless"](plan, out=_poisoned(ref))
                assert same_bits(out, ref), f"{data} {B}x{S}x{C}: {_describe(out, ref)}"
            out = spec.launch["lossless"](plan)
            assert same_bits(out, ref) and out.stride() == ref.stride(), f"{data} {B}x{S}x{C}: default output"


def test_linear_attention_signed_zeros():
    """A key that relu zeroes entirely (-0.0 and negatives): the scores are signed zeros,
    and so is the output; its signs are eager's."""
    for dtype in DTYPES:
        q = torch.randn(2, 64, 64, device="cuda").to(dtype)
        v = torch.randn(2, 64, 64, device="cuda").to(dtype)
        for k in (torch.full_like(q, -0.0), -q.abs(), torch.zeros_like(q)):
            out, ref = LA.linear_attention(q, k, v, 2), LA.linear_attention_reference(q, k, v, 2)
            assert same_bits(out, ref), f"{dtype}: {_describe(out, ref)}"


# ---------------------------------------------------------------- the conv-level ops at Sana's shapes


def _ff_operands(dtype, layout, seed=0):
    """conv_inverted's and conv_depth's operands at Sana 1.6B's FF, 1024 x 1024, B = 2."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = _tokens_as_nchw(2, 32, 32, D, dtype, seed=seed)
    if layout == "contiguous":
        x = x.contiguous()
    w1 = (torch.randn(2 * HID, D, 1, 1, device="cuda", generator=g) * D ** -0.5).to(dtype)
    b1 = torch.randn(2 * HID, device="cuda", generator=g).to(dtype)
    w2 = (torch.randn(2 * HID, 1, 3, 3, device="cuda", generator=g) / 3).to(dtype)
    b2 = torch.randn(2 * HID, device="cuda", generator=g).to(dtype)
    return x, w1, b1, w2, b2


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("layout", ["token-view", "contiguous"])
def test_conv_ops_at_sana_shapes(dtype, layout):
    """Sana's own layout (channels-last views) takes cuDNN for both convolutions and both
    biases are split off; contiguous inputs: the 1x1 convolution still takes cuDNN, the
    depthwise one (16-bit) aten's native kernel, which keeps its bias (the GLU epilogue
    fuses the rest). Whatever the backend, the op's result is eager's, in eager's strides."""
    x, w1, b1, w2, b2 = _ff_operands(dtype, layout)
    args1 = (x, w1, b1, (1, 1), (0, 0), (1, 1), 1)
    plan1 = E.plan_conv_bias_silu(*args1)
    ref1 = E.conv_bias_silu_reference(*args1)
    args2 = (ref1, w2, b2, (1, 1), (1, 1), (1, 1), 2 * HID)
    plan2 = E.plan_conv_bias_glu(*args2)
    ref2 = E.conv_bias_glu_reference(*args2)
    backends = (E.conv_backend(*args1[:3], *args1[3:]), E.conv_backend(*args2[:3], *args2[3:]))
    print(f"\n{dtype} {layout}: backends {backends}, plans {getattr(plan1, 'key', plan1)} / "
          f"{getattr(plan2, 'key', plan2)}")
    if layout == "token-view":
        assert backends == ("Cudnn", "Cudnn") and plan1.split and plan2.split
    for plan, ref in ((plan1, ref1), (plan2, ref2)):
        if plan.__class__ is str:
            continue
        out = E.launch_conv(plan)
        assert same_bits(out, ref), _describe(out, ref)
        assert out.stride() == ref.stride()
        assert same_bits(E.launch_conv(plan, out=_poisoned(ref)), ref)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("data", cases.DATA)
def test_fused_depthwise_every_data_draw(dtype, data):
    """The depthwise convolution and its GLU epilogue in one kernel (`E.depthwise_glu`,
    planned for a channels-last 16-bit 3x3 depthwise on cuDNN): bitwise the stock
    convolution + epilogue, in its strides, on every data draw, at Sana's shape and odd
    ones (image edges in both directions, channel blocks cut short), into poisoned outputs."""
    for B, C2, H, W in ((2, 2 * HID, 32, 32), (1, 130, 17, 13), (3, 64, 5, 40)):
        g = torch.Generator(device="cuda").manual_seed(C2 + H)
        x = cases.draw((B, C2, H, W), dtype, data, g, "cuda", 2.0).contiguous(memory_format=torch.channels_last)
        w = cases.draw((C2, 1, 3, 3), dtype, "randn", g, "cuda", 1 / 3)
        b = cases.draw((C2,), dtype, data, g, "cuda")
        args = (x, w, b, (1, 1), (1, 1), (1, 1), C2)
        plan = E.plan_conv_bias_glu(*args)
        assert plan.__class__ is not str and plan.fused, getattr(plan, "key", plan)
        ref = E.conv_bias_glu_reference(*args)
        out = E.launch_conv(plan)
        assert same_bits(out, ref) and out.stride() == ref.stride(), (B, C2, H, W, _describe(out, ref))
        assert same_bits(E.launch_conv(plan, out=_poisoned(ref)), ref)


def test_the_bias_split_itself():
    """What the planner relies on, checked directly: on the Cudnn backend conv2d with a bias
    is conv2d without it, then an eager add_ of the bias."""
    for dtype in DTYPES:
        x, w1, b1, w2, b2 = _ff_operands(dtype, "token-view", seed=1)
        y = F.conv2d(x, w1, b1)
        assert same_bits(y, F.conv2d(x, w1, None).add_(b1.reshape(1, -1, 1, 1)))
        z = F.conv2d(y, w2, b2, 1, 1, 1, 2 * HID)
        assert same_bits(z, F.conv2d(y, w2, None, 1, 1, 1, 2 * HID).add_(b2.reshape(1, -1, 1, 1)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("data", cases.DATA)
def test_gated_residual_with_a_layers_bias_every_data_draw(dtype, data):
    """The gated residual's y as Folded(bias, output) (to_out's bias,
    `sites.linear_bias_split`): bitwise `x + (output + bias) * gate`
    at Sana's width and an odd one, per-sample and Folded gates, into poisoned outputs."""
    from bitfuse.ops import gated_residual as GR

    for D_, layout in ((D, "folded"), (D, "per-sample"), (1000, "per-token")):
        case = cases.Case(2, 1031, D_, dtype, layout, data, seed=3, device="cuda", strided=layout == "per-token")
        x, y, gate = GR.SPEC.make_args(case)
        bias = cases.draw((D_,), dtype, data, torch.Generator(device="cuda").manual_seed(4), "cuda")
        plan = GR.plan_gated_residual(x, sites.Folded(bias, y), gate)
        assert not isinstance(plan, str), plan
        ref = x + (y + bias) * value(gate)
        for _ in range(2):
            out = GR.launch_gated_residual(plan, out=_poisoned(ref))
            assert same_bits(out, ref), (D_, layout, _describe(out, ref))


def test_the_linear_bias_split_fact_at_sana_shapes():
    """`sites.linear_bias_split` (to_out on the linear attention's transposed output, bf16
    and fp16) hands on a Folded whose value is the layer's output, bit for bit and in its
    layout, the fact verified on this GPU."""
    torch.manual_seed(6)
    for dtype in (torch.bfloat16, torch.float16):
        lin = torch.nn.Linear(D, D).cuda().to(dtype)
        x = torch.randn(2, D, 1024, device="cuda", dtype=dtype).transpose(1, 2)
        with torch.no_grad():
            ref = lin(x)
            for _ in range(2):
                got = sites.linear_bias_split(lin, x)
                assert got.__class__ is sites.Folded
                assert same_bits(got.value(), ref) and got.value().stride() == ref.stride(), _describe(got.value(), ref)
    assert [(v.op, v.status) for v in policy.verdicts()] == [("linear_bias_split", "verified")] * 2


def test_conv_sites_verify_on_glumbconv():
    """GLUMBConv's modules through the sites: verified at first sight, then the fast path;
    the outputs are the stock module calls' bits.

    It reproduced the first-sight layout bug that once took the epilogues out of the
    Sana integration (failing on 2026-12-01: the silu site's output equal to eager's in
    bits, the GLU site's then differing, the first-sight output being row-major where
    eager's is channels-last, which sent the depthwise convolution to another aten
    backend). Fixed since: the policy hands on eager's own result wherever the layouts
    differ."""
    diffusers = pytest.importorskip("diffusers")  # noqa: F841
    from diffusers.models.transformers.sana_transformer import GLUMBConv

    torch.manual_seed(0)
    ff = GLUMBConv(D, D, 2.5, norm_type=None, residual_connection=False).cuda().to(torch.bfloat16).eval()
    x = _tokens_as_nchw(2, 32, 32, D, torch.bfloat16, seed=2)
    with torch.no_grad():
        a_ref = ff.nonlinearity(ff.conv_inverted(x))
        h, g = torch.chunk(ff.conv_depth(a_ref), 2, dim=1)
        b_ref = h * ff.nonlinearity(g)
        for _ in range(2):
            a = sites.conv_bias_silu_site(ff.conv_inverted, ff.nonlinearity, x)
            b = sites.conv_bias_glu_site(ff.conv_depth, ff.nonlinearity, a)
            assert same_bits(a, a_ref) and same_bits(b, b_ref)
    found = {v.op: v for v in policy.verdicts()}
    assert found["conv_bias_silu"].active and found["conv_bias_glu"].active, [str(v) for v in found.values()]


# ---------------------------------------------------------------- the model

LAYERS = 2
_models: dict = {}


def _model(variant="1.0"):
    pytest.importorskip("diffusers")
    from bitfuse.models.sana_configs import build_model, full_config

    if variant not in _models:
        _models.clear()
        torch.cuda.empty_cache()
        _models[variant] = build_model(full_config(LAYERS, variant), device="cuda", dtype=torch.bfloat16, seed=0)
    return _models[variant]


def _run(model, kw):
    with torch.no_grad():
        out = model(**kw)
    torch.cuda.synchronize()
    return out


def _verdicts() -> str:
    return ", ".join(f"{v.signature}={v.status}" for v in policy.verdicts()) or "(none)"


def _check_lossless(model, calls):
    import bitfuse

    refs = [_run(model, kw)[0] for kw in calls]
    assert all(torch.isfinite(r).all() for r in refs)
    with bitfuse.accelerate(model):
        for kw, ref in zip(calls, refs):
            first = _run(model, kw)[0]
            steady = _run(model, kw)[0]
            assert same_bits(first, ref), _describe(first, ref)
            assert same_bits(steady, ref), _describe(steady, ref)
    print(f"\nverdicts: {_verdicts()}")
    bad = [v for v in policy.verdicts() if not v.active]
    assert not bad, "; ".join(f"{v.signature}: {v.status} {v.detail}" for v in bad)
    ops = {v.op for v in policy.verdicts()}
    assert ops >= {"layer_norm_modulate", "gated_residual", "conv_bias_silu", "conv_bias_glu", "linear_attention",
                   "projections", "linear_bias_split"}, \
        _verdicts()
    assert any(v.op == "gated_residual" and v.signature.endswith("y+bias") for v in policy.verdicts()), _verdicts()
    layers = len(model.transformer_blocks)
    captions = [v for v in policy.verdicts() if v.op == "projections" and f"N={(2240,) * 2 * layers}" in v.signature]
    assert captions and all(v.active for v in captions), _verdicts()  # every block's caption k, v: one GEMM
    for kw, ref in zip(calls, refs):
        assert same_bits(_run(model, kw)[0], ref)  # restored


@pytest.mark.parametrize("variant", ["1.0", "1.5"])
def test_lossless_cfg_batch_at_1024(variant):
    """The pipeline's call: batch 2 (negative and positive prompt), 300 caption tokens
    with the tokenizer's mask (a short negative prompt, a longer positive one)."""
    from bitfuse.models.sana_configs import make_inputs

    model = _model(variant)
    _check_lossless(model, [make_inputs(model, 2, 1024, 1024, 300, text_lengths=[3, 120], seed=0)])


def test_lossless_other_resolutions_and_batch_1():
    """768 x 1344 (24 x 42 tokens) at batch 2, and 512 x 512 at batch 1 (no CFG)."""
    from bitfuse.models.sana_configs import make_inputs

    model = _model("1.0")
    _check_lossless(model, [make_inputs(model, 2, 768, 1344, 300, text_lengths=[300, 17], seed=1),
                            make_inputs(model, 1, 512, 512, 300, seed=2)])


def _rms(a, b) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt())


def test_high_keeps_its_contract():
    import bitfuse
    from bitfuse.models.sana_configs import make_inputs

    model = _model("1.0")
    kw = make_inputs(model, 2, 1024, 1024, 300, text_lengths=[3, 120], seed=3)
    ref = _run(model, kw)[0]
    with bitfuse.accelerate(model, quality="high"):
        _run(model, kw)
        high = _run(model, kw)[0]
    bad = [v for v in policy.verdicts() if not v.active]
    assert not bad, _verdicts()
    assert any(v.op == "layer_norm_modulate" and v.tier == "high" for v in policy.verdicts()), _verdicts()
    assert {"conv_bias_silu", "conv_bias_glu"} <= {v.op for v in policy.verdicts()}, _verdicts()  # exact in every tier
    assert same_bits(_run(model, kw)[0], ref)  # restored
    exact_model = copy.deepcopy(model).float()
    kw32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    exact = _run(exact_model, kw32)[0]
    del exact_model
    torch.cuda.empty_cache()
    err_high, err_eager = _rms(high, exact), _rms(ref, exact)
    print(f"\n[high] vs eager: {_describe(high, ref)}; rms vs fp32: high {err_high:.3e}, eager {err_eager:.3e}")
    assert torch.isfinite(high).all() and err_high <= 1.25 * err_eager


# ---------------------------------------------------------------- speed (printed, not asserted)


def test_speed_epilogues_at_sana_shapes():
    """The epilogues at Sana 1.6B's FF (B = 2, 1024 tokens, 11,200 conv channels) against
    eager's ops after cuDNN and the copy ceiling (target: >= 85% of it)."""
    from bench.timing import GraphTimer, copy_ceiling_tbps, sets_for

    ceiling = copy_ceiling_tbps()
    for name in ("bias_silu", "bias_glu"):
        y0 = _tokens_as_nchw(2, 32, 32, 2 * HID, torch.bfloat16)
        moved = y0.numel() * 2 * (2 if name == "bias_silu" else 1.5)
        n = sets_for(int(moved))
        sets = [(_tokens_as_nchw(2, 32, 32, 2 * HID, torch.bfloat16, seed=i),
                 torch.randn(2 * HID, device="cuda").to(torch.bfloat16)) for i in range(n)]
        spec = SPECS[name]
        plans = [spec.plan(*a) for a in sets]
        times = {}
        glu = name == "bias_glu"
        variants = [("eager", [lambda a=a, ref=spec.reference: ref(*a) for a in sets]),
                    ("bitfuse", [lambda p=p: E.launch_epilogue(p) for p in plans])]
        variants += [(f"form {f}", [lambda a=a, f=f: E._epilogue(*a, glu, form=f) for a in sets])
                     for f in E.SILU_FORMS]
        for variant, calls in variants:
            timer = GraphTimer(calls)
            times[variant] = statistics.median(timer.sample(20))
            timer.close()
        chosen = E.silu_form("cuda", torch.bfloat16, glu)
        for variant in times:
            tbps = moved / (times[variant] * 1e-6) / 1e12
            print(f"\n{name} {variant}{' (chosen)' if variant == f'form {chosen}' else ''}: "
                  f"{times[variant]:.1f} us, {tbps:.2f} TB/s = {100 * tbps / ceiling:.0f}% of the copy ceiling "
                  f"({ceiling:.2f} TB/s)")
