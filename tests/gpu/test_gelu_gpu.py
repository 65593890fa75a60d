"""GELU(tanh) on the GPU, bitwise against eager's `F.gelu(x, approximate="tanh")`.

The whole input domain first: for bf16 and fp16 the form check (`gelu.form`) must
find a kernel form equal to eager on all 65,536 inputs of this GPU, and the
production launch is checked over them again (NaN-poisoned outputs). Then the
shapes users run (LTX-2's feed-forward: [2, 6144, 16384]), odd sizes on both the
masked and the even path, the site through the gate, and an LTX-2 full-width
2-layer forward equal to stock with the GELU signature verified. `-s` prints the
forms found and eager vs kernel times."""

from __future__ import annotations

import pytest
import torch

from bitfuse import policy, sites
from bitfuse.numerics import differing, same_bits
from bitfuse.ops import gelu as GE

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


def _check(x):
    plan = GE.plan_gelu_tanh(x)
    assert not isinstance(plan, str), plan
    ref = torch.nn.functional.gelu(x, approximate="tanh")
    out = torch.full_like(x, float("nan"))
    assert GE.launch_gelu_tanh(plan, out=out) is out
    assert same_bits(out, ref), f"{differing(out, ref)} of {ref.numel()} differ from eager"
    assert same_bits(GE.launch_gelu_tanh(plan), ref)
    return plan


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_input_equals_eager(dtype):
    fma = GE.form("cuda", dtype)
    print(f"\n[gelu] {dtype}: form FMA={fma}")
    assert fma is not None, "no kernel form equals eager's GELU on every input of this dtype here"
    _check(GE.every_input(dtype, "cuda"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 6144, 16384), (1, 1031, 8192), (3, 7), (1,), (2048 * 5,)])
def test_shapes(dtype, shape):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    x.view(-1)[::97] = 0.0
    x.view(-1)[1::97] = -0.0
    if x.numel() > 300:
        x.view(-1)[2::997] = float("nan")
        x.view(-1)[3::997] = float("inf")
        x.view(-1)[4::997] = float("-inf")
    _check(x)


def test_guard_sends_other_layouts_to_eager():
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    assert GE.plan_gelu_tanh(x.t()) == "x is not contiguous"
    assert "16-bit" in GE.plan_gelu_tanh(x.float())


def test_site_through_the_gate():
    policy.reset_verdicts()
    x = torch.randn(2, 300, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            assert same_bits(sites.gelu_site(x, "tanh"), torch.nn.functional.gelu(x, approximate="tanh"))
        assert same_bits(sites.gelu_site(x, "none"), torch.nn.functional.gelu(x))
    verdicts = [v for v in policy.verdicts() if v.op == "gelu_tanh"]
    assert verdicts and all(v.active for v in verdicts), [(v.signature, v.detail) for v in verdicts]


def test_speed_printed():
    x = torch.randn(2, 6144, 16384, device="cuda", dtype=torch.bfloat16)
    plan = GE.plan_gelu_tanh(x)

    def time_us(fn, reps=20):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return sorted(times)[reps // 2]

    eager = time_us(lambda: torch.nn.functional.gelu(x, approximate="tanh"))
    ours = time_us(lambda: GE.launch_gelu_tanh(plan))
    tb = 4 * x.numel() / 1e6
    print(f"\n[gelu] 2 x 6144 x 16384 bf16: eager {eager:.1f} us ({tb / eager:.2f} TB/s), "
          f"kernel {ours:.1f} us ({tb / ours:.2f} TB/s)")


def test_ltx2_forward_equals_stock_with_gelu_verified():
    pytest.importorskip("diffusers")
    import bitfuse
    from bitfuse.models.ltx2_configs import build_model, full_config, make_inputs

    policy.reset_verdicts()
    model = build_model(full_config(2, "2.0"), device="cuda", dtype=torch.bfloat16, seed=0)
    kw = make_inputs(model, 2, (4, 16, 48), 126, 128, seed=0)
    with torch.no_grad():
        ref = model(**kw)
        with bitfuse.accelerate(model):
            outs = [model(**kw), model(**kw)]
    verdicts = [v for v in policy.verdicts() if v.op == "gelu_tanh"]
    assert verdicts and all(v.active for v in verdicts), [(v.signature, v.detail) for v in verdicts]
    for out in outs:
        for o, r in zip(out, ref):
            assert torch.equal(o, r), f"{int((o != r).sum())} of {r.numel()} differ"
    del model
    torch.cuda.empty_cache()
