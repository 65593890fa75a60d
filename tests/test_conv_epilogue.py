"""Convolution epilogues on the CPU: references against diffusers' GLUMBConv, guard
reasons, the backend question, the sites' routing; under Triton's interpreter (fp32)
the kernels' indexing, masks, both tile orientations, strides and output layouts.

The interpreter computes the SiLU with numpy's float32 exp and division (the GPU
kernel calls libdevice's expf and an IEEE division, as aten's CUDA silu does), so
kernel outputs are compared bitwise with the same expression in numpy float32; the
GPU tests compare them with eager's bits."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bitfuse import policy, sites
from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, cases
from bitfuse.ops import _launch
from bitfuse.ops import _params as params_module
from bitfuse.ops import conv_epilogue as E
from interpreted import cpu_kernels, interpreter



def np_silu(t: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in numpy float32: what the interpreter computes."""
    a = t.detach().contiguous().numpy()
    return torch.from_numpy(a / (np.float32(1) + np.exp(-a)))


def np_bias_silu(y, bias):
    return np_silu(y + bias.reshape(1, -1, 1, 1))


def np_bias_glu(y, bias):
    hidden, gate = torch.chunk(y if bias is None else y + bias.reshape(1, -1, 1, 1), 2, dim=1)
    return hidden * np_silu(gate)


def _layout(t, layout):
    if layout == "channels-last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "token-view":  # Sana's FF input: [B, H*W, C] tokens viewed as NCHW
        B, C, H, W = t.shape
        return t.permute(0, 2, 3, 1).reshape(B, H * W, C).unflatten(1, (H, W)).permute(0, 3, 1, 2)
    if layout == "channel-slice":  # a non-dense view: channels of a wider channels-last tensor
        B, C, H, W = t.shape
        wide = torch.cat([t, torch.zeros(B, 5, H, W)], 1).contiguous(memory_format=torch.channels_last)
        return wide[:, :C]
    if layout == "nchw-slice":
        B, C, H, W = t.shape
        return torch.cat([torch.zeros(B, 3, H, W), t], 1)[:, 3:]
    return t.contiguous()


# ---------------------------------------------------------------- references


def test_references_are_glumbconvs_ops():
    """The conv-level references are GLUMBConv's lines; the epilogue references are what
    eager runs after a cuDNN convolution (conv without bias, `add_` of the bias)."""
    from diffusers.models.transformers.sana_transformer import GLUMBConv

    torch.manual_seed(0)
    ff = GLUMBConv(16, 16, 2.5, norm_type=None, residual_connection=False).eval()
    x = torch.randn(2, 16, 3, 5)
    with torch.no_grad():
        a = ff.nonlinearity(ff.conv_inverted(x))
        c = ff.conv_inverted
        assert same_bits(a, E.conv_bias_silu_reference(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups))
        d = ff.conv_depth
        h, g = torch.chunk(d(a), 2, dim=1)
        b = h * ff.nonlinearity(g)
        assert same_bits(b, E.conv_bias_glu_reference(a, d.weight, d.bias, d.stride, d.padding, d.dilation, d.groups))
        y = F.conv2d(a, d.weight, None, d.stride, d.padding, d.dilation, d.groups)
        y2 = y.clone().add_(d.bias.reshape(1, -1, 1, 1))
        h2, g2 = torch.chunk(y2, 2, dim=1)
        assert same_bits(E.bias_glu_reference(y, d.bias), h2 * F.silu(g2))
        assert same_bits(E.bias_silu_reference(y, d.bias), F.silu(y2))


def test_specs_are_registered():
    for name in ("bias_silu", "bias_glu", "conv_bias_silu", "conv_bias_glu"):
        spec = SPECS[name]
        assert spec.tiers == ("lossless",) and spec.layouts == E.LAYOUTS
        args = spec.make_args(cases.Case(2, 6, 10, torch.float32, "channels-last", "randn", 0, "cpu"))
        out = spec.reference(*args)
        assert out.shape[:2] == (2, 10) and out.shape[2] * out.shape[3] == 6


@pytest.mark.parametrize("name", ["bias_silu", "bias_glu", "conv_bias_silu", "conv_bias_glu"])
@pytest.mark.parametrize("layout", E.LAYOUTS)
def test_make_args_layouts(name, layout):
    for strided in (False, True):
        case = cases.Case(2, 7, 12, torch.float32, layout, "zeros", 1, "cpu", strided)
        x = SPECS[name].make_args(case)[0]
        assert x.shape[2:] == (1, 7)
        assert (x.stride(1) == 1) == (layout == "channels-last")
        assert x.is_contiguous() == (layout == "contiguous" and not strided)


def test_image_of():
    assert E.image_of(1024) == (32, 32) and E.image_of(6144) == (64, 96)
    assert E.image_of(1031) == (1, 1031) and E.image_of(1) == (1, 1) and E.image_of(8) == (2, 4)


# ---------------------------------------------------------------- guards


def test_cpu_tensors_take_the_reference():
    y, b = torch.randn(2, 8, 3, 3), torch.randn(8)
    assert E.plan_bias_silu(y, b) == "CPU tensor"
    assert same_bits(E.bias_silu(y, b), E.bias_silu_reference(y, b))
    w = torch.randn(8, 1, 3, 3)
    assert E.plan_conv_bias_glu(y, w, b, 1, 1, 1, 8) == "CPU tensor"
    assert same_bits(E.conv_bias_glu(y, w, b, 1, 1, 1, 8), E.conv_bias_glu_reference(y, w, b, 1, 1, 1, 8))


def test_guard_reasons():
    with cpu_kernels():
        y = torch.randn(2, 8, 3, 3)
        assert E.plan_bias_silu(y, None).startswith("no bias")
        assert E.plan_bias_silu(y, torch.randn(7)) == "bias is not [C]"
        assert E.plan_bias_glu(torch.randn(2, 7, 3, 3), None).startswith("odd channel count")
        assert E.plan_bias_silu(y, torch.randn(8, dtype=torch.float64)).startswith("unsupported dtype") or \
            E.plan_bias_silu(y, torch.randn(8, dtype=torch.float64)).startswith("mixed dtypes")
        assert E.plan_bias_silu(torch.randn(8, 3, 3), torch.randn(3)).startswith("y must be 4-D")
        assert E.plan_bias_silu(torch.randn(2, 8, 0, 3), torch.randn(8)) == "empty tensor"
        assert E.plan_bias_silu(torch.randn(2, 8, 4, 6).transpose(2, 3), torch.randn(8)).startswith("H and W")
        x, w = torch.randn(2, 8, 3, 3), torch.randn(8, 8, 1, 1)
        assert E.plan_conv_bias_silu(x, w, torch.randn(8), 1, "same", 1, 1).startswith("stride, padding")
        assert E.plan_conv_bias_glu(x, torch.randn(7, 8, 1, 1), None, 1, 0, 1, 1).startswith("odd output")
        assert E.plan_conv_bias_silu(x, w, torch.randn(4), 1, 0, 1, 1) == "bias is not [C_out]"
        # the CPU's convolution adds its bias inside (mkldnn, slow_conv2d): nothing for the SiLU epilogue
        assert "adds the bias inside" in E.plan_conv_bias_silu(x, w, torch.randn(8), 1, 0, 1, 1)
        plan = E.plan_conv_bias_glu(x, w, torch.randn(8), 1, 0, 1, 1)
        assert not plan.split and plan.key[-1] == "bias in conv"
        with torch.enable_grad():
            wg = w.clone().requires_grad_()
            assert E.plan_conv_bias_glu(x, wg, None, 1, 0, 1, 1) == "autograd needs the eager graph"


def test_the_bias_is_split_only_where_aten_adds_it_separately(monkeypatch):
    """The planner asks aten which backend eager's conv2d takes, for the call with its
    bias and the call without, and splits the bias off only for SPLIT_BACKENDS."""
    seen = []

    def fake(x, weight, bias, stride, padding, dilation, groups):
        seen.append(bias is None)
        return "Cudnn" if (bias is None or not fake.bias_inside) else "CudaDepthwise2d"

    monkeypatch.setattr(E, "conv_backend", fake)
    x, w, b = torch.randn(2, 8, 5, 5), torch.randn(8, 1, 3, 3), torch.randn(8)
    with cpu_kernels():
        fake.bias_inside = False
        plan = E.plan_conv_bias_glu(x, w, b, 1, 1, 1, 8)
        assert plan.split and "Cudnn" in plan.key and "bias split" in plan.key and "3x3 depthwise" in plan.key
        assert E.plan_conv_bias_silu(x, w, b, 1, 1, 1, 8).split
        fake.bias_inside = True  # the backends differ with and without a bias: never split
        plan = E.plan_conv_bias_glu(x, w, b, 1, 1, 1, 8)
        assert not plan.split and "CudaDepthwise2d" in plan.key
        assert "adds the bias inside" in E.plan_conv_bias_silu(x, w, b, 1, 1, 1, 8)
    assert seen.count(False) >= 2 and seen.count(True) >= 2


@pytest.mark.parametrize("setting", ["benchmark", "deterministic"])
def test_a_verdict_is_per_cudnn_setting(monkeypatch, setting):
    """Which cuDNN algorithm eager's convolution runs depends on torch.backends.cudnn's
    settings (`benchmark = True` times the algorithms and keeps the fastest), and the
    fused depthwise kernel reproduces the one run at first sight: a setting changed
    later makes a new plan key and a new bound-launch key, so the call is verified
    again rather than trusted."""
    monkeypatch.setattr(E, "conv_backend", lambda *a: "Cudnn")
    x = torch.randn(2, 8, 5, 5).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(8, 1, 3, 3).to(torch.bfloat16), torch.randn(8).to(torch.bfloat16)
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8).to(torch.bfloat16)
    cudnn = torch.backends.cudnn
    before = getattr(cudnn, setting)
    with cpu_kernels(), torch.no_grad():
        key = E.plan_conv_bias_glu(x, w, b, 1, 1, 1, 8).key
        site_key = sites._conv_key("conv_bias_glu", sites._conv_args(conv, torch.nn.SiLU(), x))
        try:
            setattr(cudnn, setting, not before)
            assert E.plan_conv_bias_glu(x, w, b, 1, 1, 1, 8).key != key
            assert sites._conv_key("conv_bias_glu", sites._conv_args(conv, torch.nn.SiLU(), x)) != site_key
        finally:
            setattr(cudnn, setting, before)
        assert E.plan_conv_bias_glu(x, w, b, 1, 1, 1, 8).key == key


def test_backend_is_asked_of_aten():
    """On the CPU aten picks a CPU backend; the name is what `torch._C._select_conv_backend`
    says, cached per geometry."""
    x, w, b = torch.randn(1, 4, 5, 5), torch.randn(4, 1, 3, 3), torch.randn(4)
    name = E.conv_backend(x, w, b, (1, 1), (1, 1), (1, 1), 4)
    assert name in torch._C._ConvBackend.__members__ and name not in E.SPLIT_BACKENDS
    assert E.conv_backend(x, w, b, (1, 1), (1, 1), (1, 1), 4) == name


# ---------------------------------------------------------------- kernels, interpreted (fp32)

SHAPES = [(1, 1, 1, 1), (2, 100, 3, 5), (2, 64, 1, 9), (1, 7, 13, 1), (2, 300, 2, 3)]
CONFIGS = [None, (2, 32, 4)]  # None: the default tiles; (2, 32, 4): masked tiles on both axes


@interpreter
@pytest.mark.parametrize("B,C,H,W", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels-last", "token-view", "channel-slice", "nchw-slice"])
def test_epilogues_fp32_poisoned_and_default_outputs(B, C, H, W, layout):
    g = torch.Generator().manual_seed(B * 1000 + C + H * 7 + W)
    y = _layout(torch.randn(B, C, H, W, generator=g) * 4, layout)
    b = torch.randn(C, generator=g)
    y2 = _layout(torch.randn(B, 2 * C, H, W, generator=g) * 4, layout)
    b2 = torch.randn(2 * C, generator=g)
    with cpu_kernels():
        silu, glu, glu_nobias = E.plan_bias_silu(y, b), E.plan_bias_glu(y2, b2), E.plan_bias_glu(y2, None)
    for config in CONFIGS:
        out = E.launch_epilogue(silu, config=config)
        assert same_bits(out, np_bias_silu(y, b)) and out.stride() == E.bias_silu_reference(y, b).stride()
        out = E.launch_epilogue(glu, config=config)
        assert same_bits(out, np_bias_glu(y2, b2)) and out.stride() == E.bias_glu_reference(y2, b2).stride()
        for plan, ref in ((silu, np_bias_silu(y, b)), (glu, np_bias_glu(y2, b2)), (glu_nobias, np_bias_glu(y2, None))):
            poisoned = torch.full(ref.shape, float("nan"))
            assert same_bits(E.launch_epilogue(plan, out=poisoned, config=config), ref), (layout, config)
            cl_out = torch.full(ref.shape, float("nan")).contiguous(memory_format=torch.channels_last)
            assert same_bits(E.launch_epilogue(plan, out=cl_out, config=config), ref), (layout, config)


@interpreter
def test_special_values_and_wide_indexing(monkeypatch):
    """inf, -inf, NaN, signed zeros and subnormals through the bias add and the SiLU;
    the same with int64 offsets forced."""
    vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 90.0, -90.0, 3.0])
    y = vals.repeat(2, 4, 1).reshape(2, 4, 5, 2).contiguous(memory_format=torch.channels_last)
    b = torch.tensor([0.0, -0.0, 1.0, float("nan")])
    y2 = torch.cat([y, y.flip(1)], 1).contiguous(memory_format=torch.channels_last)
    b2 = torch.cat([b, -b])
    for wide in (False, True):
        monkeypatch.setattr(E, "needs_int64", lambda *extents, wide=wide: wide)
        E._recipes.clear()
        with cpu_kernels():
            assert same_bits(E.launch_epilogue(E.plan_bias_silu(y, b)), np_bias_silu(y, b))
            assert same_bits(E.launch_epilogue(E.plan_bias_glu(y2, b2)), np_bias_glu(y2, b2))
    E._recipes.clear()


@interpreter
@pytest.mark.parametrize("layout", ["token-view", "contiguous"])
def test_conv_level_launch_runs_eagers_convolution(monkeypatch, layout):
    """launch_conv: the convolution without its bias (split) or with it (not split), then
    the epilogue; the result is the epilogue of exactly that convolution's output."""
    g = torch.Generator().manual_seed(3)
    x = _layout(torch.randn(2, 16, 4, 6, generator=g), layout)
    w1, b1 = torch.randn(80, 16, 1, 1, generator=g) / 4, torch.randn(80, generator=g)
    w2, b2 = torch.randn(80, 1, 3, 3, generator=g) / 3, torch.randn(80, generator=g)
    monkeypatch.setattr(E, "SPLIT_BACKENDS", frozenset({E.conv_backend(x, w1, b1, (1, 1), (0, 0), (1, 1), 1)}))
    with cpu_kernels():
        p1 = E.plan_conv_bias_silu(x, w1, b1, 1, 0, 1, 1)
        assert p1.split
        a = E.launch_conv(p1)
        assert same_bits(a, np_bias_silu(F.conv2d(x, w1, None), b1))
        assert a.stride() == F.conv2d(x, w1, b1).stride()
        p2 = E.plan_conv_bias_glu(a, w2, b2, 1, 1, 1, 80)
        out = E.launch_conv(p2)
        y = F.conv2d(a, w2, None if p2.split else b2, 1, 1, 1, 80)
        assert same_bits(out, np_bias_glu(y, b2 if p2.split else None))
        assert out.stride() == E.conv_bias_glu_reference(a, w2, b2, 1, 1, 1, 80).stride()


# ---------------------------------------------------------------- sites


def _glumbconv(dtype=torch.float32):
    from diffusers.models.transformers.sana_transformer import GLUMBConv

    torch.manual_seed(1)
    return GLUMBConv(16, 16, 2.5, norm_type=None, residual_connection=False).eval().to(dtype)


def test_sites_are_the_module_calls_on_cpu_and_under_compile(monkeypatch):
    ff = _glumbconv()
    x = torch.randn(2, 16, 3, 5)
    with torch.no_grad():
        a = ff.nonlinearity(ff.conv_inverted(x))
        h, g = torch.chunk(ff.conv_depth(a), 2, dim=1)
        b = h * ff.nonlinearity(g)
        assert same_bits(sites.conv_bias_silu_site(ff.conv_inverted, ff.nonlinearity, x), a)
        assert same_bits(sites.conv_bias_glu_site(ff.conv_depth, ff.nonlinearity, a), b)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(E, "plan_conv_bias_glu", None)  # would raise if the site planned
        assert same_bits(sites.conv_bias_glu_site(ff.conv_depth, ff.nonlinearity, a), b)


def test_sites_call_unrecognised_modules_as_they_are():
    """A subclass, a hook, a GELU, reflect padding: the modules are called as they are."""
    ff = _glumbconv()
    x = torch.randn(1, 16, 4, 4)
    calls = []

    class Conv(torch.nn.Conv2d):
        pass

    conv = Conv(16, 32, 1)
    hooked = torch.nn.Conv2d(16, 32, 1)
    hooked.register_forward_hook(lambda m, i, o: calls.append(1))
    reflect = torch.nn.Conv2d(16, 32, 3, padding=1, padding_mode="reflect")
    assert sites._conv_args(conv, ff.nonlinearity, x) is None
    assert sites._conv_args(hooked, ff.nonlinearity, x) is None
    assert sites._conv_args(reflect, ff.nonlinearity, x) is None
    assert sites._conv_args(ff.conv_inverted, torch.nn.GELU(), x) is None
    assert sites._conv_args(torch.nn.Conv2d(16, 32, 3, padding="same"), ff.nonlinearity, x) is None
    args = sites._conv_args(ff.conv_depth, ff.nonlinearity, x)
    assert args[1] is ff.conv_depth.weight and args[3:] == ((1, 1), (1, 1), (1, 1), 80)
    with torch.no_grad():
        out = sites.conv_bias_glu_site(hooked, ff.nonlinearity, x)
        h, g = torch.chunk(hooked(x), 2, dim=1)
    assert calls == [1, 1] and same_bits(out, h * F.silu(g))


@interpreter
def test_glu_site_gates_the_kernel_on_cpu(monkeypatch):
    """fp32 under the interpreter: the GLU site plans (the CPU convolution keeps its bias:
    the kernel fuses the chunk, SiLU and product), the gate compares with eager at first
    sight; whatever the verdict (numpy's exp against torch's CPU silu), the output is
    eager's, and a verdict for the conv-level op is recorded."""
    ff = _glumbconv()
    x = _layout(torch.randn(2, 80, 4, 4), "token-view")
    monkeypatch.setattr(params_module, "INTERPRET_ON_CPU", True)
    with torch.no_grad():
        h, g = torch.chunk(ff.conv_depth(x), 2, dim=1)
        ref = h * ff.nonlinearity(g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", policy.FallbackWarning)
            out = sites.conv_bias_glu_site(ff.conv_depth, ff.nonlinearity, x)
            again = sites.conv_bias_glu_site(ff.conv_depth, ff.nonlinearity, x)
    assert same_bits(out, ref) and same_bits(again, ref)
    verdicts = [v for v in policy.verdicts() if v.op == "conv_bias_glu"]
    assert len(verdicts) == 1 and "bias in conv" in verdicts[0].signature


# ---------------------------------------------------------------- the SiLU's form, checked whole


def test_silu_form_is_aten_s_on_the_cpu_and_for_fp32():
    E._FORMS.clear()
    assert E.silu_form("cpu", torch.bfloat16, False) == 0
    assert E.silu_form("cpu", torch.float32, True) == 0
    assert E._FORMS == {(-1, torch.bfloat16, False): 0, (-1, torch.float32, True): 0}
    E._FORMS.clear()


def test_every_input_is_every_16_bit_pattern():
    for dtype in E.DOMAIN:
        bits = E.every_input(dtype, "cpu").view(torch.int16)
        assert bits.numel() == 65536 and torch.unique(bits).numel() == 65536


@pytest.mark.parametrize("glu", [False, True])
def test_silu_form_takes_the_first_form_equal_on_every_input(monkeypatch, glu):
    """The check's logic with a stand-in device (CPU tensors) and stand-in kernels: each
    form's output is eager's SiLU except where a test breaks one element; the first form
    of FAST_FORMS equal on all 65,536 inputs is kept, none equal gives 0 (kept), and a
    check that can't run now gives 0, not kept; the check runs its kernels in place,
    even inside a deferring() block."""
    monkeypatch.setattr(E, "device_index", lambda device: 0)
    monkeypatch.setattr(E, "INTERPRET", False)
    monkeypatch.setattr(E, "HAS_TRITON", True)
    monkeypatch.setattr(E, "libdevice", object())
    monkeypatch.setattr(E, "every_input", lambda dtype, device: torch.arange(
        -32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype))
    broken, allowed, raising = set(), [True], set()
    seen = []

    def fake_epilogue(y, bias, glu_, out, form):
        seen.append((tuple(y.shape), form, bias.signbit().all().item()))
        if form in raising:
            raise RuntimeError("CompilationError")
        assert _launch._defer.get() is None  # synchronous, even inside deferring()
        assert glu_ is glu and bias.eq(0).all()
        if glu:
            hidden, gate = torch.chunk(y + bias.reshape(1, -1, 1, 1), 2, dim=1)
            out.copy_(hidden * F.silu(gate))
        else:
            out.copy_(F.silu(y + bias.reshape(1, -1, 1, 1)))
        if form in broken:
            out.view(-1)[12345] = 0.5
        return out

    monkeypatch.setattr(E, "_epilogue", fake_epilogue)
    monkeypatch.setattr(E, "probe_allowed", lambda index: allowed[0])
    dtype = torch.bfloat16
    key = (0, dtype, glu)
    try:
        E._FORMS.clear()
        assert E.silu_form("cuda", dtype, glu) == E.FAST_FORMS[0]
        assert E._FORMS[key] == E.FAST_FORMS[0]
        E._FORMS.clear()
        with _launch.deferring():
            assert E.silu_form("cuda", dtype, glu) == E.FAST_FORMS[0]
        assert seen[0] == ((1, 2 if glu else 1, 256, 256), E.FAST_FORMS[0], True)  # bias -0.0
        E._FORMS.clear()
        broken.add(E.FAST_FORMS[0])
        assert E.silu_form("cuda", dtype, glu) == E.FAST_FORMS[1]
        E._FORMS.clear()
        broken.update(E.FAST_FORMS)
        assert E.silu_form("cuda", dtype, glu) == 0 and E._FORMS[key] == 0
        E._FORMS.clear()
        broken.clear()
        allowed[0] = False
        assert E.silu_form("cuda", dtype, glu) == 0 and key not in E._FORMS
        allowed[0] = True
        assert E.silu_form("cuda", dtype, glu) == E.FAST_FORMS[0]
        E._FORMS.clear()
        raising.add(E.FAST_FORMS[0])  # a form whose kernel fails to compile: passed over, no crash
        assert E.silu_form("cuda", dtype, glu) == E.FAST_FORMS[1]
    finally:
        E._FORMS.clear()


# ---------------------------------------------------------------- the depthwise convolution fused


def _taps_fp32(x, w):
    """The 3x3 depthwise convolution (padding 1) summed tap by tap in row-major order in
    fp32, each tap by an FMA (its product exact in float64, the sum rounded to fp32)."""
    B, C, H, W = x.shape
    xp = F.pad(x, (1, 1, 1, 1)).double()
    acc = torch.zeros(B, C, H, W)
    for kh in range(3):
        for kw in range(3):
            acc = (acc.double() + xp[:, :, kh:kh + H, kw:kw + W] * w[:, 0, kh, kw].double()[None, :, None, None]).float()
    return acc


@interpreter
@pytest.mark.parametrize("shape, config", [
    ((2, 12, 5, 7), None),  # the default shape: fewer rows and pixels than a program's
    ((1, 130, 3, 4), None),  # two channel blocks, the second cut short
    ((3, 4, 1, 9), None),  # one row (its neighbours all padding); two pixel blocks
    ((2, 12, 9, 7), (4, 4, 2, 1, 2)),  # row blocks of 2 over 9 rows: each block's halo rows
    ((1, 6, 17, 3), (2, 4, 5, 1, 4)),  # 5-row blocks over 17; 4 channels a thread, 3 of them real
    ((2, 10, 6, 5), (8, 2, 4, 1, 1)),  # one channel a thread
], ids=str)
def test_fused_depthwise_indexing(shape, config):
    """`depthwise_glu` under the interpreter (fp32): every output pixel's nine taps, the
    image's edges (zero padding), the row blocks a program walks and the input rows they
    share, pixel and channel blocks cut short, both halves of the channels, the bias and
    the GLU; into eager's strides and into a poisoned `out`."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(shape[1], 1, 3, 3, generator=g), torch.randn(shape[1], generator=g)
    ref = np_bias_glu(_taps_fp32(x, w), b)
    with cpu_kernels():
        E._FORMS.setdefault((-1, torch.float32, True), 0)
        out = E.depthwise_glu(x, w, b, config=config)
        assert same_bits(out, ref)
        assert out.stride() == E.conv_bias_glu_reference(x, w, b, 1, 1, 1, shape[1]).stride()
        poisoned = torch.full_like(ref, float("nan"))
        assert same_bits(E.depthwise_glu(x, w, b, out=poisoned, config=config), ref)


def test_the_depthwise_convolution_fuses_only_its_own_case(monkeypatch):
    """The planner fuses the convolution into the GLU kernel only for a 16-bit 3x3
    depthwise convolution, stride 1, padding 1, channels-last, on a backend that adds the
    bias apart (the signature says so); anything else keeps eager's convolution."""
    monkeypatch.setattr(E, "conv_backend", lambda *a: "Cudnn")
    x = torch.randn(2, 8, 5, 5).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(8, 1, 3, 3).to(torch.bfloat16), torch.randn(8).to(torch.bfloat16)
    with cpu_kernels():
        plan = E.plan_conv_bias_glu(x, w, b, 1, 1, 1, 8)
        assert plan.fused and plan.key[-1] == "convolution fused"
        for args in ((x.contiguous(), w, b, 1, 1, 1, 8), (x.float(), w.float(), b.float(), 1, 1, 1, 8),
                     (x, w, b, 2, 1, 1, 8), (x, w, b, 1, 2, 2, 8), (x, w[:, :, :2], b, 1, 1, 1, 8),
                     (x[:, :4], w[:4], b[:4], 1, 1, 1, 4)):
            plan = E.plan_conv_bias_glu(*args)
            assert plan.__class__ is str or not plan.fused, plan.key
        monkeypatch.setattr(E, "DEPTHWISE", False)
        assert not E.plan_conv_bias_glu(x, w, b, 1, 1, 1, 8).fused
