"""Kernel index and broadcast math under Triton's CPU interpreter, in fp32.

The interpreter rounds fp32 -> bf16 by truncation, so it can't judge bf16
exactness (the GPU tests do); in fp32 it checks every offset, mask and
broadcast exactly. Plans are built directly: the guard sends CPU tensors to
eager, which is right for users and wrong for this test."""

import os

import pytest
import torch

from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, _params, cases
from bitfuse.ops import gated_residual as G
from bitfuse.ops import head_gate as HG
from bitfuse.ops import modulate as M
from bitfuse.ops._launch import HAS_TRITON, needs_int64
from bitfuse.ops._params import (
    Folded,
    broadcast_strides,
    launch_shape,
    layout_class,
    table_of,
)

pytestmark = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter (CPU runs)"
)

SHAPES = [(1, 1, 1), (2, 7, 100), (3, 13, 257), (1, 31, 2048), (2, 5, 2240), (2, 3, 5120)]
CONFIGS = [None, (4, 32, 4)]  # None: the default; (4, 32, 4): multi-row masked tiles


def modulate_plan(x, scale, shift, wide=False):
    return M.ModulatePlan(x, scale, shift, *M._geometry_of(x, scale, shift, wide=wide))


def gated_plan(x, y, gate, wide=False):
    return G.GatedResidualPlan(x, y, gate, *G._geometry_of(x, y, gate, wide=wide))


def params(layout, B, S, D, g):
    if layout == "per-sample":
        return [torch.randn(B, 1, D, generator=g) for _ in range(3)]
    if layout == "per-token":
        return [torch.randn(B, S, D, generator=g) for _ in range(3)]
    if layout == "shared":
        return [torch.randn(D, generator=g) for _ in range(3)]
    if layout == "unbind":
        return list(torch.randn(B, S, 5, D, generator=g).unbind(2))[:3]
    if layout == "mixed":  # per-token scale, per-sample shift, shared gate
        return [torch.randn(B, S, 4, D, generator=g).unbind(2)[1], torch.randn(B, 1, D, generator=g),
                torch.randn(1, 1, D, generator=g)]
    raise ValueError(layout)


@pytest.mark.parametrize("B,S,D", SHAPES)
@pytest.mark.parametrize("layout", ["per-sample", "per-token", "shared", "unbind", "mixed"])
def test_fp32_exact_with_poisoned_output(B, S, D, layout):
    g = torch.Generator().manual_seed(B * 1000 + S * 10 + D)
    x = torch.randn(B, S, D, generator=g)
    y = torch.randn(B, S, D, generator=g)
    scale, shift, gate = params(layout, B, S, D, g)
    for config in CONFIGS:
        for wide in (False, True) if config is None else (False,):  # int32 and int64 indexing
            out = torch.full_like(x, float("nan"))
            M.launch_modulate(modulate_plan(x, scale, shift, wide), out=out, config=config)
            assert same_bits(out, x * (1 + scale) + shift), (layout, config, wide)
            out = torch.full_like(x, float("nan"))
            G.launch_gated_residual(gated_plan(x, y, gate, wide), out=out, config=config)
            assert same_bits(out, x + y * gate), (layout, config, wide)


def test_strided_operands_and_2d_x():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(2, 9, 140, generator=g)
    x = wide[:, :, 20:120]  # rows of 100 inside rows of 140
    scale = torch.randn(100, 2, generator=g)[:, 1]  # stride 2 along D
    shift = torch.randn(2, 1, 100, generator=g)
    y = torch.randn(9, 2, 100, generator=g).transpose(0, 1)  # batch-major view of a seq-major tensor
    out = M.launch_modulate(modulate_plan(x, scale, shift), config=(2, 32, 4))
    assert same_bits(out, x * (1 + scale) + shift)
    out = G.launch_gated_residual(gated_plan(x, y, scale), config=(2, 32, 4))
    assert same_bits(out, x + y * scale)
    x2 = torch.randn(11, 100, generator=g)
    s2 = torch.randn(11, 100, generator=g)
    h2 = torch.randn(1, 100, generator=g)
    assert same_bits(M.launch_modulate(modulate_plan(x2, s2, h2), config=(4, 32, 4)), x2 * (1 + s2) + h2)


def test_broadcast_strides_and_layout_classes():
    x_shape = torch.Size([2, 5, 8])
    table = torch.randn(2, 5, 6, 8)
    view = table.unbind(2)[0]
    assert broadcast_strides(view, x_shape) == (240, 48, 1)
    assert layout_class((240, 48, 1), view) == "per-token/strided"
    ps = torch.randn(2, 1, 6, 8).unbind(2)[2]
    assert broadcast_strides(ps, x_shape) == (48, 0, 1)
    assert layout_class((48, 0, 1), ps) == "per-sample/strided"
    assert broadcast_strides(torch.randn(8), x_shape) == (0, 0, 1)
    assert layout_class((0, 0, 1), torch.randn(8)) == "shared"
    assert broadcast_strides(torch.randn(3, 1, 8), x_shape) is None
    assert broadcast_strides(torch.randn(1, 2, 5, 8), x_shape) is None
    assert broadcast_strides(torch.randn(5, 8), torch.Size([5, 8])) == (0, 8, 1)


def test_launch_shape_and_index_width():
    assert launch_shape(4096, 6144, 2) == (1, 2048, 8)
    assert launch_shape(3072, 6144, 2) == (1, 1024, 4)
    assert launch_shape(4096, 6144, 4) == (1, 2048, 8)
    assert launch_shape(5120, 7, 2) == (1, 1024, 4)  # divides D: no masked lanes
    assert launch_shape(2048, 1, 2) == (1, 2048, 8)
    assert launch_shape(2240, 3, 2) == (1, 4096, 4)
    assert launch_shape(4096, 1024, 2) == (1, 4096, 8)  # few rows: whole rows, two vectors a thread
    assert launch_shape(4096, 6144, 2, streams=3) == (1, 4096, 16)  # gated residual
    assert launch_shape(4096, 6144, 4, streams=3) == (1, 2048, 8)
    assert not needs_int64((4, 6144 * 4096), (6144, 4096), (4096, 1))
    assert needs_int64((4, 32768 * 9 * 4096), (32768, 9 * 4096), (4096, 1))


def test_guard_reasons():
    x = torch.randn(2, 3, 8)
    assert M.plan_modulate(x, torch.randn(8), torch.randn(8)) == "CPU tensor"
    assert M.plan_modulate(x, 1.0, torch.randn(8)) == "operand is not a tensor"
    assert G.plan_gated_residual(x, x, "gate") == "operand is not a tensor"


def test_a_permuted_x_takes_eager(monkeypatch):
    """Eager's pointwise result is laid out as x (TensorIterator follows its first
    operand); the kernels write row-major. So a transposed x (Sana's patch-embedding
    output in its first block) takes eager, and a padded row-major
    one (a slice) keeps the kernel. Found on Sana: the same values in another layout
    sent a GEMM downstream to other bits."""
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    B, S, D = 2, 5, 8
    permuted = torch.randn(B, D, S).transpose(1, 2)
    padded = torch.randn(B, S, D + 4)[..., :D]
    p = torch.randn(B, 6, D).chunk(6, dim=1)[0]
    y = torch.randn(B, S, D)
    assert _params.permuted(permuted) and not _params.permuted(padded) and not _params.permuted(y)
    assert (permuted * (1 + p) + p).stride() == permuted.stride() != y.stride()  # eager keeps x's layout
    for plan in (M.plan_modulate(permuted, p, p), G.plan_gated_residual(permuted, y, p),
                 G.plan_gated_residual_f32(permuted, y, p.float())):
        assert plan.__class__ is str and "permuted" in plan
    for plan in (M.plan_modulate(padded, p, p), G.plan_gated_residual(padded, y, p),
                 G.plan_gated_residual(y, permuted, p)):  # y's layout does not decide eager's
        assert plan.__class__ is not str, plan


def head_gate_plan(y, gate, wide=False):
    return HG.HeadGatePlan(y, gate, *HG._geometry_of(y, gate, wide=wide))


@pytest.mark.parametrize("B,S,C,H", [(1, 1, 8, 1), (2, 7, 100, 4), (3, 13, 256, 2), (2, 5, 2240, 35), (1, 3, 4096, 32)])
def test_head_gate_indexing(B, S, C, H):
    """Each head of y scaled by its own gate: per-token, per-sample, strided and shared
    gates, padded rows of y, 2-D y, int32 and int64 offsets, masked multi-row tiles."""
    g = torch.Generator().manual_seed(B * 1000 + S * 10 + C)
    y = torch.randn(B, S, C + 12, generator=g)[..., 5 : 5 + C]  # rows of C inside rows of C + 12
    gates = {
        "per-token": torch.randn(B, S, H, generator=g),
        "per-sample": torch.randn(B, 1, H, generator=g),
        "strided": torch.randn(B, H, S, generator=g).transpose(1, 2),  # a permuted gate is read in place
        "shared": torch.randn(H, generator=g),
    }
    for name, gate in gates.items():
        ref = (y.unflatten(-1, (H, -1)) * gate.unsqueeze(-1)).flatten(-2)
        for config in CONFIGS:
            for wide in (False, True) if config is None else (False,):
                out = torch.full((B, S, C), float("nan"))
                HG.launch_head_gate(head_gate_plan(y, gate, wide), out=out, config=config)
                assert same_bits(out, ref), (name, config, wide)
    y2, gate2 = y[0], gates["per-token"][0]
    assert same_bits(HG.launch_head_gate(head_gate_plan(y2, gate2)), HG.head_gate_reference(y2, gate2))


def test_head_gate_guard(monkeypatch):
    y = torch.randn(2, 3, 8)
    assert HG.plan_head_gate(y, torch.randn(2, 3, 2)) == "CPU tensor"
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    assert HG.plan_head_gate(y, torch.randn(2, 3, 3)) == "y's 8 channels do not split into the gate's 3 heads"
    assert HG.plan_head_gate(y, torch.randn(2, 4, 2)) == "gate does not broadcast to y's rows"
    assert HG.plan_head_gate(y, torch.randn(2, 3, 2, dtype=torch.float64)) == "mixed dtypes (eager type promotion applies)"
    assert "permuted" in HG.plan_head_gate(torch.randn(3, 2, 8).transpose(0, 1), torch.randn(2, 3, 2))
    assert HG.plan_head_gate(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)) == "y must be 2-D or 3-D, got 4-D"
    per_token, per_sample = HG.plan_head_gate(y, torch.randn(2, 3, 2)), HG.plan_head_gate(y, torch.randn(2, 1, 2))
    assert per_token.key != per_sample.key and per_token.head_dim == 4
    assert HG.plan_head_gate(y, torch.randn(2, 3, 4)).key != per_token.key  # the head width is in the signature


@pytest.mark.parametrize("T", [1, 7])
def test_folded_parameters_equal_the_materialised_sum(T):
    """Folded(table row, temb view), as LTX-2's get_mod_params makes them: the kernels add
    the row on the fly; fp32 output equals eager on the materialised `table + temb`."""
    g = torch.Generator().manual_seed(T)
    B, S, D = 2, 7, 100
    x, y = torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)
    table = torch.randn(6, D, generator=g)
    t4 = torch.randn(B, T, 6 * D, generator=g).reshape(B, T, 6, D)
    eager = (table[None, None] + t4).unbind(2)
    shift, scale, gate = (Folded(table[i], t4[:, :, i]) for i in range(3))
    for config in CONFIGS:
        c, ct, _ = table_of(scale, x)
        h, ht, _ = table_of(shift, x)
        plan = M.ModulatePlan(x, c, h, *M._geometry_of(x, c, h, ct, ht), ct, ht)
        assert plan.key[2].endswith("+table")
        out = M.launch_modulate(plan, out=torch.full_like(x, float("nan")), config=config)
        assert same_bits(out, x * (1 + eager[1]) + eager[0])
        plan = M.ModulatePlan(x, c, eager[0], *M._geometry_of(x, c, eager[0], ct), ct, None)
        assert same_bits(M.launch_modulate(plan, config=config), x * (1 + eager[1]) + eager[0])
        gg, gt, _ = table_of(gate, x)
        plan = G.GatedResidualPlan(x, y, gg, *G._geometry_of(x, y, gg, gt), gt)
        out = G.launch_gated_residual(plan, out=torch.full_like(x, float("nan")), config=config)
        assert same_bits(out, x + y * eager[2])


def test_folded_guard():
    x = torch.randn(2, 3, 8)
    assert table_of(Folded(torch.randn(4), torch.randn(2, 1, 8)), x)[2] == "table row is not [D]"
    assert "eager promotes" in table_of(Folded(torch.randn(8).double(), torch.randn(2, 1, 8)), x)[2]
    f = Folded(torch.randn(8), torch.randn(2, 1, 8))
    assert f.shape == (2, 1, 8) and f.squeeze(2) is f and f.squeeze(1).shape == (2, 8)
    assert same_bits(f.value(), f.table + f.temb)


@pytest.mark.parametrize("name", ["modulate", "gated_residual", "head_gate", "rotary[interleaved]", "rotary[split]"])
@pytest.mark.parametrize("data", cases.DATA)
def test_specs_are_bitwise_on_every_data_draw(name, data, monkeypatch):
    """Each op's declaration end to end (make_args, plan, launch into a poisoned output,
    reference) in fp32 under the interpreter, on every layout it declares and every
    data draw: signed zeros, subnormals, NaN/inf, outlier channels."""
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    spec = SPECS[name]
    for i, layout in enumerate(spec.layouts):
        for strided in (False, True):
            case = cases.Case(2, 7, 16 if name.startswith("rotary") else 100, torch.float32, layout, data, seed=i,
                              device="cpu", strided=strided)
            args = spec.make_args(case)
            plan = spec.plan(*args)
            assert not isinstance(plan, str), plan
            ref = spec.reference(*args)
            poisoned = tuple(torch.full_like(r, float("nan")) for r in ref) if isinstance(ref, tuple) \
                else torch.full_like(ref, float("nan"))
            out = spec.launch["lossless"](plan, out=poisoned)
            for o, r in zip(out, ref) if isinstance(ref, tuple) else ((out, ref),):
                assert same_bits(o, r), (layout, strided)
