"""Projections as one GEMM on the GPU (`ops.projections`): through the gate, the fused
call is bitwise the separate calls on every data draw and layout, and verified at the
shapes Sana runs; packing leaves the stock calls' bits alone; a site whose weights
were moved after packing makes the separate calls."""

from __future__ import annotations

import pytest
import torch

from bitfuse import policy, sites
from bitfuse.numerics import differing, same_bits
from bitfuse.ops import SPECS, cases
from bitfuse.ops import projections as P

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHAPES = ((2, 1024, 2240), (2, 300, 2240), (1, 1031, 3072), (3, 7, 64), (1, 1, 100))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("layout", P.LAYOUTS)
def test_every_layout_and_data_draw(layout, dtype):
    """Whatever the gate decides for a problem, the site's result is the separate calls'
    bits; at Sana's shapes in bf16 (B = 2: 1,024 tokens of 2240, the caption's 300) the
    fused GEMM itself is verified."""
    spec = SPECS["projections"]
    for i, data in enumerate(cases.DATA):
        for B, S, D in SHAPES:
            args = spec.make_args(cases.Case(B, S, D, dtype, layout, data, seed=i))
            plan = spec.plan(*args)
            assert plan.__class__ is not str, plan
            ref = spec.reference(*args)
            with torch.no_grad():
                out = policy.gated(spec, "lossless", plan, args)
                again = spec.launch["lossless"](plan) if policy.state(spec, "lossless", plan) else out
            for o, a, r in zip(out, again, ref):
                assert same_bits(o, r) and same_bits(a, r), f"{data} {B}x{S}x{D}: {differing(a, r)} differ"
            if dtype is torch.bfloat16 and D == 2240:
                assert policy.state(spec, "lossless", plan) is True, [v.detail for v in policy.verdicts()]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [2240, 3072])
def test_packing_keeps_the_stock_bits(width, bias):
    """The stock calls on packed parameters (each part 256-byte aligned, as a parameter
    allocated on its own) give the bits they gave before packing, for the token counts
    Sana and FLUX run and a few small ones."""
    torch.manual_seed(0)
    mods = [torch.nn.Linear(width, width, bias=bias, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    xs = [torch.randn(b, s, width, device="cuda", dtype=torch.bfloat16) for b, s in ((2, 1024), (2, 300), (1, 4608),
                                                                                       (2, 77), (1, 1))]
    with torch.no_grad():
        before = [[m(x) for m in mods] for x in xs]
        assert sites.pack_linears(*mods)
        offsets = P.layout([m.weight for m in mods])[0]
        # 2240 rows of bf16 biases would leave the next part 128-byte aligned: zero rows pad the gap
        assert offsets == ((0, 2304, 4608) if bias and width == 2240 else (0, width, 2 * width))
        assert not bias or P.layout([m.bias for m in mods]) == P.layout([m.weight for m in mods])
        after = [[m(x) for m in mods] for x in xs]
    for b, a in zip(before, after):
        for r, o in zip(b, a):
            assert same_bits(o, r), differing(o, r)


def test_a_site_whose_weights_moved_makes_the_separate_calls():
    """Moving the modules after packing (`.to()` copies each parameter on its own) unpacks
    them: the site's bound launch sees it from the pointers and the separate calls run."""
    torch.manual_seed(1)
    mods = [torch.nn.Linear(2240, 2240, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    sites.pack_linears(*mods)
    x = torch.randn(2, 1024, 2240, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = tuple(m(x) for m in mods)
        for _ in range(2):  # first sight (eager's results go on), then the bound launch
            out = sites.linear_projections_site(x, *mods)
            assert all(same_bits(o, r) for o, r in zip(out, ref))
        assert out[0].stride()[1] == 3 * 2240  # views of the one GEMM's output
        for m in mods:
            m.to("cpu").to("cuda")
        assert P.packed([m.weight for m in mods]) is None
        with torch.no_grad():
            for m in mods:
                m.weight.mul_(-1)
        ref = tuple(m(x) for m in mods)
        out = sites.linear_projections_site(x, *mods)
        assert all(same_bits(o, r) and o.is_contiguous() for o, r in zip(out, ref))
