"""Bit-exactness of the modulate, gated-residual and per-head gate kernels against eager, on the GPU.

Fresh random inputs per case, outputs poisoned with NaN before the kernel
writes, odd sizes, every parameter layout the models produce."""

import pytest
import torch

from bitfuse import policy, sites
from bitfuse.numerics import differing, same_bits
from bitfuse.ops import gated_residual as G
from bitfuse.ops import modulate as M
from bitfuse.ops._params import Folded

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DS = [64, 2048, 2240, 3072, 4096, 5120]
SS = [1, 126, 1031, 6144]
BS = [1, 2]


def _params(layout, B, S, D, dtype, gen, n=3):
    """`n` parameters of one layout class, as models make them."""
    dev = "cuda"
    if layout == "per-sample":
        return [torch.randn(B, 1, D, device=dev, dtype=dtype, generator=gen) for _ in range(n)]
    if layout == "per-token":
        return [torch.randn(B, S, D, device=dev, dtype=dtype, generator=gen) for _ in range(n)]
    if layout == "shared":
        return [torch.randn(D, device=dev, dtype=dtype, generator=gen) for _ in range(n)]
    if layout == "unbind-per-sample":  # diffusers: (table[None, None] + temb.reshape(B, 1, n, D)).unbind(2)
        return list(torch.randn(B, 1, n + 2, D, device=dev, dtype=dtype, generator=gen).unbind(2))[:n]
    if layout == "unbind-per-token":
        return list(torch.randn(B, S, n + 2, D, device=dev, dtype=dtype, generator=gen).unbind(2))[:n]
    raise ValueError(layout)


LAYOUTS = ["per-sample", "per-token", "shared", "unbind-per-sample", "unbind-per-token"]


def _poisoned(x):
    return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("S", SS)
@pytest.mark.parametrize("B", BS)
def test_exact_against_eager(dtype, D, S, B):
    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), D, S, B)) % 2**31)
    for layout in LAYOUTS:
        x = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=gen) * 3
        y = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=gen)
        scale, shift, gate = _params(layout, B, S, D, dtype, gen)

        plan = M.plan_modulate(x, scale, shift)
        assert not isinstance(plan, str), plan
        ref = x * (1 + scale) + shift
        for attempt in range(2):  # the second launch takes the direct (cached) launcher
            out = M.launch_modulate(plan, out=_poisoned(x))
            assert same_bits(out, ref), f"modulate {layout} #{attempt}: {differing(out, ref)} differ"

        plan = G.plan_gated_residual(x, y, gate)
        assert not isinstance(plan, str), plan
        ref = x + y * gate
        for attempt in range(2):
            out = G.launch_gated_residual(plan, out=_poisoned(x))
            assert same_bits(out, ref), f"gated_residual {layout} #{attempt}: {differing(out, ref)} differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_strided_x_and_mixed_layouts(dtype):
    """x a column slice of a wider tensor, scale per-token and shift per-sample, 2-D x."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    B, S, D = 2, 1031, 2240
    wide = torch.randn(B, S, D + 64, device="cuda", dtype=dtype, generator=gen)
    x = wide[..., 32 : 32 + D]
    scale = torch.randn(B, S, 4, D, device="cuda", dtype=dtype, generator=gen).unbind(2)[1]
    shift = torch.randn(B, 1, D, device="cuda", dtype=dtype, generator=gen)
    plan = M.plan_modulate(x, scale, shift)
    assert same_bits(M.launch_modulate(plan, out=_poisoned(x)), x * (1 + scale) + shift)
    x2 = x[0]
    s2 = torch.randn(D, device="cuda", dtype=dtype, generator=gen)
    h2 = torch.randn(S, D, device="cuda", dtype=dtype, generator=gen).t().contiguous().t()  # column-major
    plan = M.plan_modulate(x2, s2, h2)
    assert same_bits(M.launch_modulate(plan, out=_poisoned(x2)), x2 * (1 + s2) + h2)


def test_high_tier_keeps_pointwise_sites_exact():
    import bitfuse

    x = torch.randn(2, 1031, 4096, device="cuda", dtype=torch.bfloat16)
    scale, shift, gate = torch.randn(2, 1, 3, 4096, device="cuda", dtype=torch.bfloat16).unbind(2)
    with bitfuse.quality("high"):
        assert same_bits(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
        assert same_bits(sites.gated_residual_site(x, x, gate), x + x * gate)


def test_sites_verify_and_stay_exact_with_nonfinite_inputs():
    x = torch.randn(2, 126, 2048, device="cuda", dtype=torch.bfloat16)
    x[0, 3, 5] = float("nan")
    x[1, 7, 9] = float("inf")
    scale, shift, gate = torch.randn(2, 1, 3, 2048, device="cuda", dtype=torch.bfloat16).unbind(2)
    x[1, 8, :64] = 0.0
    x[1, 9, :64] = -0.0
    gate[0, 0, :32] = -0.0
    assert same_bits(sites.modulate_site(x, scale, shift), x * (1 + scale) + shift)
    assert same_bits(sites.gated_residual_site(x, x, gate), x + x * gate)
    assert all(v.active for v in policy.verdicts()), policy.verdicts()


def test_custom_op_under_compile_and_graph_capture():
    x = torch.randn(2, 126, 2048, device="cuda", dtype=torch.bfloat16)
    scale, shift = torch.randn(2, 1, 2, 2048, device="cuda", dtype=torch.bfloat16).unbind(2)
    ref = x * (1 + scale) + shift
    compiled = torch.compile(lambda a, b, c: torch.ops.bitfuse.modulate(a, b, c), fullgraph=True)
    assert same_bits(compiled(x, scale, shift), ref)
    sites.modulate_site(x, scale, shift)  # verdict before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sites.modulate_site(x, scale, shift)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert same_bits(out, x * (1 + scale) + shift)


def test_verify_command_reports_every_path_exact(capsys):
    from bitfuse import verify

    report = verify.run_checks(quick=True)
    assert report["cuda"] is True
    assert report["paths"], report
    bad = [p for p in report["paths"] if p["status"] in ("mismatch", "error")]
    assert not bad, bad
    assert all(p["status"] == "verified" for p in report["paths"] if p["op"] in ("modulate", "gated_residual"))
    assert {p["tier"] for p in report["paths"] if p["status"] == "verified"} == {"lossless", "high"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,D,T", [(1, 6144, 4096, 1), (2, 1031, 2048, 1031), (2, 126, 2240, 1), (1, 1, 64, 1)])
def test_folded_parameters_exact(dtype, B, S, D, T):
    """Folded(table row, temb view) as LTX-2's get_mod_params makes them: equal to eager
    on `(table[None, None] + temb.reshape(B, T, n, D)).unbind(2)`, per-sample and per-token."""
    gen = torch.Generator(device="cuda").manual_seed(B * S + D)
    x = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=gen) * 3
    y = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=gen)
    table = torch.randn(9, D, device="cuda", dtype=dtype, generator=gen) / D**0.5
    temb = torch.randn(B, T, 9 * D, device="cuda", dtype=dtype, generator=gen)
    eager = (table[None, None] + temb.reshape(B, T, 9, D)).unbind(2)
    folded = [Folded(table[i], temb.reshape(B, T, 9, D)[:, :, i]) for i in range(9)]
    for shift_i, scale_i, gate_i in ((0, 1, 2), (3, 4, 5), (6, 7, 8)):
        plan = M.plan_modulate(x, folded[scale_i], folded[shift_i])
        assert not isinstance(plan, str), plan
        ref = x * (1 + eager[scale_i]) + eager[shift_i]
        for _ in range(2):
            assert same_bits(M.launch_modulate(plan, out=_poisoned(x)), ref)
        plan = G.plan_gated_residual(x, y, folded[gate_i])
        assert not isinstance(plan, str), plan
        for _ in range(2):
            assert same_bits(G.launch_gated_residual(plan, out=_poisoned(x)), x + y * eager[gate_i])
    # through the sites (gated first sight)
    assert same_bits(sites.modulate_site(x, folded[1], folded[0]), x * (1 + eager[1]) + eager[0])
    assert same_bits(sites.gated_residual_site(x, y, folded[2]), x + y * eager[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,C,H", [(1, 1, 4096, 32), (2, 1031, 4096, 32), (2, 6144, 2048, 32), (3, 126, 2240, 35),
                                     (2, 257, 100, 4)])
def test_head_gate_exact_against_eager(dtype, B, S, C, H):
    """LTX-2.3's gated attention output: each head of y times its gate, on fresh draws with
    NaN/inf, signed zeros and outlier channels, per-token, per-sample and strided gates,
    padded rows of y, into NaN-poisoned outputs."""
    from bitfuse.ops import head_gate as HG

    gen = torch.Generator(device="cuda").manual_seed(hash((str(dtype), B, S, C)) % 2**31)
    y = torch.randn(B, S, C + 64, device="cuda", dtype=dtype, generator=gen)
    y[..., torch.randint(0, C, (8,), device="cuda", generator=gen)] *= 64  # outlier channels
    y.view(-1)[torch.randint(0, y.numel(), (y.numel() // 50,), device="cuda", generator=gen)] = -0.0
    y[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    gates = {"per-token": 2 * torch.sigmoid(torch.randn(B, S, H, device="cuda", dtype=dtype, generator=gen)),
             "per-sample": torch.randn(B, 1, H, device="cuda", dtype=dtype, generator=gen),
             "strided": torch.randn(B, S, H + 3, device="cuda", dtype=dtype, generator=gen)[..., 1 : H + 1]}
    gates["per-token"][-1, -1, 0] = 0.0
    gates["per-sample"][0, 0, -1] = float("inf")
    for name, gate in gates.items():
        for label, ys in (("dense", y[..., :C].contiguous()), ("padded rows", y[..., :C])):
            ref = (ys.unflatten(-1, (H, -1)) * gate.unsqueeze(-1)).flatten(-2)
            plan = HG.plan_head_gate(ys, gate)
            assert not isinstance(plan, str), plan
            for attempt in range(2):  # the second launch takes the direct launcher
                out = HG.launch_head_gate(plan, out=_poisoned(ref))
                assert same_bits(out, ref), f"{name} {label} #{attempt}: {differing(out, ref)} differ"
            out = sites.head_gate_site(ys, gate, H)  # the site: the gate, then the bound launch
            assert same_bits(out, ref) and same_bits(sites.head_gate_site(ys, gate, H), ref), (name, label)
    assert all(v.active for v in policy.verdicts() if v.op == "head_gate"), policy.verdicts()
