"""Bound launches (`OpSpec.bind`, `policy.bound`): a verified call's launch kept under
its site's call key, so that later calls with the same metadata skip the planner and
the gate. On the CPU, under Triton's interpreter: the kernels' indexing and the
dispatch (bf16 exactness is the GPU tests' and the fuzz run's)."""

import dataclasses
import warnings

import pytest
import torch

import bitfuse
from bitfuse import policy, sites
from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, _params, cases, conv_epilogue, gated_residual, layer_norm_modulate, modulate, qk_norm_rope
from interpreted import interpreter



@pytest.fixture
def cpu_kernels(monkeypatch):
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)


def _bound_cases():
    for spec in SPECS.values():
        for tier in spec.bind:
            for layout in spec.layouts:
                if spec.name.startswith("conv_") and layout != "channels-last":
                    continue  # (the contiguous layout is the same convolution; kept short)
                yield pytest.param(spec, tier, layout, id=f"{spec.name}-{tier}-{layout}")


def _width(spec, monkeypatch) -> int:
    """The case width for `spec` on the CPU, its probes answered as a GPU could answer them."""
    if spec.name.startswith("conv_"):  # on the CPU aten adds the bias inside; split it as cuDNN would
        monkeypatch.setattr(conv_epilogue, "conv_backend", lambda *a: "Cudnn")
    if spec.name == "qk_norm_rope":  # heads of 128; the diffusers mean of 128-wide rows: one of the probe's answers
        monkeypatch.setitem(qk_norm_rope._MEAN_128, -1, (True, False))
        return 256
    return 264


def _leaves(obj) -> list:
    """The tensors in nested arguments (Folded parameters' two included)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, _params.Folded):
        return [obj.table, obj.temb]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _leaves(o)]
    return []


@interpreter
@pytest.mark.parametrize("spec, tier, layout", list(_bound_cases()))
def test_a_bound_launch_is_the_planned_launch_on_new_operands(spec, tier, layout, cpu_kernels, monkeypatch):
    """Bound to one call's plan, the launch run on fresh operands of the same metadata
    (other values, other storage) writes what the planner's launch for them writes: the
    same bits and the same strides, Folded parameters and strided views included."""
    case = cases.Case(2, 6, _width(spec, monkeypatch), torch.float32, layout, "special", seed=1, device="cpu", strided=layout == "per-token")
    first, later = spec.make_args(case), spec.make_args(dataclasses.replace(case, seed=2, data="zeros"))
    plan = spec.plan(*first, tier=tier)
    assert plan.__class__ is not str, plan
    run = spec.bind[tier](plan)
    with torch.no_grad():
        out = run(*later)
        planned = spec.plan(*later, tier=tier)
        assert planned.key == plan.key
        ref = spec.launch[tier](planned)
    assert out is not None
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert same_bits(o, r) and o.stride() == r.stride()


@interpreter
def test_a_bound_layer_norm_declines_an_x_its_guard_would_refuse(cpu_kernels):
    """The lossless LayerNorm guard sends a contiguous x that is not 4-element aligned to
    eager (aten takes another kernel there); its bound launch declines such an x (None:
    the site then asks the planner) rather than launching."""
    x = torch.randn(2, 6, 40)
    scale, shift = torch.randn(2, 1, 40), torch.randn(2, 1, 40)
    run = layer_norm_modulate.bind_layer_norm_modulate(layer_norm_modulate.plan_layer_norm_modulate(x, scale, shift, 1e-6))
    shifted = torch.randn(2 * 6 * 40 + 1)[1:].view(2, 6, 40)  # contiguous, 4 bytes off the alignment
    assert isinstance(layer_norm_modulate.plan_layer_norm_modulate(shifted, scale, shift, 1e-6), str)
    assert run(shifted, scale, shift, 1e-6) is None
    assert run(x.clone(), scale, shift, 1e-6) is not None


@interpreter
def test_bound_aten_norms_decline_what_their_guards_refuse(cpu_kernels):
    """The same for the query/key norm + RoPE and the norm-only kernels with aten's
    RMSNorm: a contiguous x (or a weight) off the 4-element alignment is refused by the
    planner, and the bound launch declines it."""
    from bitfuse.ops import rms_norm_modulate

    def off(shape):  # contiguous, 4 bytes off the alignment
        return torch.randn(torch.Size(shape).numel() + 1)[1:].view(shape)

    q, k, w = torch.randn(2, 6, 64), torch.randn(2, 6, 64), (torch.rand(64) + 0.5, torch.rand(64) + 0.5)
    args = ((q,), (k,), (w,), 1e-6, None, None, "aten")
    run = qk_norm_rope.bind_qk_norm_rope(qk_norm_rope.plan_qk_norm_rope(*args))
    for bad in (((off(q.shape),), (k,), (w,)), ((q,), (k,), ((w[0], off((64,))),))):
        assert isinstance(qk_norm_rope.plan_qk_norm_rope(*bad, *args[3:]), str)
        assert run(*bad, *args[3:]) is None
    assert run((q.clone(),), (k.clone(),), (w,), *args[3:]) is not None
    run = rms_norm_modulate.bind_rms_norm(rms_norm_modulate.plan_rms_norm(q, 1e-6, "aten"))
    assert isinstance(rms_norm_modulate.plan_rms_norm(off(q.shape), 1e-6, "aten"), str)
    assert run(off(q.shape), 1e-6, "aten") is None
    assert run(q.clone(), 1e-6, "aten") is not None


def _planner_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(module, name, counted)
    return calls


def _operands(seed=0, D=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, D, generator=g)
    scale, shift, gate = torch.randn(2, 1, 3, D, generator=g).unbind(2)
    return x, scale, shift, gate


@interpreter
def test_sites_keep_a_verified_launch_and_skip_the_planner(cpu_kernels, monkeypatch):
    """First sight verifies, the next call binds, every later call with the same metadata
    takes the bound launch (no planner) with eager's bits; other strides, another dtype or
    autograd recording take the planner."""
    planned = _planner_calls(monkeypatch, modulate, "plan_modulate")
    with torch.no_grad():
        for seed in range(4):
            x, scale, shift, _ = _operands(seed)
            assert same_bits(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
        assert len(planned) == 2  # first sight, then the call that bound the launch
        x, scale, shift, _ = _operands(9)
        sites.modulate_site(x, scale.contiguous(), shift)  # other strides: another key
        sites.modulate_site(x.double(), scale.double(), shift.double())  # another dtype (eager: no kernel)
        assert len(planned) == 4
    sites.modulate_site(x, scale, shift)  # autograd on: never keyed
    sites.modulate_site(x, scale, shift)
    assert len(planned) == 6


@interpreter
def test_folded_and_tensor_parameters_do_not_share_a_key(cpu_kernels, monkeypatch):
    """A Folded gate and a tensor gate of the same shape are different calls: each its own key."""
    planned = _planner_calls(monkeypatch, gated_residual, "plan_gated_residual")
    x, _, _, gate = _operands()
    folded = _params.Folded(torch.randn(48), torch.randn(2, 1, 48))
    with torch.no_grad():
        for _ in range(3):
            assert same_bits(sites.gated_residual_site(x, x, gate), x + x * gate)
            assert same_bits(sites.gated_residual_site(x, x, folded), x + x * folded.value())
    assert len(planned) == 4


@interpreter
def test_a_fallback_anywhere_drops_the_bound_launches(cpu_kernels, monkeypatch):
    """A mismatch or an error recorded anywhere (here another op's), reset_verdicts and
    reload_env each drop every bound launch: the next call asks the planner again. Another
    signature's verification leaves them."""
    planned = _planner_calls(monkeypatch, modulate, "plan_modulate")
    x, scale, shift, _ = _operands()

    def call():
        with torch.no_grad():
            sites.modulate_site(x, scale, shift)

    call(), call(), call()
    assert len(planned) == 2
    policy._record(("other op", "lossless", ("verified sig",)), "verified")
    call()
    assert len(planned) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)
        policy._record(("other op", "lossless", ("sig",)), "mismatch", "test")
    call(), call()
    assert len(planned) == 3
    policy.reload_env()
    call(), call()
    assert len(planned) == 4
    policy.reset_verdicts()
    call(), call(), call()
    assert len(planned) == 6  # first sight again, then bound


@interpreter
def test_nothing_is_bound_when_every_call_is_verified(cpu_kernels, monkeypatch):
    monkeypatch.setattr(policy, "VERIFY_ALWAYS", True)
    planned = _planner_calls(monkeypatch, modulate, "plan_modulate")
    x, scale, shift, _ = _operands()
    with torch.no_grad():
        for _ in range(3):
            sites.modulate_site(x, scale, shift)
    assert len(planned) == 3


@interpreter
def test_a_bound_launch_that_raises_is_dropped_and_the_gate_decides(cpu_kernels, monkeypatch):
    """A bound launch that raises is forgotten; the call goes to the planner and the gate,
    which records the error (the signature then runs eager) and returns eager's bits."""
    x, scale, shift, _ = _operands()
    with torch.no_grad():
        sites.modulate_site(x, scale, shift), sites.modulate_site(x, scale, shift)
        (site_key,) = policy._bound

        def broken(*args):
            raise RuntimeError("launch failed")

        policy._bound[site_key] = broken
        monkeypatch.setattr(modulate, "launch_modulate", broken)
        monkeypatch.setitem(modulate.SPEC.launch, "lossless", broken)
        with pytest.warns(policy.FallbackWarning, match="launch failed"):
            out = sites.modulate_site(x, scale, shift)
    assert same_bits(out, x * (1 + scale) + shift)
    assert policy.bound(site_key) is None
    assert [(v.op, v.status) for v in policy.verdicts()] == [("modulate", "error")]


@pytest.mark.parametrize("spec, tier, layout", list(_bound_cases()))
def test_a_bound_launch_keeps_no_tensor_of_the_call_that_bound_it(spec, tier, layout, cpu_kernels, monkeypatch):
    """Bound launches live as long as their key (up to policy.MAX_BOUND of them): they must
    not pin the activations of the call that bound them (a graph pool, a model's memory)."""
    import gc
    import weakref

    args = spec.make_args(cases.Case(2, 6, _width(spec, monkeypatch), torch.float32, layout, device="cpu"))
    plan = spec.plan(*args, tier=tier)
    assert plan.__class__ is not str, plan
    run = spec.bind[tier](plan)
    tensors = _leaves(args)
    assert tensors
    refs = [weakref.ref(t) for t in tensors]
    del args, plan, tensors
    gc.collect()
    assert run is not None and all(r() is None for r in refs)


@interpreter
def test_a_norm_site_keys_its_eps_and_tier(cpu_kernels, monkeypatch):
    """The same operands through a LayerNorm of another eps, or under another tier, are
    other calls, each with its own key (four here), never another's bound launch."""
    planned = _planner_calls(monkeypatch, layer_norm_modulate, "plan_layer_norm_modulate")
    monkeypatch.setattr(policy, "_state", {})
    x, scale, shift = (t.bfloat16() for t in _operands(D=256)[:3])  # (fp32 norm sites are lossless in every tier)
    keys = set()
    real = policy.gated

    def spy(spec, tier, plan, args, fallback=None, site_key=None):
        keys.add(site_key)
        return real(spec, tier, plan, args, fallback, site_key)

    monkeypatch.setattr(policy, "gated", spy)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)
        for eps in (1e-6, 1e-5):
            norm = torch.nn.LayerNorm(256, elementwise_affine=False, eps=eps)
            for tier in ("lossless", "high"):
                with bitfuse.quality(tier):
                    out = sites.layer_norm_modulate_site(None, norm, x, scale, shift)
                if tier == "lossless":
                    assert same_bits(out, norm(x) * (1 + scale) + shift)
    assert len(keys) == 4 and None not in keys  # (a high miss's lossless fallback keeps the high call's key)
    assert len(planned) >= 4


@interpreter
def test_the_norm_and_rope_sites_keep_a_verified_launch(cpu_kernels, monkeypatch):
    """qk_norm_rope_site, joint_qk_norm_rope_site and rms_norm_site: after first sight
    and the binding call, the same metadata skips the planner and the gate, with the
    planned launch's bits; another eps is another key. (On the CPU aten's RMSNorm reduces
    in another order than on a GPU: the kernels are checked against their own planned
    launches here, against eager by the GPU tests.)"""
    from bitfuse.ops import rms_norm_modulate as R

    def rms_norm(x, eps, kind):
        return R.launch_rms_norm_modulate(R.plan_rms_norm(x, eps, kind))

    monkeypatch.setattr(sites, "_QK_NORM_ROPE", dataclasses.replace(qk_norm_rope.SPEC, reference=qk_norm_rope.qk_norm_rope))
    monkeypatch.setattr(sites, "_RMS_NORM", dataclasses.replace(R.RMS_NORM_SPEC, reference=rms_norm))
    gated = []
    real = policy.gated

    def spy(spec, *a, **k):
        gated.append(spec.name)
        return real(spec, *a, **k)

    monkeypatch.setattr(policy, "gated", spy)
    C, H = 256, 2
    norm_q, norm_k = torch.nn.RMSNorm(C, eps=1e-6), torch.nn.RMSNorm(C, eps=1e-6)
    head_q, head_k = torch.nn.RMSNorm(128, eps=1e-6), torch.nn.RMSNorm(128, eps=1e-6)
    rms = torch.nn.RMSNorm(C, eps=1e-6, elementwise_affine=False)
    with torch.no_grad():
        for m in (norm_q, norm_k, head_q, head_k):
            m.weight.uniform_(0.5, 1.5)
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            q, k = torch.randn(2, 5, C, generator=g), torch.randn(2, 5, C, generator=g)
            theta = torch.rand(2, 5, C, generator=g) * 6
            freqs = (theta.cos(), theta.sin())
            out = sites.qk_norm_rope_site(norm_q, norm_k, q, k, freqs, None, "interleaved")
            ref = qk_norm_rope.qk_norm_rope(
                (q,), (k,), ((norm_q.weight, norm_k.weight),), 1e-6, ((freqs, freqs),), "interleaved", "aten")
            assert all(same_bits(o, r) for o, r in zip(out, ref))
            qh, kh = (t.unflatten(-1, (H, 128)) for t in (q, k))
            cos, sin = (t[0, :, :128] for t in freqs)
            joint = sites.joint_qk_norm_rope_site([(head_q, head_k, qh, kh)], (cos, sin), "interleaved")
            ref = qk_norm_rope.qk_norm_rope(
                (qh,), (kh,), ((head_q.weight, head_k.weight),), 1e-6, (((cos, sin), (cos, sin)),), "interleaved",
                "aten")
            assert all(same_bits(o, r) for o, r in zip(joint, ref))
            assert same_bits(sites.rms_norm_site(rms, q), rms_norm(q, 1e-6, "aten"))
        # first sight, then the binding call, for each of the three calls
        assert [v.status for v in policy.verdicts()] == ["verified"] * 3, policy.verdicts()
        assert gated.count("qk_norm_rope") == 4 and gated.count("rms_norm") == 2
        norm_q.eps = norm_k.eps = 1e-5
        sites.qk_norm_rope_site(norm_q, norm_k, q, k, freqs, None, "interleaved")
        assert gated.count("qk_norm_rope") == 5
