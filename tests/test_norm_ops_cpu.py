"""Norm + modulate kernels on the CPU: guards and reasons everywhere; under
Triton's interpreter (fp32), indexing, broadcast and masking, and the
reduction ORDER itself.

The order check: each exact kernel writes its per-row statistic (the
diffusers mean, aten's sigma2 / D, the LayerNorm mean) to a side buffer when
asked. In fp32 the interpreter's adds, FMAs and divisions are IEEE, so that
statistic must equal, bit for bit, a plain-torch emulation of the order the
module docstrings describe (aten's thread mapping, accumulators and trees).
The GPU tests then check the same kernels' statistics against aten's own.
"""


import numpy as np
import pytest
import torch

from bitfuse.numerics import same_bits
from bitfuse.ops import layer_norm_modulate as LN
from bitfuse.ops import rms_norm_modulate as RMS
from bitfuse.ops._params import Folded
from interpreted import cpu_kernels, interpreter

EPS = 1e-6


# ---------------------------------------------------------------- guards


def test_cpu_tensors_take_the_reference():
    x, c, h = torch.randn(2, 8, 256), torch.randn(2, 1, 256), torch.randn(2, 1, 256)
    assert RMS.plan_rms_norm_modulate(x, c, h, EPS, "diffusers") == "CPU tensor"
    assert LN.plan_layer_norm_modulate(x, c, h, EPS) == "CPU tensor"
    out = RMS.rms_norm_modulate(x, c, h, EPS, "aten")
    assert same_bits(out, RMS.rms_norm_modulate_reference(x, c, h, EPS, "aten"))
    out = LN.layer_norm_modulate(x, c, h, EPS)
    assert same_bits(out, LN.layer_norm_modulate_reference(x, c, h, EPS))


def _plan(kind, x, c, h, exact=True):
    tier = "lossless" if exact else "high"
    with cpu_kernels():
        if kind == "ln":
            return LN.plan_layer_norm_modulate(x, c, h, EPS, tier=tier)
        return RMS.plan_rms_norm_modulate(x, c, h, EPS, kind, tier=tier)


def _reason(kind, x, c=None, h=None, exact=True):
    D = x.shape[-1]
    c = torch.randn(D) if c is None else c
    h = torch.randn(D) if h is None else h
    return _plan(kind, x, c, h, exact)


@pytest.mark.parametrize("kind", ["diffusers", "aten", "ln"])
def test_guard_reasons(kind):
    assert "multiple of 4" in _reason(kind, torch.randn(3, 1002))
    assert "2-D or 3-D" in _reason(kind, torch.randn(2, 2, 3, 256))
    assert _reason(kind, torch.randn(0, 256)) == "empty tensor"
    assert "last dimension" in _reason(kind, torch.randn(256, 8).t())
    assert "broadcast" in _reason(kind, torch.randn(4, 256), c=torch.randn(3, 256))
    assert "too wide" in _reason(kind, torch.randn(2, 32768))
    # high mode has no order to reproduce
    assert not isinstance(_reason(kind, torch.randn(3, 1002), exact=False), str)


@pytest.mark.parametrize("kind", ["aten", "ln"])
def test_misaligned_rows_take_the_reference(kind):
    buf = torch.randn(4 * 256 + 1)
    x = buf[1:].view(4, 256)  # contiguous, 4-byte aligned, not 16-byte: aten's scalar path
    assert "aligned" in _reason(kind, x)
    wide = torch.randn(4, 300)[:, :256]  # not contiguous: aten copies it, aligned
    assert not isinstance(_reason(kind, wide), str)


def test_diffusers_guard():
    assert "< 256" in _reason("diffusers", torch.randn(4, 128))
    # aten adds a block_y reduction for wide rows: not reproduced
    assert "across warps" in _reason("diffusers", torch.randn(16, 8192))
    assert "unknown" in _plan("apex", torch.randn(2, 256), torch.randn(256), torch.randn(256))


@pytest.mark.parametrize("D,N,bw", [
    (4096, 6144, 32), (4096, 16, 32), (4096, 9, 64), (4096, 5, 128), (3072, 3, 256), (3072, 2, 256),
    (4096, 1, 512), (1000, 20, 32), (1000, 1, 128), (256, 1, 64), (2048, 1, 512), (5120, 15, 64),
])
def test_mean_reduce_config(D, N, bw):
    """aten's setReduceConfig block width for mean(-1) of a [N, D] fp32 tensor."""
    assert RMS.mean_reduce_config(D, N) == (bw, None)


def test_mean_factor_is_float32_division():
    assert RMS.mean_factor(6144, 4096) == 2.0**-12
    f = RMS.mean_factor(7, 3072)
    assert f == float(torch.tensor(7.0) / torch.tensor(7.0 * 3072))


def test_gate_keys():
    x = torch.randn(2, 8, 1024)  # 16 rows: block width 32
    tab = torch.randn(2, 1, 6, 1024)
    p = _reason("diffusers", x, tab[:, :, 1], tab[:, :, 0])
    assert p.key[2:] == ("per-sample/strided", "per-sample/strided", "diffusers", "D=1024", "lanes=32")
    assert _reason("diffusers", x, tab[:, :, 1], tab[:, :, 0], exact=False).key[-1] == "one-pass"
    p = _reason("ln", x, torch.randn(2, 8, 1024), torch.randn(1024))
    assert p.key[2:] == ("per-token", "shared", "layer_norm", "D=1024", "welford")
    hash(p.key)


@pytest.mark.parametrize("family, D, warps", [("", 4096, 4), ("H100", 4096, 8), ("H100", 3072, 4), ("H100", 2048, 4),
                                              ("H100", 5120, 4), ("", 2240, 4), ("", 6144, 4)])
def test_layer_norm_high_warps_by_device_family(monkeypatch, family, D, warps):
    """The LayerNorm high kernel's warps per device family (the H100's slower memory
    hides its float64 arithmetic on 8 warps at 4096 columns; the H200 wants 4); a
    16-bit row, one a program. Rows held as tiles take their tile's warps (3072, 5120:
    tiles of 1024, 2240: of 512, 6144: of 2048, each on 4)."""
    monkeypatch.setattr(LN, "device_family", lambda device: family)
    x = torch.randn(2, 8, D, dtype=torch.bfloat16)
    plan = _reason("ln", x, torch.randn(2, 1, D, dtype=torch.bfloat16), torch.randn(D, dtype=torch.bfloat16),
                   exact=False)
    recipe = LN._recipe_of(plan)
    assert recipe.num_warps == warps and recipe.grid == (8, 2, 1)


# ---------------------------------------------------------------- emulations of aten's orders (plain torch, fp32)


def _vectors(x2d, lanes):
    """[N, D] -> [N, NJ, lanes, 4]: thread t of a row holds float4 vectors t, t+lanes, ...
    (zero-padded; adding +0 to a sum of squares is exact)."""
    N, D = x2d.shape
    nv = D // 4
    nj = -(-nv // lanes)
    v = torch.zeros(N, nj * lanes, 4, dtype=x2d.dtype)
    v[:, :nv] = x2d.reshape(N, nv, 4)
    return v.view(N, nj, lanes, 4)


def emulate_diffusers_mean(x2d, warp_inc=False):
    N, D = x2d.shape
    bw, _ = RMS.mean_reduce_config(D, N)
    v = _vectors(x2d.float() ** 2, bw)
    acc = torch.zeros(N, bw, 4)
    for j in range(v.shape[1]):
        acc = acc + v[:, j]
    a = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    while a.shape[1] > 32:  # shared-memory halving
        h = a.shape[1] // 2
        a = a[:, :h] + a[:, h:]
    while a.shape[1] > 1:  # warp shuffle-down
        if warp_inc:
            a = a[:, 0::2] + a[:, 1::2]
        else:
            h = a.shape[1] // 2
            a = a[:, :h] + a[:, h:]
    return a[:, 0] * RMS.mean_factor(N, D)


def emulate_aten_sigma2(x2d):
    """For inputs whose squares are exact in fp32 (fma(v, v, s) == s + v*v)."""
    N, D = x2d.shape
    v = _vectors(x2d.float(), 128)
    acc = torch.zeros(N, 128)
    for j in range(v.shape[1]):
        for e in range(4):
            acc = acc + v[:, j, :, e] * v[:, j, :, e]
    w = acc.view(N, 4, 32)
    while w.shape[2] > 1:
        h = w.shape[2] // 2
        w = w[:, :, :h] + w[:, :, h:]
    w = w[:, :, 0]
    total = (w[:, 0] + w[:, 2]) + (w[:, 1] + w[:, 3])
    return torch.div(total, torch.full_like(total, float(D)))


def _fma(a, b, c):
    """fp32 fma through float64 (the product is exact there)."""
    return (a.double() * b.double() + c.double()).float()


def _combine(B, A):
    """cuWelfordCombine(B, A) with nvcc's contractions (MEAN_V = 0, SIG_FMA)."""
    mB, sB, cB = B
    mA, sA, cA = A
    delta = mB - mA
    count = cA + cB
    coef = torch.div(torch.ones_like(count), count)
    nA, nB = cA * coef, cB * coef
    mean = _fma(nA, mA, nB * mB)
    m2 = _fma((delta * delta) * cA, nB, sA + sB)
    pos = count > 0
    return torch.where(pos, mean, 0.0), torch.where(pos, m2, 0.0), count


def emulate_layer_norm_mean(x2d):
    N, D = x2d.shape
    v = _vectors(x2d.float(), 128)
    nv = D // 4
    mean, m2 = torch.zeros(N, 128), torch.zeros(N, 128)
    lanes = torch.arange(128)
    for j in range(v.shape[1]):
        valid = (j * 128 + lanes) < nv
        for e in range(4):
            c = torch.tensor(4.0 * j + e + 1)
            rcp = torch.div(torch.ones(()), c)
            val = v[:, j, :, e]
            delta = val - mean
            nm = _fma(delta, rcp, mean)
            nm2 = _fma(delta, val - nm, m2)
            mean, m2 = torch.where(valid, nm, mean), torch.where(valid, nm2, m2)
    cnt = (4 * ((nv - lanes + 127) // 128).clamp(min=0)).float().expand(N, 128)
    st = [t.reshape(N, 4, 32) for t in (mean, m2, cnt)]
    while st[0].shape[2] > 1:
        h = st[0].shape[2] // 2
        st = list(_combine([t[:, :, :h] for t in st], [t[:, :, h:] for t in st]))
    st = [t[:, :, 0] for t in st]
    st = _combine([t[:, 0:2] for t in st], [t[:, 2:4] for t in st])
    st = _combine([t[:, 0] for t in st], [t[:, 1] for t in st])
    return st[0], st[1]


# ---------------------------------------------------------------- interpreter runs


def _rows(B, S, D, g, bf16_values=False):
    """Rows of every kind: normal, large, tiny variance, constant, offset mean."""
    x = torch.randn(B, S, D, generator=g)
    kind = torch.arange(B * S).reshape(B, S, 1) % 5
    x = torch.where(kind == 1, x * 300.0, x)
    x = torch.where(kind == 2, 3.0 + 1e-3 * x, x)
    x = torch.where(kind == 3, x[..., :1].expand_as(x), x)
    x = torch.where(kind == 4, 10.0 + x, x)
    return x.bfloat16().float() if bf16_values else x


def _params(layout, B, S, D, g):
    if layout == "per-sample/strided":
        tab = torch.randn(B, 1, 6, D, generator=g)
        return tab[:, :, 1], tab[:, :, 0]
    if layout == "per-token/strided":
        tab = torch.randn(B, S, 6, D, generator=g)
        return tab[:, :, 1], tab[:, :, 0]
    if layout == "shared":
        return torch.randn(D, generator=g), torch.randn(D, generator=g)
    if layout == "mixed":
        return torch.randn(B, S, D, generator=g), torch.randn(B, 1, D, generator=g)
    raise ValueError(layout)


SHAPES = [(1, 1, 1024), (2, 5, 256), (1, 3, 1000), (2, 9, 1024), (1, 20, 512)]
LAYOUTS = ["per-sample/strided", "per-token/strided", "shared", "mixed"]


def _launch(kind, x, c, h, exact, config=None, stats=None):
    plan = _plan(kind, x, c, h, exact)
    assert not isinstance(plan, str), plan
    launch = LN.launch_layer_norm_modulate if kind == "ln" else RMS.launch_rms_norm_modulate
    return launch(plan, config=config, stats=stats)


def _reference(kind, x, c, h):
    if kind == "ln":
        return LN.layer_norm_modulate_reference(x, c, h, EPS)
    return RMS.rms_norm_modulate_reference(x, c, h, EPS, kind)


@interpreter
@pytest.mark.parametrize("kind", ["diffusers", "aten", "ln"])
@pytest.mark.parametrize("B,S,D", SHAPES)
def test_reduction_order_matches_the_emulation(kind, B, S, D):
    """The kernel's per-row statistic equals the documented order's, bit for bit."""
    g = torch.Generator().manual_seed(B * 100 + S * 7 + D)
    x = _rows(B, S, D, g, bf16_values=kind != "ln")
    c, h = _params("per-sample/strided", B, S, D, g)
    stats = torch.full((B * S, 2), float("nan"))
    _launch(kind, x, c, h, True, stats=stats)
    x2d = x.reshape(-1, D)
    if kind == "diffusers":
        expect = emulate_diffusers_mean(x2d, RMS.WARP_INC)
    elif kind == "aten":
        expect = emulate_aten_sigma2(x2d)
    else:
        expect, m2 = emulate_layer_norm_mean(x2d)
        # rstd from the emulated m2, with the interpreter's rsqrt (numpy's 1 / sqrt)
        var = torch.div(m2, torch.tensor(float(D))) + torch.tensor(EPS, dtype=torch.float32)
        assert same_bits(stats[:, 1], torch.from_numpy(1 / np.sqrt(var.numpy())))
    assert same_bits(stats[:, 0], expect)


@interpreter
def test_the_emulations_tell_the_orders_apart():
    """Sanity: on these rows the alternative orders give other bits, so the test above
    would notice a kernel that summed in another order."""
    g = torch.Generator().manual_seed(0)
    x2d = _rows(1, 20, 1024, g, bf16_values=True).reshape(-1, 1024)
    assert not same_bits(emulate_diffusers_mean(x2d, False), emulate_diffusers_mean(x2d, True))
    assert not same_bits(emulate_diffusers_mean(x2d), x2d.pow(2).sum(-1) / 1024)
    assert not same_bits(emulate_aten_sigma2(x2d), emulate_diffusers_mean(x2d))


@interpreter
@pytest.mark.parametrize("kind", ["diffusers", "aten", "ln"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("B,S,D", SHAPES)
def test_fp32_indexing_and_broadcast(kind, layout, B, S, D):
    """Every parameter layout read in place; exact and high agree with eager in fp32
    (tolerance: eager's CPU reduction order is not the GPU's)."""
    g = torch.Generator().manual_seed(B * 1000 + S * 10 + D)
    x = torch.randn(B, S, D, generator=g)
    c, h = _params(layout, B, S, D, g)
    expect = _reference(kind, x, c, h)
    for exact in (True, False):
        out = _launch(kind, x, c, h, exact)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, expect, rtol=2e-5, atol=2e-5)


@interpreter
@pytest.mark.parametrize("kind", ["diffusers", "aten", "ln"])
def test_second_pass_variants_agree(kind):
    """Rows per program, warps and the three second passes (registers, reload,
    wide tiles) only move work between threads: identical bits."""
    g = torch.Generator().manual_seed(5)
    B, S, D = 2, 5, 1000
    x = _rows(B, S, D, g)
    c, h = _params("per-token/strided", B, S, D, g)
    lanes_warps = 4 if kind != "diffusers" else 1
    base = _launch(kind, x, c, h, True)
    for cfg in [(1, lanes_warps, 1), (2, 2 * lanes_warps, 0), (4, 4, 2), (1, 4, 2), (8, 4, 1)]:
        assert same_bits(_launch(kind, x, c, h, True, config=cfg), base), cfg
    xn = torch.randn(B, S, D, generator=g)  # well-conditioned rows for the one-pass kernel
    expect = _reference(kind, xn, c, h)
    for cfg in [(1, 4), (2, 8), (4, 4)]:
        torch.testing.assert_close(_launch(kind, xn, c, h, False, config=cfg), expect, rtol=2e-5, atol=2e-5)


@interpreter
@pytest.mark.parametrize("kind", ["diffusers", "aten", "ln"])
def test_rows_2d_and_non_dense(kind):
    g = torch.Generator().manual_seed(11)
    D = 512
    x = torch.randn(7, D, generator=g)  # [N, D]: rows map to S
    c, h = torch.randn(7, D, generator=g), torch.randn(D, generator=g)
    torch.testing.assert_close(_launch(kind, x, c, h, True), _reference(kind, x, c, h), rtol=2e-5, atol=2e-5)
    wide = torch.randn(2, 3, D + 40, generator=g)[..., 20:20 + D]  # rows strided, last dim dense
    c, h = torch.randn(2, 1, D, generator=g), torch.randn(2, 1, D, generator=g)
    torch.testing.assert_close(_launch(kind, wide, c, h, True), _reference(kind, wide, c, h), rtol=2e-5, atol=2e-5)


@interpreter
def test_output_buffer_is_fully_written():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 1000, generator=g)
    c, h = _params("per-sample/strided", 2, 3, 1000, g)
    for kind in ("diffusers", "aten", "ln"):
        for exact in (True, False):
            plan = _plan(kind, x, c, h, exact)
            out = torch.full_like(x, float("nan"))
            launch = LN.launch_layer_norm_modulate if kind == "ln" else RMS.launch_rms_norm_modulate
            assert launch(plan, out=out) is out
            assert not out.isnan().any(), (kind, exact)


def test_custom_ops_fake_shapes():
    x, c, h = torch.randn(2, 4, 256), torch.randn(2, 1, 256), torch.randn(256)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fc, fh = (mode.from_tensor(t) for t in (x, c, h))
        assert torch.ops.bitfuse.rms_norm_modulate(fx, fc, fh, EPS, "diffusers").shape == x.shape
        assert torch.ops.bitfuse.layer_norm_modulate(fx, fc, fh, EPS).shape == x.shape
        assert torch.ops.bitfuse.head_gate(fx, mode.from_tensor(torch.randn(2, 4, 2))).shape == x.shape


@pytest.mark.parametrize("op", ["modulate", "gated_residual", "head_gate", "rms_norm_modulate", "layer_norm_modulate",
                                "rotary"])
def test_custom_ops_say_they_have_no_backward(op):
    """torch.ops.bitfuse.* are for inference: the forward runs, backward says why not."""
    x = torch.randn(2, 4, 256, requires_grad=True)
    c, h = torch.randn(2, 1, 256), torch.randn(256)
    args = {"modulate": (x, c, h), "gated_residual": (x, x, c), "head_gate": (x, torch.randn(2, 4, 2)),
            "rms_norm_modulate": (x, c, h, EPS, "aten"),
            "layer_norm_modulate": (x, c, h, EPS), "rotary": (x, torch.ones(1, 4, 256), torch.zeros(1, 4, 256),
                                                              "interleaved")}[op]
    out = getattr(torch.ops.bitfuse, op)(*args)
    with pytest.raises(RuntimeError, match=f"torch.ops.bitfuse.{op} has no backward"):
        out.sum().backward()


@interpreter
@pytest.mark.parametrize("kind", ["diffusers", "aten"])
def test_norm_alone_is_the_fused_kernels_n(kind):
    """plan_rms_norm writes the n the modulate kernel uses: with scale = shift = 0 the
    fused output is n itself (fp32: n * 1 + 0 == n)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 5, 256, generator=g)
    with cpu_kernels():
        plan = RMS.plan_rms_norm(x, EPS, kind)
    assert not plan.modulate and plan.key[2:] == (kind, "D=256", f"lanes={plan.lanes}")
    n = RMS.launch_rms_norm_modulate(plan)
    zeros = torch.zeros(256)
    assert same_bits(n, _launch(kind, x, zeros, zeros, True))
    torch.testing.assert_close(n, RMS.rms_norm_reference(x, EPS, kind), rtol=2e-5, atol=2e-5)


@interpreter
@pytest.mark.parametrize("kind", ["diffusers", "aten", "ln"])
@pytest.mark.parametrize("T", [1, 5])
def test_folded_parameters_in_both_kernels(kind, T):
    """Folded (table row, temb) scale/shift give the bits the materialised sum gives,
    in the exact kernel's second-pass variants and in the one-pass kernel."""
    g = torch.Generator().manual_seed(T)
    B, S, D = 2, 5, 256
    x = torch.randn(B, S, D, generator=g)
    table = torch.randn(6, D, generator=g)
    t4 = torch.randn(B, T, 6 * D, generator=g).reshape(B, T, 6, D)
    scale, shift = Folded(table[1], t4[:, :, 1]), Folded(table[0], t4[:, :, 0])
    for exact in (True, False):
        plan = _plan(kind, x, scale, shift, exact)
        assert not isinstance(plan, str) and "+table" in plan.key[2], plan
        eager = _plan(kind, x, scale.value(), shift.value(), exact)
        for config in ((None, (2, 2, 1), (1, 4, 0)) if exact else (None,)):
            launch = LN.launch_layer_norm_modulate if kind == "ln" else RMS.launch_rms_norm_modulate
            assert same_bits(launch(plan, config=config), launch(eager, config=config))


@interpreter
@pytest.mark.parametrize("kind", ["diffusers", "aten", "ln"])
def test_one_pass_kernels_stay_accurate_where_squares_overflow(kind):
    """Rows near the top of the range (the fuzz run's "large" draw): x * x overflows
    fp32, as in eager; the one-pass kernels stay accurate against float64 (the high
    contract), where a plain fp32 sum of squares gives 0: the RMSNorm kernels reduce a
    power-of-two-scaled row, the LayerNorm kernel sums the squares in float64."""
    from bitfuse.ops._norm import layer_norm64, modulated64, rms_norm64

    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 512, generator=g) * 1e30
    x[1, 2] /= 1e30  # an ordinary row beside them
    c, h = _params("per-sample/strided", 2, 3, 512, g)
    out = _launch(kind, x, c, h, False)
    n64 = layer_norm64(x, EPS) if kind == "ln" else rms_norm64(x, EPS)
    torch.testing.assert_close(out.double(), modulated64(n64, c, h), rtol=1e-5, atol=1e-5)


@interpreter
def test_layer_norm_high_mean_holds_a_large_offset():
    """Rows far from zero (x = 4096 + randn, fp32): the high kernel's mean, from a
    float64 sum as two fp32 terms, keeps x - mean accurate to about 2**-24 of
    the centred values, where a plain fp32 mean is off by about 2**-24 of the row's
    sum of |x| (1.8e-4 here)."""
    from bitfuse.ops._norm import layer_norm64, modulated64

    g = torch.Generator().manual_seed(3)
    x = 4096.0 + torch.randn(2, 5, 1000, generator=g)
    c, h = torch.zeros(1000), torch.zeros(1000)  # the normalised values are the whole output
    out = _launch("ln", x, c, h, False)
    err = (out.double() - modulated64(layer_norm64(x, EPS), c, h)).abs().max().item()
    assert err < 1e-5, err


@interpreter
@pytest.mark.parametrize("D,tile", [(1536, 512), (3072, 1024), (2240, 512)])
@pytest.mark.parametrize("layout", LAYOUTS + ["folded"])
def test_layer_norm_high_rows_as_tiles(D, tile, layout):
    """A row held as power-of-two tiles (1536, 3072: unmasked; 2240: the last of five
    masked) gives the padded launch's bits (rows of bf16 values in fp32, whose float64
    sums are exact in any order), into a NaN-poisoned output, on every parameter
    layout."""
    g = torch.Generator().manual_seed(D + len(layout))
    B, S = 2, 3
    x = torch.randn(B, S, D, generator=g).bfloat16().float()
    x[1, 2] += 300.0  # a row far from zero: the two-term mean
    if layout == "folded":
        table, t4 = torch.randn(6, D, generator=g), torch.randn(B, 1, 6, D, generator=g)
        c, h = Folded(table[1], t4[:, :, 1]), Folded(table[0], t4[:, :, 0])
    else:
        c, h = _params(layout, B, S, D, g)
    plan = _plan("ln", x, c, h, exact=False)
    assert LN.high_tiles(D) == (tile, -(-D // tile)) == LN._recipe_of(plan).consts[1:3]
    tiled = torch.full_like(x, float("nan"))
    LN.launch_layer_norm_modulate(plan, out=tiled)
    padded = LN.launch_layer_norm_modulate(plan, config=(1, 4, 1 << (D - 1).bit_length()))
    assert same_bits(tiled, padded)
    from bitfuse.ops._norm import layer_norm64, modulated64

    want = modulated64(layer_norm64(x, EPS), c, h)
    torch.testing.assert_close(tiled.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D,tiles", [(4096, (4096, 1)), (3072, (1024, 3)), (5120, (1024, 5)), (1536, (512, 3)),
                                     (6144, (2048, 3)), (14336, (2048, 7)), (2240, (512, 5)), (1152, (512, 3)),
                                     (768, (1024, 1)), (1000, (1024, 1)), (2048, (2048, 1)), (9216, (2048, 5)), (12000, (4096, 3)), (16384, (16384, 1))])
def test_high_tiles(D, tiles):
    """2-7 power-of-two tiles (>= 512 columns) where they hold fewer lanes than the padded
    row, the wider tile of equal counts; anything else one padded tile."""
    assert LN.high_tiles(D) == tiles
