"""Projections of one input as one GEMM (`ops.projections`, `sites.linear_projections_site`):
packing keeps every Parameter and value, the planner reads the packing from the
pointers, the launch's slices are the separate calls' results, and the site falls back
to the separate calls wherever the fused path may not run. On CPU the planner refuses
(the fused GEMM runs on CUDA devices, tests/gpu); the launch itself is checked here on
integer-valued operands, whose products and sums are exact in any order."""

from __future__ import annotations

import pytest
import torch

from bitfuse import policy, sites
from bitfuse.ops import SPECS, cases
from bitfuse.ops import projections as P
from bitfuse.ops._settings import gemm_settings


def _linears(n=3, k=64, out=64, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    mods = [torch.nn.Linear(k, out, bias=bias, dtype=dtype) for _ in range(n)]
    with torch.no_grad():
        for m in mods:  # integer values: every GEMM sums them exactly, in any order
            m.weight.copy_(torch.randint(-3, 4, m.weight.shape))
            if bias:
                m.bias.copy_(torch.randint(-3, 4, m.bias.shape))
    return mods


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_the_spec_is_declared_once():
    assert SPECS["projections"] is P.SPEC and not P.SPEC.bandwidth_bound
    assert P.SPEC.layouts == P.LAYOUTS


@pytest.mark.parametrize("bias", [True, False])
def test_pack_keeps_the_parameters_and_values_and_unpack_undoes_it(bias):
    mods = _linears(bias=bias)
    params = [m.weight for m in mods] + ([m.bias for m in mods] if bias else [])
    before = [(p, p.detach().clone()) for p in params]
    assert sites.pack_linears(*mods)
    weights = [m.weight for m in mods]
    assert len({_storage(w) for w in weights}) == 1
    assert P.layout(weights) == ((0, 64, 128), 192)  # 64 x 64 fp32 rows: no gaps needed
    assert P.packed(weights).shape == (192, 64)
    if bias:  # 64 fp32 = 256 bytes a bias: at the weights' rows, no gaps either
        assert P.layout([m.bias for m in mods]) == ((0, 64, 128), 192)
    for (p, value), now in zip(before, params):
        assert p is now and torch.equal(p, value) and isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert sites.pack_linears(*mods)  # already packed: unchanged
    assert P.layout(weights) == ((0, 64, 128), 192)
    sites.unpack_linears(*mods)
    assert len({_storage(w) for w in weights}) == 3 and P.packed(weights) is None
    for (p, value), now in zip(before, params):
        assert p is now and torch.equal(p, value)
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()


def test_in_place_updates_reach_the_packed_weight():
    """No copy is kept: a write through a parameter (as `load_state_dict` or a LoRA merge's
    `weight.data +=` makes) is what the packed view reads."""
    mods = _linears()
    sites.pack_linears(*mods)
    with torch.no_grad():
        mods[1].weight.data += 1
        mods[2].load_state_dict({"weight": torch.zeros(64, 64), "bias": torch.ones(64)})
    w = P.packed([m.weight for m in mods])
    assert torch.equal(w[64:128], mods[1].weight) and not w[128:].any()
    assert torch.equal(P.packed([m.bias for m in mods])[128:], torch.ones(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_start_256_byte_aligned_with_zero_rows_between(dtype):
    """Every part starts 256 bytes after the first, as a parameter of its own is aligned:
    where N_i rows would not (here 40-element biases, 40 x 24 weights), zero rows pad it."""
    elem = torch.empty((), dtype=dtype).element_size()
    mods = _linears(k=24, out=40, dtype=dtype)
    assert sites.pack_linears(*mods)
    w, b = [m.weight for m in mods], [m.bias for m in mods]
    offsets, rows = P.layout(w)
    assert P.layout(b) == (offsets, rows) and offsets[0] == 0 and rows == offsets[2] + 40
    for part in w[1:] + b[1:]:
        assert (part.data_ptr() - w[0].data_ptr() if part.dim() == 2 else part.data_ptr() - b[0].data_ptr()) % 256 == 0
    granule = 256 // elem  # the bias rows decide: 64 (fp32) or 128 (bf16) rows
    assert offsets == (0, granule, 2 * granule)
    pw, pb = P.packed(w), P.packed(b)
    assert not pw[40:granule].any() and not pb[40:granule].any()
    assert all(torch.equal(pw[o:o + 40], m.weight) and torch.equal(pb[o:o + 40], m.bias) for o, m in zip(offsets, mods))
    # without biases only the weights' rows count: 40 x 24 x elem bytes, 256-aligned after 8 (fp32) / 16 rows
    nob = _linears(k=24, out=40, bias=False, dtype=dtype)
    sites.pack_linears(*nob)
    assert P.layout([m.weight for m in nob])[0] == ((0, 40, 80) if elem == 4 else (0, 48, 96))


def test_what_is_not_packed():
    assert not sites.pack_linears(*_linears(1))
    mixed = _linears(2) + _linears(1, dtype=torch.float64)
    assert not sites.pack_linears(*mixed)
    assert not sites.pack_linears(*_linears(2, k=64), *_linears(1, k=32))  # different K
    assert not sites.pack_linears(*_linears(2, bias=True), *_linears(1, bias=False))
    assert "fewer than two" in P.packable([torch.zeros(2, 2)], [None])


def test_layout_reads_the_pointers():
    base = torch.arange(4 * 3 * 8, dtype=torch.float32).reshape(12, 8)
    a, b, c = base[:4], base[4:8], base[8:]
    assert P.layout([a, b, c]) == ((0, 4, 8), 12) and torch.equal(P.packed([a, b, c]), base)
    assert P.layout([a, c]) == ((0, 8), 12)  # a gap
    assert P.layout([b, a]) is None and P.layout([a, base[2:6]]) is None  # the wrong order, an overlap
    assert P.layout([a, b.clone()]) is None  # another storage
    assert P.layout([base[:, :4], base[:, 4:]]) is None  # not contiguous
    assert P.layout([base[0], base[1]]) == ((0, 8), 16)  # 1-D parts, in elements
    assert P.layout([base[:2], base[2:4].reshape(16)]) is None  # mixed ranks
    assert P.layout([base[0, :3], base[0, 4:7]]) == ((0, 4), 7)


@pytest.mark.parametrize("shape", [(64, True), (64, False), (40, True), (40, False)], ids=str)
def test_the_launch_returns_the_separate_results(shape):
    """The plan a CUDA call would get, built on CPU: one GEMM on the packed weight, the
    parts' columns equal to the separate `F.linear` calls (exact operands), packed with
    or without gaps, with or without biases; the bound launch likewise, and None once
    unpacked."""
    out, bias = shape
    mods = _linears(out=out, bias=bias)
    assert sites.pack_linears(*mods)
    x = torch.randint(-3, 4, (2, 5, 64)).float()
    weights = tuple(m.weight for m in mods)
    biases = tuple(m.bias for m in mods)
    offsets, rows = P.layout(weights)
    assert (offsets == (0, out, 2 * out)) == (out == 64 or not bias)
    plan = P.ProjectionsPlan(x, P.packed(weights), P.packed(biases) if bias else None, (out,) * 3, offsets, ("k",))
    with torch.no_grad():
        ref = P.projections_reference(x, weights, biases)
        got = P.launch_projections(plan)
        bound = P.bind_projections(plan)(x, weights, biases)
        assert len(got) == len(bound) == 3
        for o, r in zip(got + bound, ref + ref):
            assert torch.equal(o, r) and o.shape == r.shape
        assert got[1].stride() == (5 * rows, rows, 1)  # views of one output
        sites.unpack_linears(*mods)
        assert P.bind_projections(plan)(x, weights, biases) is None


def test_the_planner_says_why():
    mods = _linears()
    sites.pack_linears(*mods)
    w = tuple(m.weight for m in mods)
    b = tuple(m.bias for m in mods)
    x = torch.randn(2, 3, 64)
    assert "CPU tensor" in P.plan_projections(x, w, b)
    assert "two or more" in P.plan_projections(x, w[:1], b[:1])
    assert "two or more" in P.plan_projections(x, w, b[:2])
def test_the_site_on_cpu_makes_the_separate_calls():
    """The planner refuses CPU tensors, so the site returns the modules' own results (a
    hook on one module, or tracing, keeps the module calls too), through `call` if given."""
    mods = _linears()
    sites.pack_linears(*mods)
    x = torch.randint(-3, 4, (2, 5, 64)).float()
    with torch.no_grad():
        ref = tuple(m(x) for m in mods)
        got = sites.linear_projections_site(x, *mods)
        calls = []
        via = sites.linear_projections_site(x, *mods, call=lambda m, t: calls.append(m) or m(t))
        assert all(torch.equal(o, r) and o.is_contiguous() for o, r in zip(got + via, ref + ref))
        assert calls == mods
        seen = []
        mods[1].register_forward_hook(lambda m, i, o: seen.append(m))
        sites.linear_projections_site(x, *mods)
        assert seen == [mods[1]]
    assert not policy.verdicts() or all(v.op != "projections" for v in policy.verdicts())


def test_make_args_builds_every_layout():
    for layout in P.LAYOUTS:
        for D in (256, 100):
            x, weights, biases = P.SPEC.make_args(cases.Case(2, 3, D, torch.bfloat16, layout, "randn", 0, "cpu"))
            assert x.shape == (2, 3, D) and P.layout(weights) is not None
            assert len(weights) == (2 if layout == "kv-bias" else 3)
            if layout == "qkv":
                assert all(b is None for b in biases)
            else:
                assert P.layout(biases) == P.layout(weights)
    with pytest.raises(ValueError, match="unknown projections layout"):
        P.SPEC.make_args(cases.Case(1, 1, 64, torch.float32, "nope", "randn", 0, "cpu"))


@pytest.mark.parametrize("bias", [True, False])
def test_the_site_through_the_gate(monkeypatch, bias):
    """With the planner taking CPU tensors (the switch the interpreter tests use), the
    site's whole path runs here on exact operands: first sight verified against the
    separate calls (eager's results go on), then the bound launch (views of one output);
    after the weights move (unpacked), the separate calls again, with no new verdict."""
    from bitfuse.ops import _params

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    policy.reset_verdicts()
    mods = _linears(k=64, out=40, bias=bias)  # bias: gaps between the parts
    assert sites.pack_linears(*mods)
    x = torch.randint(-3, 4, (2, 5, 64)).float()
    with torch.no_grad():
        ref = tuple(m(x) for m in mods)
        first = sites.linear_projections_site(x, *mods)
        assert [v.status for v in policy.verdicts()] == ["verified"]
        assert all(o.is_contiguous() for o in first)  # eager's own results, on first sight
        steady = sites.linear_projections_site(x, *mods)
        rows = P.layout([m.weight for m in mods])[1]
        assert all(o.stride() == (5 * rows, rows, 1) for o in steady)
        for m in mods:
            m.weight.data = m.weight.data.clone()
        moved = sites.linear_projections_site(x, *mods)
        for outs in (first, steady, moved):
            assert all(torch.equal(o, r) for o, r in zip(outs, ref))
        assert all(o.is_contiguous() for o in moved) and len(policy.verdicts()) == 1
    policy.reset_verdicts()


def test_a_verdict_is_per_layout_of_x(monkeypatch):
    """aten's linear flattens a contiguous x into one GEMM with the bias in its epilogue,
    and runs an x it cannot flatten through matmul with the bias added after: another
    computation, so a verdict for one layout must not serve the other (the fuzz found
    an fp32 case, rows padded, where the two differ after the contiguous one verified)."""
    from bitfuse.ops import _params

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    mods = _linears()
    sites.pack_linears(*mods)
    w, b = tuple(m.weight for m in mods), tuple(m.bias for m in mods)
    dense = P._aligned_zeros((2, 5, 64), torch.float32, "cpu")
    padded = P._aligned_zeros((2, 5, 128), torch.float32, "cpu")[..., :64]
    with torch.no_grad():
        assert P.plan_projections(dense, w, b).key != P.plan_projections(padded, w, b).key


@pytest.mark.parametrize("dtype, setting", [
    (torch.bfloat16, "allow_bf16_reduced_precision_reduction"),
    (torch.float16, "allow_fp16_reduced_precision_reduction"),
    (torch.float32, "allow_tf32"),
])
def test_a_verdict_is_per_gemm_setting(monkeypatch, dtype, setting):
    """cuBLAS picks the packed GEMM's kernel and the separate calls' under the
    process's matmul settings, so a setting changed after first sight (say, reduced-
    precision reductions turned off) makes a new key: the site's bound launch and the
    gate's verdict both, so the problem is verified again."""
    from bitfuse.ops import _params

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    mods = _linears()
    for m in mods:
        m.to(dtype)
    sites.pack_linears(*mods)
    w, b = tuple(m.weight for m in mods), tuple(m.bias for m in mods)
    x = P._aligned_zeros((2, 5, 64), dtype, "cpu")
    matmul = torch.backends.cuda.matmul
    before = getattr(matmul, setting)
    with torch.no_grad():
        try:
            setattr(matmul, setting, before)  # (a legacy TF32 flag set reads "ieee" where it read "none")
            key, settings = P.plan_projections(x, w, b).key, gemm_settings(dtype)
            setattr(matmul, setting, not before)
            assert gemm_settings(dtype) != settings
            assert P.plan_projections(x, w, b).key != key
        finally:
            setattr(matmul, setting, before)
        assert P.plan_projections(x, w, b).key == key


def test_the_site_verifies_again_after_a_gemm_setting_changes(monkeypatch):
    from bitfuse.ops import _params

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    policy.reset_verdicts()
    mods = _linears(k=64, out=40, bias=True)
    assert sites.pack_linears(*mods)
    x = torch.randint(-3, 4, (2, 5, 64)).float()
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    with torch.no_grad():
        ref = tuple(m(x) for m in mods)
        sites.linear_projections_site(x, *mods)
        sites.linear_projections_site(x, *mods)
        assert len(policy.verdicts()) == 1
        try:
            matmul.allow_tf32 = not before
            outs = sites.linear_projections_site(x, *mods)
        finally:
            matmul.allow_tf32 = before
        assert all(torch.equal(o, r) for o, r in zip(outs, ref))
        assert [v.status for v in policy.verdicts()] == ["verified", "verified"]
    policy.reset_verdicts()


def test_tensor_subclasses_are_left_alone(monkeypatch):
    """A subclass's storage need not be one buffer of its values (DTensor, quantised
    weights): neither packed nor planned; the site makes the separate calls."""
    from bitfuse.ops import _params

    class Sub(torch.Tensor):
        pass

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    ws = [torch.zeros(64, 64).as_subclass(Sub) for _ in range(3)]
    assert "subclass" in P.packable(ws, [None] * 3)
    mods = _linears()
    sites.pack_linears(*mods)
    w = tuple(m.weight for m in mods)
    with torch.no_grad():
        assert "subclass" in P.plan_projections(torch.zeros(2, 64).as_subclass(Sub), w, (None,) * 3)


def test_laid_out_like_keeps_shape_strides_and_alignment():
    x = torch.randn(2, 5, 164)[..., 3:103]
    like = P._laid_out_like(x)
    assert like.shape == x.shape and like.stride() == x.stride() and like.dtype == x.dtype
    assert like.data_ptr() % P.ALIGN == x.data_ptr() % P.ALIGN and _storage(like) != _storage(x)


@pytest.mark.parametrize("bias", [True, False])
def test_the_probe_sees_another_order_of_the_k_sums(monkeypatch, bias):
    """`reduction_probe` on a plan's geometry: None where the packed launch is the
    separate calls themselves; a difference where it sums K in two halves (split-K),
    which integer operands, or many ordinary draws, would not show."""
    from bitfuse.ops import _params

    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    mods = _linears(k=96, out=40, bias=bias)
    assert sites.pack_linears(*mods)
    w, b = tuple(m.weight for m in mods), tuple(m.bias for m in mods)
    x = P._aligned_zeros((2, 5, 96), torch.float32, "cpu").copy_(torch.randn(2, 5, 96))
    with torch.no_grad():
        plan = P.plan_projections(x, w, b)

        def separate(plan, out=None):
            return tuple(torch.nn.functional.linear(plan.x, plan.weight[o : o + n],
                                                    None if plan.bias is None else plan.bias[o : o + n])
                         for n, o in zip(plan.sizes, plan.offsets))

        def split_k(plan, out=None):
            h = plan.x.shape[-1] // 2
            return tuple(torch.nn.functional.linear(plan.x[..., :h], plan.weight[o : o + n, :h],
                                                    None if plan.bias is None else plan.bias[o : o + n])
                         + torch.nn.functional.linear(plan.x[..., h:], plan.weight[o : o + n, h:])
                         for n, o in zip(plan.sizes, plan.offsets))

        monkeypatch.setattr(P, "launch_projections", separate)
        assert P.reduction_probe(plan) is None
        monkeypatch.setattr(P, "launch_projections", split_k)
        why = P.reduction_probe(plan)
        assert why is not None and "sums K otherwise" in why
        ints = (torch.randint(-3, 4, x.shape).float(),)  # the call's own (integer) data can't tell
        assert all(torch.equal(a, r) for a, r in zip(split_k(P.ProjectionsPlan(ints[0], plan.weight, plan.bias,
                                                                              plan.sizes, plan.offsets, plan.key)),
                                                     separate(P.ProjectionsPlan(ints[0], plan.weight, plan.bias,
                                                                                plan.sizes, plan.offsets, plan.key))))
    assert P.SPEC.probe is P.reduction_probe
