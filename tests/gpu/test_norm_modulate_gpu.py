"""Norm + modulate kernels on the GPU, against eager PyTorch.

Exact mode must be torch.equal to the reference norm followed by eager's
modulate, for bf16 and fp16, on rows of every kind (normal, large magnitude,
tiny variance, constant), every parameter layout, outputs pre-filled with NaN.
Output equality alone is a weak test of a reduction order (a last-bit change
in a row's rsqrt rarely moves a bf16 rounding), so each exact launch also
writes its per-row statistics, which must equal aten's own bit for bit:
the diffusers mean (`x.float().pow(2).mean(-1)`), `_fused_rms_norm`'s rstd,
`native_layer_norm`'s mean and rstd.

The high tier must keep its contract against the float64 value of the same
expression (`numerics.high_contract`): every element within one ULP at the
terms' scale, mean error below eager's; the errors are printed (-s).
"""

import pytest
import torch

from bitfuse.numerics import differing, high_contract, max_ulp, same_bits, ulp_errors
from bitfuse.ops import layer_norm_modulate as LN
from bitfuse.ops import rms_norm_modulate as RMS
from bitfuse.ops._norm import layer_norm64, modulated64, modulated_terms64, rms_norm64
from bitfuse.ops._params import Folded

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
    tier = "lossless" if exact else "high"
    if kind == "layer_norm":
        return LN.plan_layer_norm_modulate(x, c, h, EPS, tier=tier)
    return RMS.plan_rms_norm_modulate(x, c, h, EPS, kind, tier=tier)


def launch(kind, plan, exact=None, out=None, stats=None):
    if kind == "layer_norm":
        return LN.launch_layer_norm_modulate(plan, out=out, stats=stats)
    return RMS.launch_rms_norm_modulate(plan, out=out, stats=stats)


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
    assert same_bits(out, expect), f"{differing(out, expect)} of {out.numel()} differ, max {max_ulp(out, expect)} ULP"
    # the default launch (fresh output, no stats) is the same kernel
    assert same_bits(launch(kind, plan, True), expect)


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


def norm64(kind, x):
    return layer_norm64(x, EPS) if kind == "layer_norm" else rms_norm64(x, EPS)


@pytest.mark.parametrize("data", ["randn", "outlier"])
@pytest.mark.parametrize("D", [1536, 2048, 2240, 3072, 4096, 5120, 6144])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_high_keeps_the_float64_contract(kind, dtype, D, data):
    """The one-pass kernel against the float64 value of the same expression: every
    element within one ULP at the terms' scale, mean error below eager's (LayerNorm
    rows held as power-of-two tiles at 1536, 3072, 5120 and 6144, and at 2240 as five
    tiles of 512, the last masked)."""
    g = torch.Generator(device="cuda").manual_seed(D + len(data))
    B, S = 2, 1031
    x = torch.randn(B, S, D, generator=g, device="cuda")
    if data == "outlier":
        x[..., torch.randint(0, D, (D // 256,), generator=g, device="cuda")] *= 64
    x = x.to(DTYPES[dtype])
    c, h = params("per-sample/strided", B, S, D, DTYPES[dtype], g)
    plan = plan_of(kind, x, c, h, False)
    assert not isinstance(plan, str), plan
    out = launch(kind, plan, out=torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda"))
    with torch.no_grad():
        eager = reference(kind, x, c, h)
    n64 = norm64(kind, x)
    ref64, terms64 = modulated64(n64, c, h), modulated_terms64(n64, c, h)
    err, eager_err = ulp_errors(out, ref64, terms64), ulp_errors(eager, ref64, terms64)
    print(f"\nhigh {kind} {dtype} D={D} {data}: high {float(err.mean()):.3f} / {float(err.max()):.2f} ULP, "
          f"eager {float(eager_err.mean()):.3f} / {float(eager_err.max()):.2f}; "
          f"{differing(out, eager)} of {out.numel()} differ from eager")
    assert high_contract(out, eager, ref64, terms64) is None
    assert float(err.max()) <= 0.51 and float(err.mean()) < float(eager_err.mean())


@pytest.mark.parametrize("D", [4096, 3072])
@pytest.mark.parametrize("kind", KINDS)
def test_high_site_on_rows_of_every_kind(kind, D):
    """Rows of every kind (constant, tiny variance, huge): through the site the high tier
    keeps its contract or the gate falls back to the lossless path; never worse."""
    import warnings

    import bitfuse
    from bitfuse import policy, sites

    g = torch.Generator(device="cuda").manual_seed(9)
    x = rows(2, 257, D, torch.bfloat16, g)
    c, h = params("per-sample/strided", 2, 257, D, torch.bfloat16, g)
    module = torch.nn.LayerNorm(D, eps=EPS, elementwise_affine=False) if kind == "layer_norm" else (
        torch.nn.RMSNorm(D, eps=EPS, elementwise_affine=False))
    if kind == "diffusers":
        from diffusers.models.normalization import RMSNorm

        module = RMSNorm(D, eps=EPS, elementwise_affine=False)
    site = sites.layer_norm_modulate_site if kind == "layer_norm" else sites.rms_norm_modulate_site
    with bitfuse.quality("high"), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)
        out = site(None, module, x, c, h)
        eager = module(x) * (1 + c) + h
    n64 = norm64(kind, x)
    ok = high_contract(out, eager, modulated64(n64, c, h), modulated_terms64(n64, c, h)) is None
    assert ok or same_bits(out, eager)


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
    RMS.launch_rms_norm_modulate(plan, out=out)
    expect = RMS.rms_norm_reference(x, EPS, kind)
    assert same_bits(out, expect), f"{differing(out, expect)} of {out.numel()} differ"


@pytest.mark.parametrize("T", [1, 1031])
@pytest.mark.parametrize("kind", KINDS)
def test_folded_parameters(kind, T):
    """Folded (table row, temb) scale/shift: exact kernel `torch.equal` to the norm then
    eager modulate of `table + temb` (LTX-2's RMSNorms, Sana's LayerNorms); the one-pass
    kernel equal to itself on the sum."""
    B, S, D = 2, 1031, 4096
    g = torch.Generator(device="cuda").manual_seed(T)
    x = rows(B, S, D, torch.bfloat16, g)
    table = torch.randn(6, D, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    t4 = torch.randn(B, T, 6 * D, device="cuda", dtype=torch.bfloat16, generator=g).reshape(B, T, 6, D)
    eager = (table[None, None] + t4).unbind(2)
    scale, shift = Folded(table[1], t4[:, :, 1]), Folded(table[0], t4[:, :, 0])
    plan = plan_of(kind, x, scale, shift, True)
    assert not isinstance(plan, str) and "+table" in plan.key[2], plan
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
    launch(kind, plan, out=out)
    expect = reference(kind, x, eager[1], eager[0])
    assert same_bits(out, expect), f"{differing(out, expect)} differ"
    high, high_eager = plan_of(kind, x, scale, shift, False), plan_of(kind, x, eager[1], eager[0], False)
    assert same_bits(launch(kind, high), launch(kind, high_eager))
