"""Site dispatch, tier resolution, mounting, and bad input (CPU)."""

import threading

import pytest
import torch

import bitfuse
from bitfuse import policy, sites


class FakePlan:
    key = (torch.float32, 0, "per-sample", "per-sample")


@pytest.fixture
def fake_kernels(monkeypatch):
    """Make every op eligible and record which mode the site asked for."""
    calls = []

    def fake(op, reference):
        def launch(mode):
            def run(plan):
                calls.append((op, mode))
                return reference()

            return run

        return launch

    state = {}
    monkeypatch.setattr(sites, "plan_modulate", lambda x, c, h: (state.update(ref=lambda: x * (1 + c) + h), FakePlan())[1])
    monkeypatch.setattr(sites, "plan_gated_residual", lambda x, y, g: (state.update(ref=lambda: x + y * g), FakePlan())[1])
    monkeypatch.setattr(sites, "plan_rms_norm_modulate",
                        lambda x, c, h, eps, kind, exact: (state.update(ref=lambda: state["norm"](x) * (1 + c) + h),
                                                           FakePlan())[1])
    monkeypatch.setattr(sites, "_launch_rms", {m: fake("rms_norm_modulate", lambda: state["ref"]())(m)
                                               for m in ("exact", "high")})
    state["norm"] = torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
    monkeypatch.setattr(sites, "launch_modulate", fake("modulate", lambda: state["ref"]())("exact"))
    monkeypatch.setattr(sites, "launch_gated_residual", fake("gated_residual", lambda: state["ref"]())("exact"))
    return calls


def _collapsed(calls):
    """Calls with repeats in a row folded: first sight launches the fast path twice."""
    return [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]


def _operands():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 8, generator=g)
    scale, shift, gate = torch.randn(2, 1, 3, 8, generator=g).unbind(2)
    return x, scale, shift, gate


def test_pointwise_sites_use_the_gated_exact_kernel_in_every_tier(fake_kernels):
    x, scale, shift, gate = _operands()
    assert torch.equal(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
    assert torch.equal(sites.gated_residual_site(x, x, gate), x + x * gate)
    with bitfuse.quality("high"):
        sites.modulate_site(x, scale, shift)
        sites.gated_residual_site(x, x, gate)
    assert _collapsed(fake_kernels) == [("modulate", "exact"), ("gated_residual", "exact")] * 2
    assert {(v.op, v.mode, v.status) for v in bitfuse.verdicts()} == {
        ("modulate", "exact", "verified"), ("gated_residual", "exact", "verified")}


def test_sites_emit_the_plain_expression_while_compiling(fake_kernels, monkeypatch):
    x, scale, shift, gate = _operands()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(sites, "plan_modulate", lambda *a: pytest.fail("planned a kernel while compiling"))
    assert torch.equal(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
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
    assert torch.equal(compiled(x, scale, shift, gate), x + (x * (1 + scale) + shift) * gate)


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
    x, scale, shift = (t.bfloat16() for t in _operands()[:3])  # fp32 norm sites stay exact in every tier
    norm = torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
    block = Block(norm)
    site = sites.mark_site(block, "b", norms=(norm,))
    sites.rms_norm_modulate_site(block, norm, x, scale, shift)
    site.tier = "high"
    sites.rms_norm_modulate_site(block, norm, x, scale, shift)
    with bitfuse.quality("lossless"):
        sites.rms_norm_modulate_site(block, norm, x, scale, shift)
    assert _collapsed([m for op, m in fake_kernels if op == "rms_norm_modulate"]) == ["exact", "high", "exact"]


def test_mounted_model_serves_concurrent_requests_without_leaking(fake_kernels):
    x, scale, shift = (t.bfloat16() for t in _operands()[:3])
    barrier = threading.Barrier(2)
    modes = {}

    def request(name, tier):
        with bitfuse.quality(tier):
            barrier.wait()
            before = len(fake_kernels)
            norm = torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
            with torch.no_grad():
                sites.rms_norm_modulate_site(None, norm, x, scale, shift)
            modes[name] = tier
            barrier.wait()
            assert len(fake_kernels) > before

    threads = [threading.Thread(target=request, args=(n, t)) for n, t in (("a", "high"), ("b", "lossless"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted({m for op, m in fake_kernels if op == "rms_norm_modulate"}) == ["exact", "high"]


def test_fp32_norm_sites_take_the_exact_kernel_in_every_tier(fake_kernels):
    x, scale, shift, _ = _operands()
    norm = torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
    with bitfuse.quality("high"), torch.no_grad():
        sites.rms_norm_modulate_site(None, norm, x, scale, shift)
    assert {m for op, m in fake_kernels if op == "rms_norm_modulate"} == {"exact"}


def test_norm_kinds():
    from diffusers.models.normalization import RMSNorm

    assert sites.norm_kind(RMSNorm(8, eps=1e-6, elementwise_affine=False)) == "diffusers"
    assert sites.norm_kind(RMSNorm(8, eps=1e-6, elementwise_affine=True)) is None
    assert sites.norm_kind(torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)) == "aten"
    assert sites.norm_kind(torch.nn.LayerNorm(8, elementwise_affine=False)) == "layer_norm"
    assert sites.norm_kind(torch.nn.LayerNorm(8)) is None
    assert sites.norm_kind(torch.nn.Identity()) is None


@pytest.mark.parametrize("tier", ["lossless", "high"])
def test_norm_sites_on_cpu_equal_eager(tier):
    from diffusers.models.normalization import RMSNorm

    x, scale, shift, _ = _operands()
    with bitfuse.quality(tier):
        for norm in (RMSNorm(8, eps=1e-6, elementwise_affine=False),
                     torch.nn.RMSNorm(8, eps=1e-6, elementwise_affine=False),
                     torch.nn.LayerNorm(8, elementwise_affine=False, eps=1e-6),
                     torch.nn.LayerNorm(8)):
            site = sites.layer_norm_modulate_site if isinstance(norm, torch.nn.LayerNorm) else sites.rms_norm_modulate_site
            with torch.no_grad():
                assert torch.equal(site(None, norm, x, scale, shift), norm(x) * (1 + scale) + shift)


def test_rms_norm_site_is_exact_in_every_tier(monkeypatch):
    """The norm alone (a2v/v2a): the exact kernel in every tier, plain while compiling,
    the module itself for norms it does not reproduce."""
    from diffusers.models.normalization import RMSNorm

    x = _operands()[0]
    norm = RMSNorm(8, eps=1e-6, elementwise_affine=False)
    calls = []
    monkeypatch.setattr(sites, "plan_rms_norm", lambda x, eps, kind: (calls.append(kind), FakePlan())[1])
    monkeypatch.setattr(sites, "launch_rms_norm_modulate", lambda plan: norm(x))
    for tier in ("lossless", "high"):
        with bitfuse.quality(tier), torch.no_grad():
            assert torch.equal(sites.rms_norm_site(norm, x), norm(x))
    assert calls == ["diffusers", "diffusers"]
    assert [v.op for v in policy.verdicts()] == ["rms_norm"]
    affine = RMSNorm(8, eps=1e-6, elementwise_affine=True)
    with torch.no_grad():
        assert torch.equal(sites.rms_norm_site(affine, x), affine(x))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        assert torch.equal(sites.rms_norm_site(norm, x), norm(x))
    assert len(calls) == 2


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
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert bitfuse.verdicts() == []  # nothing on the CPU reaches the gate
