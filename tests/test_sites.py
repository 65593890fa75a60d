"""Site dispatch, tier resolution, mounting, and bad input (CPU)."""

import dataclasses
import os
import threading
import warnings

import pytest
import torch

import bitfuse
from bitfuse import policy, sites
from bitfuse.numerics import same_bits
from bitfuse.ops import (
    _params,
    gated_residual,
    layer_norm_modulate,
    modulate,
    rms_norm_modulate,
)
from bitfuse.ops._launch import HAS_TRITON
from bitfuse.ops.rotary import rotary_reference


class FakePlan:
    def __init__(self, args, tier="lossless"):
        self.args = args
        self.key = (torch.float32, 0, "fake", tier)


@pytest.fixture
def fake_kernels(monkeypatch):
    """Every op eligible, its "kernel" eager's own expression; records (op, tier, thread)."""
    calls = []

    def fake(spec):
        def launch_for(tier):
            def run(plan, out=None):
                calls.append((spec.name, tier, threading.get_ident()))
                value = spec.reference(*plan.args)
                return value if out is None else out.copy_(value)

            return run

        def bind_for(tier):
            def bind(plan):  # the bound launch a verified call keeps (sites key it under torch.no_grad)
                def run(*args):
                    calls.append((spec.name, tier, threading.get_ident()))
                    return spec.reference(*args)

                return run

            return bind

        tiers = ("lossless", "high")
        return dataclasses.replace(spec, launch={t: launch_for(t) for t in tiers},
                                   bind={t: bind_for(t) for t in tiers if t in spec.bind}, reference64=None)

    monkeypatch.setattr(modulate, "plan_modulate", lambda *a, tier="lossless": FakePlan(a))
    monkeypatch.setattr(gated_residual, "plan_gated_residual", lambda *a, tier="lossless": FakePlan(a))
    monkeypatch.setattr(rms_norm_modulate, "plan_rms_norm_modulate", lambda *a, tier="lossless": FakePlan(a, tier))
    monkeypatch.setattr(rms_norm_modulate, "plan_rms_norm", lambda *a, tier="lossless": FakePlan(a))
    monkeypatch.setattr(layer_norm_modulate, "plan_layer_norm_modulate", lambda *a, tier="lossless": FakePlan(a, tier))
    monkeypatch.setattr(sites, "_MODULATE", fake(sites._MODULATE))
    monkeypatch.setattr(sites, "_GATED_RESIDUAL", fake(sites._GATED_RESIDUAL))
    monkeypatch.setattr(sites, "_RMS_NORM", fake(sites._RMS_NORM))
    monkeypatch.setattr(sites, "_LAYER_NORM_MODULATE", fake(sites._LAYER_NORM_MODULATE))
    monkeypatch.setattr(sites, "_RMS_NORM_MODULATE", {k: fake(v) for k, v in sites._RMS_NORM_MODULATE.items()})
    return calls


def _collapsed(calls):
    """(op, tier) of the calls, repeats in a row folded: first sight launches twice."""
    pairs = [c[:2] for c in calls]
    return [c for i, c in enumerate(pairs) if i == 0 or pairs[i - 1] != c]


def _operands(D=8):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, D, generator=g)
    scale, shift, gate = torch.randn(2, 1, 3, D, generator=g).unbind(2)
    return x, scale, shift, gate


def test_pointwise_sites_use_the_gated_lossless_kernel_in_every_tier(fake_kernels):
    x, scale, shift, gate = _operands()
    assert same_bits(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
    assert same_bits(sites.gated_residual_site(x, x, gate), x + x * gate)
    with bitfuse.quality("high"):
        sites.modulate_site(x, scale, shift)
        sites.gated_residual_site(x, x, gate)
    assert _collapsed(fake_kernels) == [("modulate", "lossless"), ("gated_residual", "lossless")] * 2
    assert {(v.op, v.tier, v.status) for v in bitfuse.verdicts()} == {
        ("modulate", "lossless", "verified"), ("gated_residual", "lossless", "verified")}


def test_sites_emit_the_plain_expression_while_compiling(fake_kernels, monkeypatch):
    x, scale, shift, gate = _operands()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(modulate, "plan_modulate", lambda *a: pytest.fail("planned a kernel while compiling"))
    assert same_bits(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
    assert fake_kernels == []


def test_sites_emit_the_plain_expression_under_autocast(fake_kernels, monkeypatch):
    """autocast changes eager's computation (here the convolution runs in bf16 on fp32
    operands): every site takes the plain expression inside it, and eager's result."""
    from bitfuse.ops import conv_epilogue

    x, scale, shift, gate = _operands()
    conv, act = torch.nn.Conv2d(8, 16, 1), torch.nn.SiLU()
    image = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    norm = torch.nn.LayerNorm(8, elementwise_affine=False)
    for module, name in ((conv_epilogue, "plan_conv_bias_silu"), (layer_norm_modulate, "plan_layer_norm_modulate")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("planned a kernel under autocast"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = sites.conv_bias_silu_site(conv, act, image)
        assert out.dtype is torch.bfloat16 and same_bits(out, act(conv(image)))
        assert same_bits(sites.layer_norm_modulate_site(None, norm, x, scale, shift), norm(x) * (1 + scale) + shift)
        assert same_bits(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
        assert same_bits(sites.gated_residual_site(x, x, gate), x + x * gate)
    assert fake_kernels == []


def test_disable_flag_forces_eager(fake_kernels, monkeypatch):
    monkeypatch.setattr(policy, "DISABLED", True)
    x, scale, shift, gate = _operands()
    sites.modulate_site(x, scale, shift)
    sites.gated_residual_site(x, x, gate)
    assert fake_kernels == []


def test_torch_compile_fullgraph_traces_sites_as_plain_ops():
    x, scale, shift, gate = _operands()

    def block(x, scale, shift, gate):
        h = sites.modulate_site(x, scale, shift)
        return sites.gated_residual_site(x, h, gate)

    compiled = torch.compile(block, fullgraph=True, backend="eager")
    assert same_bits(compiled(x, scale, shift, gate), x + (x * (1 + scale) + shift) * gate)


class Block(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm


class Model(torch.nn.Module):
    def __init__(self, norms):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(n) for n in norms)
        for i, b in enumerate(self.blocks):
            sites.mark_site(b, f"blocks.{i}", norms=(b.norm,))


def test_mount_is_all_or_nothing():
    good = torch.nn.LayerNorm(8, elementwise_affine=False)
    affine = torch.nn.LayerNorm(8)  # no one-pass kernel for an affine norm
    model = Model([good, affine, good])
    with pytest.raises(sites.MountError, match="blocks.1: no one-pass kernel for LayerNorm"):
        bitfuse.mount(model, "high")
    assert all(s.tier is None for s in sites.sites_of(model))  # none mounted

    model = Model([good, torch.nn.RMSNorm(8, elementwise_affine=False, eps=1e-6)])
    bitfuse.mount(model, "high")
    assert [s.tier for s in sites.sites_of(model)] == ["high", "high"]
    bitfuse.unmount(model)
    assert [s.tier for s in sites.sites_of(model)] == [None, None]
    with pytest.raises(sites.MountError, match="no bitfuse sites"):
        bitfuse.mount(torch.nn.Linear(2, 2), "high")


def test_tier_resolution_request_over_mount_over_default(fake_kernels):
    x, scale, shift = (t.bfloat16() for t in _operands()[:3])  # fp32 norm sites stay lossless in every tier
    norm = torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
    block = Block(norm)
    site = sites.mark_site(block, "b", norms=(norm,))
    sites.rms_norm_modulate_site(block, norm, x, scale, shift)
    site.tier = "high"
    sites.rms_norm_modulate_site(block, norm, x, scale, shift)
    with bitfuse.quality("lossless"):
        sites.rms_norm_modulate_site(block, norm, x, scale, shift)
    assert [t for _, t in _collapsed(fake_kernels)] == ["lossless", "high", "lossless"]


def test_concurrent_requests_get_their_own_tier(fake_kernels):
    """Two threads on one mounted block, one asking for high, one for lossless, inside
    the same window: each thread's kernels ran at its own tier, never the other's."""
    x, scale, shift = (t.bfloat16() for t in _operands()[:3])
    norm = torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
    block = Block(norm)
    sites.mark_site(block, "b", norms=(norm,)).tier = "lossless"
    barrier = threading.Barrier(2)
    threads, errors = {}, []

    def request(tier):
        try:
            with bitfuse.quality(tier), torch.no_grad():
                for _ in range(20):
                    barrier.wait()
                    sites.rms_norm_modulate_site(block, norm, x, scale, shift)
        except BaseException as exc:  # reported on the main thread below
            errors.append(exc)

    for tier in ("high", "lossless"):
        t = threading.Thread(target=request, args=(tier,))
        t.start()
        threads[t.ident] = (t, tier)
    for t, _ in threads.values():
        t.join()
    assert errors == []
    for ident, (_, tier) in threads.items():
        seen = {t for op, t, who in fake_kernels if who == ident}
        assert seen == {tier}, (tier, seen)


def test_fp32_norm_sites_take_the_lossless_kernel_in_every_tier(fake_kernels):
    x, scale, shift, _ = _operands()
    norm = torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
    with bitfuse.quality("high"), torch.no_grad():
        sites.rms_norm_modulate_site(None, norm, x, scale, shift)
    assert {t for _, t, _ in fake_kernels} == {"lossless"}


def test_norm_kinds():
    from diffusers.models.normalization import FP32LayerNorm, RMSNorm

    assert sites.norm_kind(RMSNorm(8, eps=1e-6, elementwise_affine=False)) == "diffusers"
    assert sites.norm_kind(RMSNorm(8, eps=1e-6, elementwise_affine=True)) is None
    assert sites.norm_kind(torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)) == "aten"
    assert sites.norm_kind(torch.nn.LayerNorm(8, elementwise_affine=False)) == "layer_norm"
    assert sites.norm_kind(torch.nn.LayerNorm(8)) is None
    assert sites.norm_kind(FP32LayerNorm(8, elementwise_affine=False)) is None  # a subclass computes otherwise
    assert sites.norm_kind(torch.nn.Identity()) is None
    hooked = torch.nn.LayerNorm(8, elementwise_affine=False)
    hooked.register_forward_hook(lambda *a: None)  # a fused kernel would skip the hook
    assert sites.norm_kind(hooked) is None


interpreter = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter (CPU runs)"
)


@interpreter
@pytest.mark.parametrize("tier", ["lossless", "high"])
def test_sites_run_the_real_kernels_through_the_gate_on_cpu(tier, monkeypatch):
    """The real dispatch, planners, kernels and gate under Triton's interpreter (fp32):
    pointwise and RoPE kernels are verified and bitwise eager's. Norm sites return
    eager's bits too, whatever the verdict: their kernels reproduce CUDA's reduction
    order, not the CPU's (test_norm_ops_cpu checks that order), and a mismatch falls
    back to eager."""
    from diffusers.models.normalization import RMSNorm

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    x, scale, shift, gate = _operands(D=256)
    freqs = (torch.rand(1, 5, 256), torch.rand(1, 5, 256))
    with bitfuse.quality(tier), torch.no_grad():
        assert policy.same_bits(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
        assert policy.same_bits(sites.gated_residual_site(x, x, gate), x + x * gate)
        q, k = sites.rotary_site(x, x * 2, freqs, None, "interleaved")
        assert policy.same_bits(q, rotary_reference(x, freqs)) and policy.same_bits(k, rotary_reference(x * 2, freqs))
        assert {(v.op, v.status) for v in policy.verdicts()} == {
            ("modulate", "verified"), ("gated_residual", "verified"), ("rotary[interleaved]", "verified")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", policy.FallbackWarning)
            for norm in (RMSNorm(256, eps=1e-6, elementwise_affine=False),
                         torch.nn.RMSNorm(256, eps=1e-6, elementwise_affine=False),
                         torch.nn.LayerNorm(256, elementwise_affine=False, eps=1e-6)):
                site = (sites.layer_norm_modulate_site if isinstance(norm, torch.nn.LayerNorm)
                        else sites.rms_norm_modulate_site)
                assert policy.same_bits(site(None, norm, x, scale, shift), norm(x) * (1 + scale) + shift)
    assert {v.op for v in policy.verdicts()} >= {"rms_norm_modulate[diffusers]", "rms_norm_modulate[aten]",
                                                   "layer_norm_modulate"}


def test_rms_norm_site_is_lossless_in_every_tier(fake_kernels, monkeypatch):
    """The norm alone (a2v/v2a): the lossless kernel in every tier, plain while compiling,
    the module itself for norms it does not reproduce."""
    from diffusers.models.normalization import RMSNorm

    x = _operands()[0]
    norm = RMSNorm(8, eps=1e-6, elementwise_affine=False)
    for tier in ("lossless", "high"):
        with bitfuse.quality(tier), torch.no_grad():
            assert same_bits(sites.rms_norm_site(norm, x), norm(x))
    assert _collapsed(fake_kernels) == [("rms_norm", "lossless")]
    affine = RMSNorm(8, eps=1e-6, elementwise_affine=True)
    with torch.no_grad():
        assert same_bits(sites.rms_norm_site(affine, x), affine(x))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        assert same_bits(sites.rms_norm_site(norm, x), norm(x))
    assert len(fake_kernels) == 3  # two first-sight launches, one for the second call, none for the others


def test_rotary_site_rejects_a_tensor_for_the_frequencies():
    q = torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match=r"query_freqs must be a \(cos, sin\) pair of tensors, got Tensor"):
        sites.rotary_site(q, q, torch.randn(2, 1, 4, 8), None, "interleaved")
    with pytest.raises(ValueError, match="unknown rope_type"):
        sites.rotary_site(q, q, (torch.ones(1, 4, 8), torch.zeros(1, 4, 8)), None, "spiral")


# ---------------------------------------------------------------- bad input


def _eager_or_error(fn, *args):
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - comparing with whatever eager raises
        return None, exc


BAD = {
    "cpu bf16": lambda: (torch.randn(2, 3, 8).bfloat16(), torch.randn(2, 1, 8).bfloat16(), torch.randn(8).bfloat16()),
    "mixed dtypes": lambda: (torch.randn(2, 3, 8).bfloat16(), torch.randn(2, 1, 8), torch.randn(8).half()),
    "int dtype": lambda: (torch.randint(0, 5, (2, 3, 8)), torch.randint(0, 5, (8,)), torch.randint(0, 5, (8,))),
    "no broadcast": lambda: (torch.randn(2, 3, 8), torch.randn(3, 1, 8), torch.randn(8)),
    "larger params": lambda: (torch.randn(1, 3, 8), torch.randn(2, 3, 8), torch.randn(8)),
    "empty": lambda: (torch.randn(2, 0, 8), torch.randn(2, 1, 8), torch.randn(8)),
    "4-D": lambda: (torch.randn(2, 2, 3, 8), torch.randn(8), torch.randn(8)),
    "nonfinite": lambda: (torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.0]]),
                          torch.tensor([0.5, -1.0, 2.0, float("nan")]), torch.ones(4)),
    "python scalar": lambda: (torch.randn(2, 3, 8), 0.5, torch.randn(8)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_eager_result_or_eager_error(case):
    x, a, b = BAD[case]()
    for site, ref in ((sites.modulate_site, lambda x, a, b: x * (1 + a) + b),
                      (sites.gated_residual_site, lambda x, a, b: x + x * a)):
        args = (x, a, b) if site is sites.modulate_site else (x, x, a)
        want, want_exc = _eager_or_error(ref, x, a, b)
        got, got_exc = _eager_or_error(site, *args)
        if want_exc is not None:
            assert type(got_exc) is type(want_exc), (case, got_exc, want_exc)
        else:
            assert got_exc is None, got_exc
            assert policy.same_bits(got, want)
    assert bitfuse.verdicts() == []  # nothing on the CPU reaches the gate


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter (CPU runs)")
def test_a_permuted_x_keeps_eagers_layout(monkeypatch):
    """Eager's `x + y * gate` is laid out as x; the kernel writes row-major. A permuted
    x (Sana's first block: the patch embedding's transposed view, whose residual the
    cross-attention's to_q GEMM reads) takes eager, so the result keeps eager's layout;
    a row-major x takes the kernel whatever y's layout."""
    from bitfuse.ops import _params

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    policy.reset_verdicts()
    B, S, D = 2, 5, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, D, S, generator=g).transpose(1, 2)  # [B, S, D], permuted
    y = torch.randn(B, S, D, generator=g)
    gate = torch.randn(B, 6, D, generator=g).chunk(6, dim=1)[2]
    eager = x + y * gate
    assert eager.stride() == x.stride() != y.stride()
    for _ in range(2):
        out = sites.gated_residual_site(x, y, gate)
        assert same_bits(out, eager) and out.stride() == eager.stride() and policy.verdicts() == []
    for _ in range(2):
        out = sites.gated_residual_site(y, x, gate)  # y's layout does not decide eager's
        assert same_bits(out, y + x * gate) and out.is_contiguous()
    assert [v.status for v in policy.verdicts()] == ["verified"]


# ---------------------------------------------------------------- a layer's bias left to its consumer


def _linear(K=12, N=10, dtype=torch.float32):
    torch.manual_seed(3)
    return torch.nn.Linear(K, N).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_bias_split_is_the_layers_output(monkeypatch, dtype):
    """`linear_bias_split` on an x aten's `linear` multiplies and then adds the bias to
    (3-D, not contiguous: the linear attention's transposed output): Folded(bias,
    matmul), whose value is the layer's output bit for bit, checked once per geometry
    (a verdict); a contiguous or 2-D x, autograd, hooks, no bias: the layer's own call."""
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    lin = _linear(dtype=dtype)
    x = torch.randn(2, 12, 7, dtype=dtype).transpose(1, 2)  # [2, 7, 12], strides (84, 1, 7)
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    with torch.no_grad():
        out = sites.linear_bias_split(lin, x)
        assert out.__class__ is sites.Folded and out.table is lin.bias
        assert same_bits(out.value(), lin(x)) and out.value().stride() == lin(x).stride()
        assert [(v.op, v.status) for v in bitfuse.verdicts()] == [("linear_bias_split", "verified")]
        for other in (x.contiguous(), x[0]):
            got = sites.linear_bias_split(lin, other)
            assert got.__class__ is torch.Tensor and same_bits(got, lin(other))
        handle = lin.register_forward_hook(lambda m, a, o: o * 2)
        try:
            assert same_bits(sites.linear_bias_split(lin, x), lin(x))  # the hook's doubling, as the call gives
        finally:
            handle.remove()
        nobias = torch.nn.Linear(12, 10, bias=False).to(dtype)
        assert sites.linear_bias_split(nobias, x).__class__ is torch.Tensor
    got = sites.linear_bias_split(lin, x)  # autograd recording: the layer's call
    assert got.__class__ is torch.Tensor and got.requires_grad


def test_linear_bias_split_falls_back_where_the_fact_fails(monkeypatch):
    """A build whose `linear` does not add the bias as its own op (here: a matmul that
    rounds otherwise) gets the layer's own call, with one warning, for good."""
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    lin = _linear()
    x = torch.randn(2, 12, 7).transpose(1, 2)
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: real(a, b) * (1 + 2 ** -20))
    with torch.no_grad():
        with pytest.warns(policy.FallbackWarning, match="linear_bias_split.*differ from the layer's own call"):
            out = sites.linear_bias_split(lin, x)
        assert out.__class__ is torch.Tensor and same_bits(out, torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert sites.linear_bias_split(lin, x).__class__ is torch.Tensor


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter (CPU runs)")
@pytest.mark.parametrize("data", ["randn", "special", "zeros"])
@pytest.mark.parametrize("strided", [False, True])
def test_gated_residual_adds_a_folded_ys_bias_as_eager(monkeypatch, data, strided):
    """The gated residual with y = Folded(bias row, output) (a layer's bias eager adds as
    its own op): the kernel's add of the bias, rounded to the dtype, then eager's
    product and sum, bitwise against `x + (output + bias) * gate`, into a poisoned
    output, with a Folded gate too; its bound launch on new operands the same."""
    from bitfuse.ops import cases

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    for layout in ("per-sample", "folded"):
        case = cases.Case(2, 7, 40, torch.float32, layout, data, seed=5, device="cpu", strided=strided)
        x, y, gate = gated_residual.SPEC.make_args(case)
        bias = cases.draw((40,), torch.float32, data, torch.Generator().manual_seed(9), "cpu")
        fy = sites.Folded(bias, y)
        plan = gated_residual.plan_gated_residual(x, fy, gate)
        assert not isinstance(plan, str), plan
        assert plan.key[-1] == "y+bias"
        ref = x + (y + bias) * _params.value(gate)
        out = gated_residual.launch_gated_residual(plan, out=torch.full_like(ref, float("nan")))
        assert same_bits(out, ref), layout
        x2, y2, gate2 = gated_residual.SPEC.make_args(dataclasses.replace(case, seed=6))
        again = gated_residual.bind_gated_residual(plan)(x2, sites.Folded(bias * 2, y2), gate2)
        assert same_bits(again, x2 + (y2 + bias * 2) * _params.value(gate2)), layout
