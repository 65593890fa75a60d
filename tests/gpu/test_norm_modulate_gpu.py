"""Norm + modulate kernels on the GPU, against eager PyTorch.

Exact mode must be torch.equal to the reference norm followed by eager's
modulate, for bf16 and fp16, on rows of every kind (normal, large magnitude,
tiny variance, constant), every parameter layout, outputs pre-filled with NaN.
Output equality alone is a weak test of a reduction order (a last-bit change
in a row's rsqrt rarely moves a bf16 rounding), so each exact launch also
writes its per-row statistics, which must equal aten's own bit for bit:
the diffusers mean (`x.float().pow(2).mean(-1)`), `_fused_rms_norm`'s rstd,
`native_layer_norm`'s mean and rstd.

High mode must pass the gate's criterion: within one ULP of eager at the
scale of the op's largest term; the ULP histograms are printed (-s).
"""

import sys

import pytest
import torch

from bitfuse.numerics import max_ulp, same_values, ulp_distance, ulp_of, within_one_ulp_at
from bitfuse.sites import NORM_HIGH_ULPS
from bitfuse.ops import layer_norm_modulate as _ln  # noqa: F401
from bitfuse.ops import rms_norm_modulate as _rms  # noqa: F401

RMS = sys.modules["bitfuse.ops.rms_norm_modulate"]
LN = sys.modules["bitfuse.ops.layer_norm_modulate"]

pytestmark = pytest.mark.gpu
EPS = 1e-6
KINDS = ["diffusers", "aten", "layer_norm"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rows(B, S, D, dtype, g, kinds=True):
    x = torch.randn(B, S, D, generator=g, device="cuda")
    if kinds:
        k = torch.randint(0, 6, (B, S, 1), generator=g, device="cuda")
        x = torch.where(k == 1, x * 1e3, x)  # large magnitude
        x = torch.where(k == 2, 3.0 + 1e-2 * x, x)  # tiny variance
        x = torch.where(k == 3, x[..., :1].expand_as(x), x)  # constant
        x = torch.where(k == 4, 10.0 + x, x)  # offset mean
        x = torch.where(k == 5, 1e-3 * x, x)  # small magnitude
    return x.to(dtype)


def params(layout, B, S, D, dtype, g, amp=0.5):
    def r(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * amp).to(dtype)

    if layout == "per-sample/strided":  # diffusers: table + temb, then unbind
        tab = r(B, 1, 6, D)
        return tab[:, :, 1], tab[:, :, 0]
    if layout == "per-token/strided":
        tab = r(B, S, 6, D)
        return tab[:, :, 1], tab[:, :, 0]
    if layout == "per-sample":
        return r(B, 1, D), r(B, 1, D)
    if layout == "per-token":
        return r(B, S, D), r(B, S, D)
    if layout == "shared":
        return r(D), r(D)
    raise ValueError(layout)


def plan_of(kind, x, c, h, exact):
    if kind == "layer_norm":
        return LN.plan_layer_norm_modulate(x, c, h, EPS, exact)
    return RMS.plan_rms_norm_modulate(x, c, h, EPS, kind, exact)


def launch(kind, plan, exact, out=None, stats=None):
    if kind == "layer_norm":
        return LN.launch_layer_norm_modulate(plan, exact, out=out, stats=stats)
    return RMS.launch_rms_norm_modulate(plan, exact, out=out, stats=stats)


def norm(kind, x):
    if kind == "layer_norm":
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=EPS)
    return RMS.rms_norm_reference(x, EPS, kind)


def reference(kind, x, c, h):
    return norm(kind, x) * (1 + c) + h


def aten_stats(kind, x):
    """{stat index: aten's per-row value} for the kernel's stats buffer."""
    D = x.shape[-1]
    if kind == "diffusers":
        mean = x.to(torch.float32).pow(2).mean(-1).reshape(-1)
        return {0: mean, 1: torch.rsqrt(mean + EPS)}
    if kind == "aten":
        return {1: torch.ops.aten._fused_rms_norm(x.contiguous(), [D], None, EPS)[1].reshape(-1)}
    _, mean, rstd = torch.native_layer_norm(x.contiguous(), [D], None, None, EPS)
    return {0: mean.reshape(-1), 1: rstd.reshape(-1)}


def check_exact(kind, x, c, h):
    plan = plan_of(kind, x, c, h, True)
    assert not isinstance(plan, str), plan
    n_rows = x.numel() // x.shape[-1]
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")  # poisoned
    stats = torch.full((n_rows, 2), float("nan"), device="cuda")
    assert launch(kind, plan, True, out=out, stats=stats) is out
    with torch.no_grad():
        expect = reference(kind, x, c, h)
        for i, v in aten_stats(kind, x).items():
            bad = int((stats[:, i] != v).sum())
            assert bad == 0, f"stat {i}: {bad} of {n_rows} rows differ from aten's"
    d = ulp_distance(out, expect)
    assert same_values(out, expect), f"{int((d > 0).sum())} of {out.numel()} differ, max {max_ulp(out, expect)} ULP"
    # the default launch (fresh output, no stats) is the same kernel
    assert same_values(launch(kind, plan, True), expect)


# rotate layouts and shapes through the (kind, dtype, D) grid: every D sees odd and prime S,
# B in {1, 2}, every layout
CASES = [(2, 97, "per-sample/strided"), (1, 257, "per-token/strided"), (2, 31, "shared"), (1, 1031, "per-sample")]


@pytest.mark.parametrize("D", [2048, 3072, 4096, 5120])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_exact_is_lossless(kind, dtype, D):
    i = [2048, 3072, 4096, 5120].index(D) + list(DTYPES).index(dtype)
    B, S, layout = CASES[i % len(CASES)]
    g = torch.Generator(device="cuda").manual_seed(D + 7 * i)
    x = rows(B, S, D, DTYPES[dtype], g)
    c, h = params(layout, B, S, D, DTYPES[dtype], g)
    check_exact(kind, x, c, h)


@pytest.mark.parametrize("layout", ["per-sample/strided", "per-token/strided", "per-sample", "per-token", "shared"])
@pytest.mark.parametrize("kind", KINDS)
def test_exact_layouts(kind, layout):
    g = torch.Generator(device="cuda").manual_seed(len(layout))
    B, S, D = 2, 61, 4096
    x = rows(B, S, D, torch.bfloat16, g)
    check_exact(kind, x, *params(layout, B, S, D, torch.bfloat16, g))


@pytest.mark.parametrize("kind", KINDS)
def test_exact_2d_and_strided_rows(kind):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = rows(1, 37, 3072, torch.float16, g).reshape(37, 3072)
    check_exact(kind, x, *params("shared", 1, 37, 3072, torch.float16, g))
    wide = rows(2, 19, 3200, torch.bfloat16, g)[..., 64:64 + 3072]  # rows strided, last dim dense
    check_exact(kind, wide, *params("per-sample/strided", 2, 19, 3072, torch.bfloat16, g))


@pytest.mark.parametrize("N", [1, 2, 3, 5, 9, 13, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_exact_few_rows(kind, N):
    """Few rows: aten's mean widens its blocks (64..512 threads a row), another tree."""
    g = torch.Generator(device="cuda").manual_seed(N)
    for D in (3072, 4096):
        x = rows(1, N, D, torch.bfloat16, g)
        check_exact(kind, x, *params("per-sample/strided", 1, N, D, torch.bfloat16, g))


@pytest.mark.parametrize("kind", KINDS)
def test_exact_fp32(kind):
    g = torch.Generator(device="cuda").manual_seed(2)
    x = rows(2, 101, 4096, torch.float32, g)
    check_exact(kind, x, *params("per-sample/strided", 2, 101, 4096, torch.float32, g))


@pytest.mark.parametrize("kind", KINDS)
def test_fallback_reasons(kind):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = rows(1, 8, 1002, torch.bfloat16, g)
    assert "multiple of 4" in plan_of(kind, x, *params("shared", 1, 8, 1002, torch.bfloat16, g), True)
    if kind != "diffusers":  # diffusers reads x through a fresh fp32 copy: alignment is moot
        buf = rows(1, 1, 8 * 1024 + 1, torch.bfloat16, g).reshape(-1)
        x = buf[1:].view(8, 1024)
        assert "aligned" in plan_of(kind, x, *params("shared", 1, 8, 1024, torch.bfloat16, g), True)
    else:
        x = rows(1, 16, 8192, torch.bfloat16, g)
        assert "across warps" in plan_of(kind, x, *params("shared", 1, 16, 8192, torch.bfloat16, g), True)


def high_case(kind, dtype, D):
    """Well-conditioned rows (on a constant or nearly constant row eager itself is far
    from exact, and high is closer to exact than eager there)."""
    g = torch.Generator(device="cuda").manual_seed(D)
    B, S = 2, 1031
    x = rows(B, S, D, DTYPES[dtype], g, kinds=False)
    c, h = params("per-sample/strided", B, S, D, DTYPES[dtype], g)
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
    launch(kind, plan_of(kind, x, c, h, False), False, out=out)
    return x, c, h, out


@pytest.mark.parametrize("D", [2048, 4096])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_high_differs_only_where_the_norm_output_flips(kind, dtype, D):
    """High mode keeps eager's modulate roundings and changes only the summation
    order: its result equals eager's wherever its normalised n (a launch with
    scale = shift = 0) equals eager's n, and n flips on a few elements a million."""
    x, c, h, out = high_case(kind, dtype, D)
    z = torch.zeros_like(c), torch.zeros_like(h)
    n_high = launch(kind, plan_of(kind, x, *z, False), False)
    with torch.no_grad():
        n = norm(kind, x)
        expect = n * (1 + c) + h
    flips = n_high != n
    terms = (n.float() * (1 + c.float())).abs().maximum(h.float().abs()).maximum(expect.float().abs())
    err = (out.float() - expect.float()).abs() / ulp_of(terms, out.dtype)
    d = ulp_distance(out, expect)
    print(f"\nhigh {kind} {dtype} D={D}: n flips on {int(flips.sum())} of {n.numel()}; "
          f"ULP vs eager (0,1,2,3,>=4) {torch.bincount(d.clamp(max=4).flatten(), minlength=5).tolist()}, "
          f"max {float(err.max()):.2f} ULP at the terms' scale")
    assert torch.equal(out[~flips], expect[~flips])
    assert int(flips.sum()) <= n.numel() * 1e-4  # measured (D=4096): 3e-6 to 8e-6 bf16, 2e-5 to 5e-5 fp16
    if kind != "layer_norm":  # RMSNorm: a flip is one rounding step of x * r. (LayerNorm's
        # n = rstd * (x - mean) moves further where x is within an ULP or two of the mean.)
        assert int((ulp_distance(n_high, n) > 1).sum()) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_high_gate_criterion(kind):
    """The gate's high contract (sites.NORM_HIGH_ULPS): within two ULPs at the terms' scale."""
    x, c, h, out = high_case(kind, "bf16", 4096)
    with torch.no_grad():
        n = norm(kind, x)
        expect = n * (1 + c) + h
    terms = (n.float() * (1 + c.float())).abs().maximum(h.float().abs()).maximum(expect.float().abs())
    assert within_one_ulp_at(out, expect, terms, NORM_HIGH_ULPS)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("B,S,D", [(1, 6144, 4096), (2, 1031, 2048), (1, 126, 2048), (2, 97, 3072)])
@pytest.mark.parametrize("kind", ["diffusers", "aten"])
def test_norm_alone_is_lossless(kind, dtype, B, S, D):
    """The exact kernel without its modulate (LTX-2's a2v/v2a norms): `torch.equal` to the norm."""
    g = torch.Generator(device="cuda").manual_seed(B * S + D)
    x = rows(B, S, D, DTYPES[dtype], g)
    plan = RMS.plan_rms_norm(x, EPS, kind)
    assert not isinstance(plan, str), plan
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
    RMS.launch_rms_norm_modulate(plan, True, out=out)
    expect = RMS.rms_norm_reference(x, EPS, kind)
    assert same_values(out, expect), f"{int((out != expect).sum())} of {out.numel()} differ"


@pytest.mark.parametrize("T", [1, 1031])
@pytest.mark.parametrize("kind", KINDS[:2])
def test_folded_parameters(kind, T):
    """Folded (table row, temb) scale/shift: exact kernel `torch.equal` to the norm then
    eager modulate of `table + temb`; the one-pass kernel equal to itself on the sum."""
    from bitfuse.ops._pointwise import Folded

    B, S, D = 2, 1031, 4096
    g = torch.Generator(device="cuda").manual_seed(T)
    x = rows(B, S, D, torch.bfloat16, g)
    table = torch.randn(6, D, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    t4 = torch.randn(B, T, 6 * D, device="cuda", dtype=torch.bfloat16, generator=g).reshape(B, T, 6, D)
    eager = (table[None, None] + t4).unbind(2)
    scale, shift = Folded(table[1], t4[:, :, 1]), Folded(table[0], t4[:, :, 0])
    plan = RMS.plan_rms_norm_modulate(x, scale, shift, EPS, kind, exact=True)
    assert not isinstance(plan, str), plan
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
    RMS.launch_rms_norm_modulate(plan, True, out=out)
    expect = RMS.rms_norm_modulate_reference(x, eager[1], eager[0], EPS, kind)
    assert same_values(out, expect), f"{int((out != expect).sum())} differ"
    high = RMS.plan_rms_norm_modulate(x, scale, shift, EPS, kind, exact=False)
    high_eager = RMS.plan_rms_norm_modulate(x, eager[1], eager[0], EPS, kind, exact=False)
    assert torch.equal(RMS.launch_rms_norm_modulate(high, False), RMS.launch_rms_norm_modulate(high_eager, False))
