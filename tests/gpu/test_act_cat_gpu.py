"""An activation written into a concatenation (`ops.act_cat`) against eager, on the GPU:
every 16-bit input of each activation, every data draw and layout at FLUX's shapes and
odd ones into NaN-poisoned outputs, and the site's verdicts."""

import pytest
import torch
import torch.nn.functional as F

from bitfuse import policy, sites
from bitfuse.numerics import differing, same_bits
from bitfuse.ops import act_cat as A
from bitfuse.ops import cases
from bitfuse.ops._act import DOMAIN, every_input

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DOMAIN, ids=str)
@pytest.mark.parametrize("act", A.ACTS)
def test_every_input_equals_eager(act, dtype):
    """The form the check settles on exists, and the kernel in it equals eager on all
    65,536 inputs, here beside an `a` and (the SwiGLU) with a random second half."""
    assert A.form("cuda", dtype, act) is not None, A._ERRORS
    g = torch.Generator(device="cuda").manual_seed(1)
    x = every_input(dtype, "cuda").view(256, 256)
    m = torch.cat([x, torch.randn(x.shape, generator=g, device="cuda").to(dtype)], -1) if act == "swiglu" else x
    a = torch.randn(256, 48, generator=g, device="cuda").to(dtype)
    spec = A.SPECS[f"cat_{act}"]
    plan = spec.plan(a, m)
    assert plan.__class__ is not str, plan
    ref = spec.reference(a, m)
    out = A.launch_act_cat(plan, out=torch.full_like(ref, float("nan")))
    assert same_bits(out, ref), differing(out, ref)


SHAPES = [(1, 4608, 3072), (2, 61, 1000), (1, 7, 130), (3, 33, 2048)]  # (B, S, width of act(m))


@pytest.mark.parametrize("dtype", DOMAIN, ids=str)
@pytest.mark.parametrize("act", A.ACTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_exact_on_every_draw_and_layout(act, dtype, shape):
    B, S, D = shape
    spec = A.SPECS[f"cat_{act}"]
    for layout in A.LAYOUTS:
        for i, data in enumerate(cases.DATA):
            a, m = spec.make_args(cases.Case(B, S, D, dtype, layout, data, seed=17 * i + D))
            plan = spec.plan(a, m)
            assert plan.__class__ is not str, plan
            ref = spec.reference(a, m)
            for attempt in range(2):  # the bound launch the second time
                poisoned = torch.full_like(ref, float("nan"))
                out = spec.launch["lossless"](plan, out=poisoned) if attempt == 0 else spec.bind["lossless"](plan)(a, m)
                assert same_bits(out, ref), f"{layout} {data}: {differing(out, ref)}"
                assert out.shape == ref.shape and out.stride() == ref.stride()


def test_fp32_and_mixed_operands_take_eager():
    m = torch.randn(2, 3, 64, device="cuda")
    assert A.plan_cat_swiglu(None, m).startswith("torch.float32: only 16-bit inputs")
    assert A.plan_cat_gelu_tanh(m[..., :8].half(), m.bfloat16()).startswith("mixed dtypes")


@pytest.mark.parametrize("act", A.ACTS)
def test_site_verifies_at_flux_shapes(act):
    """FLUX.1's single block (attention output [1, 4608, 3072], the MLP's [1, 4608, 12288])
    and FLUX.2's (a column slice of the fused projection, [1, 4608, 2 x 18432] of rows
    55,296 wide): verified at first sight, eager's bits on later calls."""
    g = torch.Generator(device="cuda").manual_seed(5)
    if act == "gelu_tanh":
        a = torch.randn(1, 4608, 3072, generator=g, device="cuda").to(torch.bfloat16)
        m = (2 * torch.randn(1, 4608, 12288, generator=g, device="cuda")).to(torch.bfloat16)
    else:
        a = torch.randn(1, 4608, 6144, generator=g, device="cuda").to(torch.bfloat16)
        m = (2 * torch.randn(1, 4608, 3 * 6144 + 2 * 18432, generator=g, device="cuda")).to(torch.bfloat16)[
            ..., 3 * 6144:]
    ref = A.SPECS[f"cat_{act}"].reference(a, m)
    for _ in range(3):
        out = sites.cat_act_site(a, m, act)
        assert same_bits(out, ref), differing(out, ref)
    verdicts = [v for v in policy.verdicts() if v.op == f"cat_{act}"]
    assert verdicts and all(v.status == "verified" for v in verdicts), verdicts
    none = sites.cat_act_site(None, m, act)
    assert same_bits(none, A.SPECS[f"cat_{act}"].reference(None, m))
    assert same_bits(sites.cat_act_site(a, m, act, dim=2), torch.cat(
        [a, F.gelu(m, approximate="tanh") if act == "gelu_tanh" else sites.ACT_REFERENCES[act](m)], dim=2))
