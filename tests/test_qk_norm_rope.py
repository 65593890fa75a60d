"""Fused query/key RMSNorm + RoPE on the CPU: the references against diffusers, the
guard's reasons, the probes, the sites' dispatch and fallback, LTX-2 routed through
the site; under Triton's interpreter (fp32), indexing, masks, both sources and the
concatenation, strided views, and the reduction ORDER.

The order check, as tests/test_norm_ops_cpu.py does it: the kernel writes each row's
statistic (aten: sigma2 / NW; diffusers: the mean) and rsqrt to a side buffer; in
fp32 the interpreter's adds, FMAs and divisions are IEEE, so the statistic must equal
a plain-torch emulation of the reference's order bit for bit, and the output must
equal the emulated norm and rotation computed from the kernel's rsqrt (the
interpreter's rsqrt is numpy's, not CUDA's). The GPU tests compare with aten itself.
"""


import pytest
import torch

from bitfuse import policy, sites
from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, cases
from bitfuse.ops import _params as params_module
from bitfuse.ops import qk_norm_rope as Q
from bitfuse.ops.rms_norm_modulate import mean_factor, mean_reduce_config
from bitfuse.ops.rotary import addcmul_fuses
from interpreted import interpreter

EPS = 1e-6


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Plans for CPU tensors (the kernels run in Triton's interpreter), with the
    diffusers order of 128-wide rows and the complex multiply's rounding set as a GPU's
    (the CPU's own differ; tests below set the other forms)."""
    monkeypatch.setattr(params_module, "INTERPRET_ON_CPU", True)
    monkeypatch.setitem(Q._MEAN_128, -1, (True, False))
    monkeypatch.setitem(Q._COMPLEX_FORM, -1, (0, 0))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows(shape, g):
    """Rows of every kind: normal, large, tiny variance, constant, zero (of both signs);
    full fp32 mantissas, so that sums of squares round (and orders show)."""
    x = torch.randn(*shape, generator=g)
    kind = torch.randint(0, 6, (*shape[:-1], 1), generator=g)
    x = torch.where(kind == 1, x * 300.0, x)
    x = torch.where(kind == 2, 3.0 + 1e-3 * x, x)
    x = torch.where(kind == 3, x[..., :1].expand_as(x), x)
    x = torch.where(kind == 4, x * 0.0, x)  # zero rows, signs kept
    x = torch.where(torch.rand(shape, generator=g) < 0.1, x * 0.0, x)  # scattered signed zeros
    return x


def _weight(n, g):
    return (torch.randn(n, generator=g) * 0.5 + 1).bfloat16().float()


def _angles(shape, g, zeros=True):
    theta = torch.rand(*shape, generator=g) * 40 - 20
    cos, sin = theta.cos(), theta.sin()
    if zeros:  # exact zeros of both signs in the tables too
        cos = torch.where(torch.rand(shape, generator=g) < 0.1, cos * 0.0, cos)
        sin = torch.where(torch.rand(shape, generator=g) < 0.1, -sin * 0.0, sin)
    return cos, sin


# ---------------------------------------------------------------- the references are diffusers'


def test_references_are_diffusers():
    ltx2 = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    g = _gen(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 7, 24, generator=g).to(dtype)
        f = _angles((2, 7, 24), g)
        assert same_bits(Q.rope_reference(x, f, "interleaved"), ltx2.apply_interleaved_rotary_emb(x, f))
        f = tuple(t.swapaxes(1, 2) for t in _angles((2, 7, 3, 4), g))
        assert same_bits(Q.rope_reference(x, f, "split"), ltx2.apply_split_rotary_emb(x, f))
        xh = torch.randn(2, 7, 3, 16, generator=g).to(dtype)
        f = _angles((7, 16), g)
        assert same_bits(Q.rope_reference(xh, f, "interleaved"), apply_rotary_emb(xh, f, sequence_dim=1))
        fc = torch.polar(torch.ones(7, 8), torch.rand(7, 8, generator=g) * 6)
        assert same_bits(Q.rope_reference(xh, fc, "complex"), apply_rotary_emb_qwen(xh, fc, use_real=False))
        for affine in (True, False):
            norm = torch.nn.RMSNorm(16, eps=EPS, elementwise_affine=affine).to(dtype)
            dnorm = RMSNorm(16, eps=EPS, elementwise_affine=affine).to(dtype)
            if affine:
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(16, generator=g))
                    dnorm.weight.copy_(torch.randn(16, generator=g))
            with torch.no_grad():
                assert same_bits(Q.rms_norm_reference(xh, norm.weight, EPS, "aten"), norm(xh))
                assert same_bits(Q.rms_norm_reference(xh, dnorm.weight, EPS, "diffusers"), dnorm(xh))


def test_op_reference_is_the_processors_sequence():
    """FLUX rotates after the concatenation, Qwen-Image before: the op's reference
    (per source, then concatenated) gives the same bits as both."""
    g = _gen(1)
    q = [torch.randn(2, n, 3, 16, generator=g).bfloat16() for n in (3, 5)]
    k = [torch.randn(2, n, 3, 16, generator=g).bfloat16() for n in (3, 5)]
    w = tuple((_weight(16, g).bfloat16(), _weight(16, g).bfloat16()) for _ in range(2))
    cos, sin = _angles((8, 16), g)
    freqs = tuple(((cos[a:b], sin[a:b]),) * 2 for a, b in ((0, 3), (3, 8)))
    got = Q.qk_norm_rope_reference(tuple(q), tuple(k), w, EPS, freqs, "interleaved", "aten")
    nq = torch.cat([Q.rms_norm_reference(x, wi[0], EPS, "aten") for x, wi in zip(q, w)], 1)
    nk = torch.cat([Q.rms_norm_reference(x, wi[1], EPS, "aten") for x, wi in zip(k, w)], 1)
    assert same_bits(got[0], Q.rope_reference(nq, (cos, sin), "interleaved"))
    assert same_bits(got[1], Q.rope_reference(nk, (cos, sin), "interleaved"))


# ---------------------------------------------------------------- the guard


def _plan(*args):
    return Q.plan_qk_norm_rope(*args)


def _ltx_args(B=2, S=5, C=256, g=None, rope="interleaved", norm="aten", Sk=None):
    g = g or _gen(2)
    Sk = Sk or S
    q, k = torch.randn(B, S, C, generator=g), torch.randn(B, Sk, C, generator=g)
    w = (_weight(C, g), _weight(C, g))
    if rope == "split":
        fq = tuple(t.swapaxes(1, 2) for t in _angles((B, S, C // 64, 32), g))
        fk = fq if Sk == S else tuple(t.swapaxes(1, 2) for t in _angles((B, Sk, C // 64, 32), g))
    elif rope == "interleaved":
        fq = _angles((B, S, C), g)
        fk = fq if Sk == S else _angles((B, Sk, C), g)
    else:
        return (q,), (k,), (w,), EPS, None, None, norm
    return (q,), (k,), (w,), EPS, ((fq, fk),), rope, norm


def test_guard_reasons(cpu_kernels, monkeypatch):
    args = list(_ltx_args())
    assert not isinstance(_plan(*args), str)

    def why(i, value):
        a = list(args)
        a[i] = value
        return _plan(*a)

    q, k = args[0][0], args[1][0]
    w = args[2][0]
    f = args[4][0]
    assert "unknown norm" in why(6, "apex")
    assert "unknown rope_type" in why(5, "spiral")
    assert "one or two sources" in why(0, (q, q, q))
    assert "mixed dtypes" in why(1, (k.double(),))
    assert "weight dtype differs" in why(2, ((w[0].bfloat16(), w[1]),))
    assert "must be [256]" in why(2, ((w[0][:128], w[1]),))
    assert "some norms have a weight" in why(2, ((w[0], None),))
    assert "not contiguous" in why(2, ((torch.randn(512)[::2], w[1]),))
    assert "4-element aligned" in why(2, ((torch.randn(257)[1:], w[1]),))
    assert "float32" in why(4, (((f[0][0].double(), f[0][1].double()), f[1]),))
    assert "freqs given without a rope_type" in why(5, None)
    assert "must be [B or 1, S, C]" in why(4, (((f[0][0][:, :4], f[0][1][:, :4]), f[1]),))
    assert "strides differ" in why(4, (((f[0][0], f[0][1].transpose(0, 1).contiguous().transpose(0, 1)), f[1]),))
    assert "last dimension is not contiguous" in why(0, (q.transpose(1, 2).contiguous().transpose(1, 2),))
    assert "empty tensor" in why(0, (q[:, :0],))
    assert "4-element aligned" in why(0, (torch.randn(2 * 5 * 256 + 1)[1:].view(2, 5, 256),))
    assert "multiple of 4" in _plan((q[..., :254],), (k[..., :254],), None, EPS, None, None, "aten")
    assert "odd channel count" in _plan((q[..., :255],), (k[..., :255],), None, EPS,
                                         ((_angles((2, 5, 255), _gen(0)),) * 2,), "interleaved", "diffusers")
    assert "too wide" in _plan((torch.randn(1, 2, 32768),), (torch.randn(1, 2, 32768),), None, EPS, None, None,
                               "aten")
    assert "< 256" in _plan((torch.randn(1, 20, 200),), (torch.randn(1, 20, 200),), None, EPS, None, None,
                            "diffusers")
    assert "narrower than a warp" in _plan((torch.randn(1, 20, 16),), (torch.randn(1, 20, 16),), None, EPS, None,
                                           None, "diffusers")
    split = _ltx_args(rope="split")
    assert not isinstance(_plan(*split), str)
    assert "x is not [B, S, 2 * H * r]" in _plan((q[..., :128],), (k[..., :128],), None, EPS, split[4], "split",
                                                  "aten")
    # a weight that requires grad, under autograd: eager's graph
    wg = w[0].clone().requires_grad_()
    assert "autograd" in why(2, ((wg, w[1]),))
    with torch.no_grad():
        assert not isinstance(why(2, ((wg, w[1]),)), str)
    # the 128-wide diffusers order is the running build's: unknown -> the reference
    monkeypatch.setitem(Q._MEAN_128, -1, None)
    assert "not known here" in _plan((torch.randn(1, 4, 2, 128),), (torch.randn(1, 4, 2, 128),), None, EPS, None,
                                     None, "diffusers")
    monkeypatch.setitem(Q._COMPLEX_FORM, -1, None)
    fc = torch.polar(torch.ones(4, 64), torch.rand(4, 64))
    xh = torch.randn(1, 4, 2, 128)
    assert "complex multiply" in _plan((xh,), (xh,), None, EPS, ((fc, fc),), "complex", "aten")


def test_cpu_tensors_take_the_reference():
    args = _ltx_args()
    assert _plan(*args) == "CPU tensor"
    got = Q.qk_norm_rope(*args)
    assert all(same_bits(a, b) for a, b in zip(got, Q.qk_norm_rope_reference(*args)))


def test_gate_keys(cpu_kernels):
    plan = _plan(*_ltx_args())
    assert plan.key[2:] == ("aten", "interleaved", "NW=256", "G=1", "1 source", "q+k paired", "weight", "ref=1/128")
    plan = _plan(*_ltx_args(Sk=3, rope=None))
    assert plan.key[3:] == ("none", "NW=256", "G=1", "1 source", "q, k apart", "weight", "ref=1/128")
    hash(plan.key)


@pytest.mark.parametrize("D,N,bw", [(128, 6144, 32), (128, 16, 32), (128, 8, 64), (128, 1, 128), (64, 20, 32),
                                    (100, 20, 32), (96, 3, 64)])
def test_scalar_mean_config(D, N, bw):
    """setReduceConfig's block width for rows it does not vectorise."""
    assert Q._scalar_mean_config(D, N) == bw


# ---------------------------------------------------------------- the probes


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def _fma(a, b, c):
    """fp32 fma through float64 (the product of two floats is exact there)."""
    return (a.double() * b.double() + c.double()).float()


def _rotate(a, b, ca, sa, cb, sb, real, imag):
    """(a*ca - b*sa, b*cb + a*sb) with the kernel's REAL_FMA / IMAG_FMA forms."""
    oa = {0: a * ca - b * sa, 1: _fma(a, ca, -(b * sa)), 2: _fma(-b, sa, a * ca)}[real]
    ob = {0: b * cb + a * sb, 1: _fma(a, sb, b * cb), 2: _fma(b, cb, a * sb)}[imag]
    return oa, ob


def test_complex_probe_tells_every_form_apart():
    """The probe's inputs: each (real, imaginary) form gives its own bits, and the
    (1+1i)^2 element a real part of +0.0; the CPU's own multiply is one of the forms."""
    u, w = 1 + 2**-12, 1 + 2**-13
    x = [(_f32(u), _f32(w)), (_f32(u), _f32(w)), (_f32(1.0), _f32(1.0))]
    f = [(_f32(u), _f32(w)), (_f32(-w), _f32(u)), (_f32(1.0), _f32(1.0))]
    seen = set()
    for real in range(3):
        for imag in range(3):
            out = [_rotate(a, b, c, d, c, d, real, imag) for (a, b), (c, d) in zip(x, f)]
            assert out[2][0].item() == 0 and not torch.signbit(out[2][0])
            seen.add((out[0][0].item(), out[1][1].item()))
    assert len(seen) == 9
    assert Q.complex_mul_form(-1) in {(r, i) for r in range(3) for i in range(3)}


def test_mean_probe_candidates_differ():
    """On the probe's rows the four candidate orders of a 128-wide mean give pairwise
    different bits, so at most one can match the device's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g) * torch.rand(512, 1, generator=g).mul(8).exp2()
    means = list(Q._emulated_means_128(x).values())
    assert all(not torch.equal(means[i], means[j]) for i in range(4) for j in range(i + 1, 4))


# ---------------------------------------------------------------- emulations of the references' orders (fp32)


def _aten_sigma2(x2d):
    """vectorized_layer_norm_kernel's sigma2 / N: 128 threads over float4 vectors, each
    sigma2 = fma(v, v, sigma2), warp shuffle-down, (w0 + w2) + (w1 + w3)."""
    N, D = x2d.shape
    nv = D // 4
    nj = -(-nv // 128)
    v = torch.zeros(N, nj * 128, 4)
    v[:, :nv] = x2d.reshape(N, nv, 4)
    v = v.view(N, nj, 128, 4)
    acc = torch.zeros(N, 128)
    for j in range(nj):
        for e in range(4):
            acc = _fma(v[:, j, :, e], v[:, j, :, e], acc)
    w = acc.view(N, 4, 32)
    while w.shape[2] > 1:
        h = w.shape[2] // 2
        w = w[:, :, :h] + w[:, :, h:]
    w = w[:, :, 0]
    total = (w[:, 0] + w[:, 2]) + (w[:, 1] + w[:, 3])
    return torch.div(total, torch.full_like(total, float(D)))


def _tree(a, warp_inc):
    while a.shape[1] > 32:  # shared-memory halving
        h = a.shape[1] // 2
        a = a[:, :h] + a[:, h:]
    while a.shape[1] > 1:
        h = a.shape[1] // 2
        a = a[:, 0::2] + a[:, 1::2] if warp_inc else a[:, :h] + a[:, h:]
    return a[:, 0]


def _diffusers_mean(x2d, vectorised, warp_inc=False):
    N, D = x2d.shape
    sq = x2d * x2d
    if vectorised:
        bw = 32 if D == 128 else mean_reduce_config(D, N)[0]
        nv = D // 4
        nj = -(-nv // bw)
        v = torch.zeros(N, nj * bw, 4)
        v[:, :nv] = sq.reshape(N, nv, 4)
        acc = torch.zeros(N, bw, 4)
        for j in range(nj):
            acc = acc + v.view(N, nj, bw, 4)[:, j]
    else:
        bw = Q._scalar_mean_config(D, N)
        nm = -(-D // bw)
        pad = torch.zeros(N, nm * bw)
        pad[:, :D] = sq
        acc = torch.zeros(N, bw, 4)
        for m in range(nm):
            acc[:, :, m % 4] = acc[:, :, m % 4] + pad[:, m * bw:(m + 1) * bw]
    a = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    return _tree(a, warp_inc) * mean_factor(N, D)


def _emulated_output(args, stats, rope_form):
    """The op's output from the kernel's per-row rsqrt: the norm's products in fp32, the
    rotation in `rope_form` (REAL_FMA, IMAG_FMA), then the concatenation."""
    queries, keys, weights, _, freqs, rope_type, _ = args
    n = len(queries)
    xs = list(queries) + list(keys)
    ws = [None] * (2 * n) if weights is None else [w[0] for w in weights] + [w[1] for w in weights]
    fs = [None] * (2 * n) if freqs is None else [f[0] for f in freqs] + [f[1] for f in freqs]
    outs, row = [], 0
    for x, w, f in zip(xs, ws, fs):
        rows = x.numel() // x.shape[-1]
        r = stats[row:row + rows, 1].reshape(*x.shape[:-1], 1)
        row += rows
        y = x * r if w is None else (x * r) * w
        if rope_type in ("interleaved", "pairs"):
            y = Q.rope_reference(y, f, rope_type)
        elif rope_type == "split":
            cos, sin = f
            b, h, t, rr = cos.shape
            ys = y.reshape(b, t, h, 2, rr).swapaxes(1, 2)
            oa, ob = _rotate(ys[..., 0, :], ys[..., 1, :], cos, sin, cos, sin, *rope_form)
            y = torch.stack([oa, ob], -2).swapaxes(1, 2).reshape(y.shape)
        elif rope_type == "complex":
            c, s = f.real[None, :, None, :], f.imag[None, :, None, :]
            oa, ob = _rotate(y[..., 0::2], y[..., 1::2], c, s, c, s, *rope_form)
            y = torch.stack([oa, ob], -1).flatten(3)
        outs.append(y)
    return (torch.cat(outs[:n], 1), torch.cat(outs[n:], 1)) if n > 1 else (outs[0], outs[1])


def _run(args, config=None):
    plan = _plan(*args)
    assert not isinstance(plan, str), plan
    rows = sum(x.numel() // x.shape[-1] for x in list(args[0]) + list(args[1]))
    stats = torch.full((rows, 2), float("nan"))
    ref = Q.qk_norm_rope_reference(*args)
    out = tuple(torch.full_like(r, float("nan")) for r in ref)
    assert Q.launch_qk_norm_rope(plan, out=out, config=config, stats=stats) is out
    return plan, out, stats


def _check(args, config=None, warp_inc=False):
    """The kernel's statistic is the reference order's, and its output the emulation's."""
    plan, out, stats = _run(args, config)
    norm = args[6]
    xs = list(args[0]) + list(args[1])
    expect = []
    for x in xs:
        x2d = x.reshape(-1, x.shape[-1])
        if norm == "aten":
            expect.append(_aten_sigma2(x2d))
        else:
            expect.append(_diffusers_mean(x2d, plan.order[0] == 0, warp_inc))
    assert same_bits(stats[:, 0], torch.cat(expect)), "per-row statistic: not the reference's order"
    emulated = _emulated_output(args, stats, plan.rope[2:])
    for o, e in zip(out, emulated):
        assert same_bits(o, e)
    return plan, out


# ---------------------------------------------------------------- interpreter runs


@interpreter
@pytest.mark.parametrize("norm", ["aten", "diffusers"])
@pytest.mark.parametrize("rope", ["interleaved", "split", None])
@pytest.mark.parametrize("B,S,Sk,C", [(2, 5, 5, 256), (1, 3, 7, 512), (2, 1, 1, 1024), (1, 6, 2, 256)])
def test_ltx_layouts_exact(cpu_kernels, norm, rope, B, S, Sk, C):
    """[B, S, C] rows normed over C: self-attention (q and k paired), cross-attention
    (k of another length, its own frequencies), no RoPE; statistic and output exact."""
    g = _gen(B * 1000 + S * 100 + Sk * 10 + C)
    args = list(_ltx_args(B, S, C, g, rope or "none", norm, Sk))
    args[0] = (_rows((B, S, C), g),)
    args[1] = (_rows((B, Sk, C), g),)
    plan, _ = _check(tuple(args))
    assert plan.geometry.members == (2 if S == Sk else 1)


@interpreter
def test_strided_views_of_a_fused_projection(cpu_kernels):
    """q and k as views of one [B, S, 3C] qkv output (and padded rows), read in place."""
    g = _gen(7)
    B, S, C = 2, 5, 256
    qkv = _rows((B, S, 3 * C), g)
    q, k, _ = qkv.chunk(3, dim=-1)
    f = _angles((B, S, C), g)
    args = ((q,), (k,), ((_weight(C, g), _weight(C, g)),), EPS, ((f, f),), "interleaved", "aten")
    _check(args)
    split = tuple(t.swapaxes(1, 2) for t in _angles((B, S, C // 64, 32), g))
    _check(((q,), (k,), args[2], EPS, ((split, split),), "split", "aten"))


@interpreter
@pytest.mark.parametrize("layout", ["flux", "qwen"])
@pytest.mark.parametrize("warp_inc", [False, True])
def test_joint_sources_exact(cpu_kernels, monkeypatch, layout, warp_inc):
    """Two sources of per-head rows [B, S_i, H, 128], normed with their own weights,
    rotated, and written at their offsets in the concatenated output."""
    g = _gen(11 + warp_inc)
    monkeypatch.setitem(Q._MEAN_128, -1, (True, warp_inc))
    B, St, Si, H = 2, 3, 7, 3
    q = tuple(_rows((B, n, H, 128), g) for n in (St, Si))
    k = tuple(_rows((B, n, H, 128), g) for n in (St, Si))
    w = tuple((_weight(128, g), _weight(128, g)) for _ in range(2))
    if layout == "flux":
        cos, sin = (t.repeat_interleave(2, -1) for t in _angles((St + Si, 64), g))
        freqs = (((cos[:St], sin[:St]),) * 2, ((cos[St:], sin[St:]),) * 2)
        args = (q, k, w, EPS, freqs, "interleaved", "aten")
    else:
        freqs = tuple((torch.complex(*_angles((n, 64), g)),) * 2 for n in (St, Si))
        args = (q, k, w, EPS, freqs, "complex", "diffusers")
    plan, out = _check(args, warp_inc=warp_inc)
    assert out[0].shape == (B, St + Si, H, 128) and plan.geometry.members == 2


@interpreter
@pytest.mark.parametrize("vectorised", [True, False])
def test_diffusers_orders_of_128_wide_rows(cpu_kernels, monkeypatch, vectorised):
    """Both candidate orders of the 128-wide mean, as the probe may find them, and the
    narrower blocks aten uses for few rows (N < 16: 64 or 128 lanes, shared memory)."""
    for N, seed in ((10, 0), (3, 1), (1, 2), (40, 3)):
        monkeypatch.setitem(Q._MEAN_128, -1, (vectorised, False))
        g = _gen(seed)
        x = _rows((1, N, 1, 128), g)
        plan, _ = _check(((x,), (x.clone(),), ((_weight(128, g), _weight(128, g)),), EPS, None, None, "diffusers"))
        assert plan.order[0] == (0 if vectorised else 2)


@interpreter
def test_complex_forms(cpu_kernels, monkeypatch):
    """Each way eager's complex multiply may round, as the probe reports it."""
    g = _gen(13)
    x = _rows((1, 5, 2, 128), g)
    f = torch.complex(*_angles((5, 64), g))
    for form in ((0, 0), (1, 1), (2, 2), (1, 2), (2, 0)):
        monkeypatch.setitem(Q._COMPLEX_FORM, -1, form)
        plan, _ = _check(((x,), (x * 2,), None, EPS, ((f, f),), "complex", "aten"))
        assert plan.rope == (3, 0, *form)


@interpreter
def test_split_follows_addcmul(cpu_kernels):
    plan = _plan(*_ltx_args(rope="split"))
    fused = addcmul_fuses(-1)
    assert plan.rope[2:] == ((2, 1) if fused else (0, 0))


@interpreter
def test_launch_shapes_agree(cpu_kernels):
    """Rows a program, chunk width and warps move work between threads: identical bits."""
    g = _gen(17)
    args = list(_ltx_args(2, 5, 1024, g))
    args[0], args[1] = (_rows((2, 5, 1024), g),), (_rows((2, 5, 1024), g),)
    base = _run(tuple(args))[1]
    for config in ((1, 256, 4), (4, 1024, 8), (2, 512, 2)):
        assert all(same_bits(a, b) for a, b in zip(_run(tuple(args), config)[1], base)), config


@interpreter
@pytest.mark.parametrize("data", cases.DATA)
def test_spec_layouts_on_every_data_draw(cpu_kernels, data):
    """The declaration end to end (make_args, plan, launch into poisoned outputs), every
    layout and data draw incl. signed zeros, subnormals, NaN/inf, outliers, strided x."""
    for i, layout in enumerate(SPECS["qk_norm_rope"].layouts):
        for strided in (False, True):
            case = cases.Case(2, 5, 256, torch.float32, layout, data, seed=i, device="cpu", strided=strided)
            args = SPECS["qk_norm_rope"].make_args(case)
            _, out, stats = _run(args)
            for o, e in zip(out, _emulated_output(args, stats, _plan(*args).rope[2:])):
                assert same_bits(o, e), (layout, strided)


# ---------------------------------------------------------------- the sites


def _ltx_norms(C, g, cls=torch.nn.RMSNorm, eps=EPS, affine=True):
    norms = [cls(C, eps=eps, elementwise_affine=affine) for _ in range(2)]
    if affine:
        with torch.no_grad():
            for n in norms:
                n.weight.copy_(_weight(C, g))
    return norms


def _eager_ltx(nq, nk, q, k, fq, fk, rope):
    from bitfuse.ops.rotary import rotary_reference
    q, k = nq(q), nk(k)
    if rope is None:
        return q, k
    return rotary_reference(q, fq, rope), rotary_reference(k, fk if fk is not None else fq, rope)


@pytest.fixture
def recorded(monkeypatch):
    """policy.gated records the op arguments a site built and returns the op's reference."""
    calls = []

    def gated(spec, tier, plan, args, fallback=None, site_key=None):
        calls.append((spec.name, tier, plan, args))
        return spec.reference(*args)

    monkeypatch.setattr(policy, "gated", gated)
    return calls


@pytest.mark.parametrize("rope", ["interleaved", "split", None])
@pytest.mark.parametrize("Sk", [5, 3])
def test_qk_site_builds_the_eager_call(cpu_kernels, recorded, rope, Sk):
    g = _gen(19)
    C = 256
    _, _, _, _, freqs, _, _ = _ltx_args(2, 5, C, g, rope or "none", Sk=Sk)
    q, k = torch.randn(2, 5, C, generator=g), torch.randn(2, Sk, C, generator=g)
    nq, nk = _ltx_norms(C, g)
    fq, fk = (None, None) if freqs is None else freqs[0]
    with torch.no_grad():
        got = sites.qk_norm_rope_site(nq, nk, q, k, fq, fk if Sk != 5 else None, rope)
        want = _eager_ltx(nq, nk, q, k, fq, fk, rope)
    assert [c[:2] for c in recorded] == [("qk_norm_rope", "lossless")]
    assert all(same_bits(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("layout", ["flux", "qwen", "flux-single"])
def test_joint_site_builds_the_eager_call(cpu_kernels, recorded, layout):
    from diffusers.models.normalization import RMSNorm

    g = _gen(23)
    cls = RMSNorm if layout == "qwen" else torch.nn.RMSNorm
    lengths = (5,) if layout == "flux-single" else (3, 5)
    sources = []
    for n in lengths:
        nq, nk = _ltx_norms(128, g, cls)
        sources.append((nq, nk, torch.randn(2, n, 3, 128, generator=g), torch.randn(2, n, 3, 128, generator=g)))
    if layout == "qwen":
        freqs, rope = [torch.complex(*_angles((n, 64), g)) for n in lengths], "complex"
    else:
        freqs, rope = _angles((sum(lengths), 128), g), "interleaved"
    with torch.no_grad():
        got = sites.joint_qk_norm_rope_site(sources, freqs, rope)
        # the processors' own sequence
        qs, ks = [s[0](s[2]) for s in sources], [s[1](s[3]) for s in sources]
        if rope == "complex":
            qs = [Q.rope_reference(q, f, "complex") for q, f in zip(qs, freqs)]
            ks = [Q.rope_reference(k, f, "complex") for k, f in zip(ks, freqs)]
        q, k = torch.cat(qs, 1), torch.cat(ks, 1)
        if rope == "interleaved":
            q, k = Q.rope_reference(q, freqs, rope), Q.rope_reference(k, freqs, rope)
    assert len(recorded) == 1 and recorded[0][3][6] == ("diffusers" if layout == "qwen" else "aten")
    assert same_bits(got[0], q) and same_bits(got[1], k)


def test_sites_fall_back_to_the_modules(cpu_kernels, recorded, monkeypatch):
    """Norms the kernel can't stand for are called as they are (hooks, other classes,
    different eps, another shape), and frequencies eager would not broadcast raise
    eager's error; CPU tensors without the interpreter take eager."""
    g = _gen(29)
    C = 256
    q, k = torch.randn(2, 5, C, generator=g), torch.randn(2, 5, C, generator=g)
    f = _angles((2, 5, C), g)
    hooked = _ltx_norms(C, g)
    seen = []
    hooked[0].register_forward_hook(lambda m, i, o: seen.append(1))
    cases_ = [hooked, [torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)], _ltx_norms(C, g, eps=1e-5)[:1] +
              _ltx_norms(C, g)[:1]]
    with torch.no_grad():
        for nq, nk in cases_:
            got = sites.qk_norm_rope_site(nq, nk, q, k, f, None, "interleaved")
            want = _eager_ltx(nq, nk, q, k, f, None, "interleaved")
            assert all(same_bits(a, b) for a, b in zip(got, want))
        assert seen == [1, 1]  # the hook ran (and once more for the reference)
        # the modules' own calls, then the RoPE site
        assert {c[0] for c in recorded} == {"rotary[interleaved]"}
        nq, nk = _ltx_norms(128, g)
        bad = _angles((9, 128), g)  # 9 positions for 3 + 5 tokens
        src = [(nq, nk, torch.randn(1, 3, 2, 128), torch.randn(1, 3, 2, 128)),
               (nq, nk, torch.randn(1, 5, 2, 128), torch.randn(1, 5, 2, 128))]
        with pytest.raises(RuntimeError):
            sites.joint_qk_norm_rope_site(src, bad, "interleaved")
    monkeypatch.setattr(params_module, "INTERPRET_ON_CPU", False)
    with torch.no_grad():
        nq, nk = _ltx_norms(C, g)
        got = sites.qk_norm_rope_site(nq, nk, q, k, f, None, "interleaved")
        assert all(same_bits(a, b) for a, b in zip(got, _eager_ltx(nq, nk, q, k, f, None, "interleaved")))
    assert {c[0] for c in recorded} == {"rotary[interleaved]"}


def test_sites_plain_under_compile(monkeypatch, recorded, cpu_kernels):
    g = _gen(31)
    nq, nk = _ltx_norms(256, g)
    q, k = torch.randn(1, 4, 256, generator=g), torch.randn(1, 4, 256, generator=g)
    f = _angles((1, 4, 256), g)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        got = sites.qk_norm_rope_site(nq, nk, q, k, f, None, "interleaved")
    assert recorded == []
    assert all(same_bits(a, b) for a, b in zip(got, _eager_ltx(nq, nk, q, k, f, None, "interleaved")))


def test_site_argument_errors():
    nq, nk = _ltx_norms(16, _gen(0))
    q = torch.randn(1, 2, 16)
    with pytest.raises(TypeError, match="must be a"):
        sites.qk_norm_rope_site(nq, nk, q, q, torch.randn(1, 2, 16), None, "interleaved")
    with pytest.raises(ValueError, match="unknown rope_type"):
        sites.qk_norm_rope_site(nq, nk, q, q, (q, q), None, "spiral")
    with pytest.raises(ValueError, match="key_freqs given without"):
        sites.qk_norm_rope_site(nq, nk, q, q, None, (q, q), None)
    with pytest.raises(ValueError, match="one tensor per source"):
        sites.joint_qk_norm_rope_site([(nq, nk, q, q)], [q, q], "complex")
    with pytest.raises(ValueError, match="go together"):
        sites.joint_qk_norm_rope_site([(nq, nk, q, q)], None, "interleaved")


# ---------------------------------------------------------------- the custom op


def test_custom_op_fake_shapes_and_no_backward():
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = _gen(37)
    q, k = torch.randn(2, 3, 2, 128, generator=g), torch.randn(2, 5, 2, 128, generator=g)
    w = [_weight(128, g), _weight(128, g)]
    out = torch.ops.bitfuse.qk_norm_rope([q], [k], w, EPS, [], "none", "diffusers")
    assert out[0].shape == q.shape and out[1].shape == k.shape
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        fw = [mode.from_tensor(t) for t in w]
        got = torch.ops.bitfuse.qk_norm_rope([fq, fq], [fk, fk], fw + fw, EPS, [], "none", "aten")
        assert got[0].shape == (2, 6, 2, 128) and got[1].shape == (2, 10, 2, 128)
    cf = [torch.complex(*_angles((3, 64), g))]
    ref = Q.qk_norm_rope_reference((q,), (q,), ((w[0], w[1]),), EPS, ((cf[0], cf[0]),), "complex", "diffusers")
    out = torch.ops.bitfuse.qk_norm_rope([q], [q], w, EPS, [cf[0], cf[0]], "complex", "diffusers")
    assert all(same_bits(a, b) for a, b in zip(out, ref))
    qg = q.clone().requires_grad_()
    out = torch.ops.bitfuse.qk_norm_rope([qg], [qg], w, EPS, [], "none", "aten")
    with pytest.raises(RuntimeError, match="has no backward"):
        out[0].sum().backward()


# ---------------------------------------------------------------- LTX-2 routed through the site


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_ltx2_norms_and_ropes_go_through_the_site(monkeypatch, variant):
    """Every attention's q/k norms (and RoPE where it has one) reach
    `qk_norm_rope_site` with the attention's own modules; LTX-2.0's interleaved tables
    reach the planner as their compact halves ("pairs"), its fallback as the full
    tables; the output is stock's."""
    pytest.importorskip("diffusers")
    import bitfuse
    from bitfuse.models.ltx2_configs import build_model, make_inputs, tiny_config

    model = build_model(tiny_config(variant), seed=0)
    kw = make_inputs(model, batch=2)
    with torch.no_grad():
        ref = model(**kw)
    calls, planned = [], []
    real, real_plan = sites.qk_norm_rope_site, Q.plan_qk_norm_rope

    def counting(nq, nk, q, k, qf, kf, rope_type):
        calls.append((rope_type, nq, nk))
        return real(nq, nk, q, k, qf, kf, rope_type)

    def planning(*args, **kwargs):
        planned.append(args[5])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(sites, "qk_norm_rope_site", counting)
    monkeypatch.setattr(Q, "plan_qk_norm_rope", planning)
    with bitfuse.accelerate(model), torch.no_grad():
        out = model(**kw)
    attns = [m for m in model.modules() if hasattr(m, "processor")]
    assert len(calls) == len(attns)
    assert {id(c[1]) for c in calls} == {id(a.norm_q) for a in attns}
    rope = "split" if variant == "2.3" else "interleaved"
    assert {c[0] for c in calls} == {rope, None}
    assert set(planned) == {"split" if variant == "2.3" else "pairs", None}
    for o, r in zip(out, ref):
        assert same_bits(o, r)
