"""An activation written into a concatenation (`ops.act_cat`, `sites.cat_act_site`) on
the CPU: the kernel's indexing under Triton's interpreter (fp32), the guard's reasons,
the whole-domain check's logic with stand-in kernels, the site's dispatch.

The interpreter has no libdevice: the kernel computes the SiLU as numpy's float32
`x / (1 + exp(-x))` and the GELU's tanh through a sigmoid (`_act`), so its outputs are
compared bitwise with the same expressions in numpy float32 here; the GPU tests
(tests/gpu/test_act_cat_gpu.py) compare them with eager's bits."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bitfuse import policy, sites
from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, cases
from bitfuse.ops import act_cat as A
from interpreted import cpu_kernels, interpreter

F32 = np.float32


def np_silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1) + np.exp(-x))


def np_gelu(x: np.ndarray) -> np.ndarray:
    """The interpreter's stand-in: the tanh as 2 sigmoid(2 u) - 1, products and sums rounded."""
    inner = F32(0.7978845834732056) * (x + F32(0.044714998453855515) * ((x * x) * x))
    t = F32(2) * (F32(1) / (F32(1) + np.exp(-(F32(2) * inner)))) - F32(1)
    return (F32(0.5) * x) * (F32(1) + t)


def interpreted_reference(a, m, act):
    x = m.detach().contiguous().numpy()
    if act == "swiglu":
        h = x.shape[-1] // 2
        y = np_silu(x[..., :h]) * x[..., h:]
    else:
        y = np_gelu(x)
    y = torch.from_numpy(np.ascontiguousarray(y))
    return y if a is None else torch.cat([a, y], dim=-1)


def operands(rows, da, width, layout, seed=0):
    """a (None for da None) and m: "dense", or "strided" (a with padded rows, m a
    column slice of a wider tensor, as FLUX.2's fused projection hands it over)."""
    g = torch.Generator().manual_seed(seed)
    pad = 5 if layout == "strided" else 0
    m = (2 * torch.randn(*rows, width + pad, generator=g))[..., pad:]
    a = None if da is None else torch.randn(*rows, da + pad, generator=g)[..., :da]
    return a, m


GEOMETRIES = [  # rows, width of a (None: no a), width of m
    ((2, 5), 7, 40),
    ((3,), 0, 34),
    ((2, 3), 1024, 2048),  # whole blocks: no masks
    ((1, 4), None, 30),
    ((7,), 33, 66),
    ((2, 1), 130, 258),  # blocks cut short on both sides
]


@interpreter
@pytest.mark.parametrize("act", A.ACTS)
@pytest.mark.parametrize("layout", ["dense", "strided"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g[0]}-{g[1]}-{g[2]}")
@pytest.mark.parametrize("config", [None, (16, 1), (64, 2)], ids=["default", "16x1", "64x2"])
def test_kernel_indexing(act, layout, geometry, config):
    """Every element of a and of act(m) lands in its column of the concatenation, for
    each row of 2-D and 3-D operands, dense and strided, a absent or of width 0, column
    blocks whole and cut short; into a new tensor and into a poisoned `out`."""
    rows, da, width = geometry
    a, m = operands(rows, da, width, layout, seed=sum(rows) + width)
    ref = interpreted_reference(a, m, act)
    with cpu_kernels():
        plan = A.SPECS[f"cat_{act}"].plan(a, m)
        assert plan.__class__ is not str, plan
        out = A.launch_act_cat(plan, config=config)
        assert same_bits(out, ref) and out.shape == ref.shape and out.is_contiguous()
        poisoned = torch.full_like(ref, float("nan"))
        assert same_bits(A.launch_act_cat(plan, out=poisoned, config=config), ref)
        assert same_bits(A.bind_act_cat(plan)(a, m), ref)


@interpreter
def test_special_values_pass_through():
    """NaN, infinities and signed zeros in a are copied as they are; in m they go through
    the activation (numpy's float32 stand-ins here, eager's on the GPU)."""
    g = torch.Generator().manual_seed(3)
    m = cases.spoil(torch.randn(3, 64, generator=g), "special", g)
    a = cases.spoil(torch.randn(3, 16, generator=g), "special", g)
    a[0, :4] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")])
    for act in A.ACTS:
        with cpu_kernels():
            out = A.SPECS[f"cat_{act}"].launch["lossless"](A.SPECS[f"cat_{act}"].plan(a, m))
        assert same_bits(out, interpreted_reference(a, m, act))


def test_guard_reasons():
    m = torch.randn(2, 3, 8)
    a = torch.randn(2, 3, 4)
    assert A.plan_cat_swiglu(a, m) == "CPU tensor"
    with cpu_kernels():
        assert A.plan_cat_swiglu(a, torch.randn(2, 3, 7)).startswith("odd width")
        assert A.plan_cat_gelu_tanh(a, torch.randn(2, 3, 7)).__class__ is A.ActCatPlan
        assert A.plan_cat_gelu_tanh(torch.randn(6, 4), m) == "a and m differ in rank or leading sizes"
        assert A.plan_cat_gelu_tanh(torch.randn(2, 4, 4), m) == "a and m differ in rank or leading sizes"
        assert A.plan_cat_gelu_tanh(a, torch.randn(2, 8, 3).transpose(1, 2)) == "m's last axis is not contiguous"
        assert A.plan_cat_gelu_tanh(torch.randn(2, 4, 3).transpose(1, 2), m) == "a's last axis is not contiguous"
        assert A.plan_cat_gelu_tanh(a, torch.randn(2, 3, 8, 1)).startswith("m must be 2-D or 3-D")
        assert A.plan_cat_gelu_tanh(None, torch.randn(2, 0, 8)) == "empty tensor"
        assert A.plan_cat_gelu_tanh(a.double(), m).startswith("unsupported dtype") or \
            A.plan_cat_gelu_tanh(a.double(), m).startswith("mixed dtypes")
        assert A.plan_cat_gelu_tanh(a.half(), m) == "mixed dtypes (eager type promotion applies)"
        assert A.plan_cat_gelu_tanh(a, [1.0]) == "operand is not a tensor"
        plan = A.plan_cat_swiglu(None, m)
        assert plan.key[2:] == ("alone", "form=0") and plan.output().shape == (2, 3, 4)


@pytest.mark.parametrize("act", A.ACTS)
def test_form_takes_the_first_form_equal_on_every_input(monkeypatch, act):
    """The whole-domain check's logic with a stand-in device (CPU tensors) and a stand-in
    kernel launch: each form writes eager's activation except where the test breaks an
    element; the first candidate equal on all 65,536 inputs is kept, none equal gives
    None (kept), and a check that can't run now gives None, not kept."""
    monkeypatch.setattr(A, "device_index", lambda device: 0)
    monkeypatch.setattr(A, "every_input", lambda dtype, device: torch.arange(
        -32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype))
    broken, allowed, seen = set(), [True], []

    class FakeLaunch:
        def launch(self, recipe, tensors):
            _, m, out = tensors
            found = recipe.consts[5]
            seen.append((tuple(m.shape), found))
            out.copy_(A.SPECS[f"cat_{act}"].reference(None, m))
            if found in broken:
                out.view(-1)[12345] = 0.5

    monkeypatch.setattr(A, "_launch", FakeLaunch())
    monkeypatch.setattr(A, "probe_allowed", lambda index: allowed[0])
    candidates = A._CANDIDATES[act]
    dtype, key = torch.bfloat16, (0, torch.bfloat16, act)
    try:
        A._FORMS.clear()
        assert A.form("cuda", dtype, act) == candidates[0] and A._FORMS[key] == candidates[0]
        assert seen[0] == ((256, 512 if act == "swiglu" else 256), candidates[0])  # swiglu: [x, 1.0]
        A._FORMS.clear()
        broken.add(candidates[0])
        assert A.form("cuda", dtype, act) == candidates[1]
        A._FORMS.clear()
        broken.update(candidates)
        assert A.form("cuda", dtype, act) is None and A._FORMS[key] is None
        A._FORMS.clear()
        broken.clear()
        allowed[0] = False
        assert A.form("cuda", dtype, act) is None and key not in A._FORMS
    finally:
        A._FORMS.clear()


def test_references_are_the_stock_expressions():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(2, 3, 10, generator=g).to(torch.bfloat16)
    a = torch.randn(2, 3, 4, generator=g).to(torch.bfloat16)
    assert same_bits(A.cat_gelu_tanh_reference(a, m), torch.cat([a, torch.nn.GELU(approximate="tanh")(m)], dim=2))
    silu = torch.nn.SiLU()
    assert same_bits(A.cat_swiglu_reference(None, m), silu(m[..., :5]) * m[..., 5:])
    assert same_bits(A.cat_swiglu(a, m), A.cat_swiglu_reference(a, m))  # CPU: the reference
    assert same_bits(torch.ops.bitfuse.cat_swiglu(None, m), A.cat_swiglu_reference(None, m))
    assert same_bits(torch.ops.bitfuse.cat_gelu_tanh(a, m), A.cat_gelu_tanh_reference(a, m))


@pytest.mark.parametrize("name", ["cat_gelu_tanh", "cat_swiglu"])
@pytest.mark.parametrize("layout", A.LAYOUTS)
def test_make_args_builds_the_layouts(name, layout):
    spec = SPECS[name]
    a, m = spec.make_args(cases.Case(2, 5, 24, torch.float32, layout, "randn", device="cpu"))
    assert m.shape == (2, 5, 48 if name == "cat_swiglu" else 24)
    assert (a is None) == (layout == "alone")
    if layout == "strided":
        assert not a.is_contiguous() and not m.is_contiguous()
    assert spec.reference(a, m).shape[-1] == (0 if a is None else a.shape[-1]) + 24


# ---------------------------------------------------------------- the site


def test_site_takes_the_eager_expression_where_it_must(monkeypatch):
    """act None: a plain torch.cat; dim not the last axis, BITFUSE_DISABLE, and what the
    guard refuses (here float64): the eager expression, bit for bit; nothing is gated."""
    g = torch.Generator().manual_seed(2)
    a, m = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 8, generator=g)
    policy.reset_verdicts()
    assert same_bits(sites.cat_act_site(a, m, None, dim=2), torch.cat([a, m], dim=2))
    assert sites.cat_act_site(None, m, None) is m
    assert same_bits(sites.cat_act_site(a, m, "gelu_tanh", dim=2), A.cat_gelu_tanh_reference(a, m))  # CPU
    a1, m1 = torch.randn(2, 4, 3, generator=g), torch.randn(2, 8, 3, generator=g)
    with cpu_kernels():
        assert same_bits(sites.cat_act_site(a1, m1, "gelu_tanh", dim=1),
                         torch.cat([a1, F.gelu(m1, approximate="tanh")], dim=1))
        assert same_bits(sites.cat_act_site(a.double(), m.double(), "swiglu"),
                         A.cat_swiglu_reference(a.double(), m.double()))
        monkeypatch.setattr(policy, "DISABLED", True)
        assert same_bits(sites.cat_act_site(a, m, "swiglu"), A.cat_swiglu_reference(a, m))
    assert not policy.verdicts()


@interpreter
def test_site_gates_the_kernel_and_keeps_eager_s_bits():
    """Under the interpreter the site plans and gates each act and returns eager's bits
    (the kernel's where the gate verified it, eager's own where the CPU's exp differs
    from numpy's); the verdicts name the two ops."""
    g = torch.Generator().manual_seed(4)
    a, m = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 64, generator=g)
    policy.reset_verdicts()
    with cpu_kernels(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for act in A.ACTS:
            for _ in range(2):  # first sight, then the verdict's path
                assert same_bits(sites.cat_act_site(a, m, act), A.SPECS[f"cat_{act}"].reference(a, m))
    assert {v.op for v in policy.verdicts()} == {"cat_gelu_tanh", "cat_swiglu"}
    policy.reset_verdicts()


def test_a_kernel_that_fails_in_the_check_gives_eager_and_says_why(monkeypatch):
    """A launch that raises inside the whole-domain check (a compile error, say) settles
    None, and the guard's reason carries the error: the call takes eager, no crash."""
    monkeypatch.setattr(A, "device_index", lambda device: 0 if device != "cpu" and str(device) != "cpu" else -1)
    monkeypatch.setattr(A, "every_input", lambda dtype, device: torch.arange(
        -32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype))

    class Broken:
        def launch(self, recipe, tensors):
            raise RuntimeError("CompilationError: at 19:4")

    monkeypatch.setattr(A, "_launch", Broken())
    monkeypatch.setattr(A, "probe_allowed", lambda index: True)
    try:
        A._FORMS.clear()
        assert A.form("cuda", torch.bfloat16, "gelu_tanh") is None
        assert A._ERRORS[(0, torch.bfloat16, "gelu_tanh")] == "RuntimeError: CompilationError: at 19:4"
    finally:
        A._FORMS.clear()
        A._ERRORS.clear()
