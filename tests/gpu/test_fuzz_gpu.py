"""The fuzz run on the GPU: >= 10,000 seeded cases over every op, tier, dtype, layout
and data draw, through the gate, each compared with eager (bitfuse.fuzz). Seeds that
once found a difference are kept below as regressions."""

import dataclasses
import os

import pytest
import torch

from bitfuse import fuzz, policy
from bitfuse.numerics import same_bits
from bitfuse.ops import SPECS, cases

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("BITFUSE_FUZZ_CASES", "10000"))


# (seed, case) pairs that once found a silent difference, and what it was
REGRESSIONS = [
    (0, 1260),  # layer_norm_modulate[high] bf16, "large" rows: x * x overflowed fp32 in the one-pass kernel
    (0, 2285),  # rms_norm_modulate[aten][high] bf16, the same (256 ULP from float64)
    (0, 1102),  # rms_norm_modulate[diffusers][high] bf16, the same
    (0, 2660),  # layer_norm_modulate[high] bf16: NaN from the overflowed variance
    (0, 883),   # layer_norm_modulate[high] bf16 D=256: eager overflowed, the contract compared with eager's inf
]


@pytest.mark.parametrize("seed,index", REGRESSIONS)
def test_regression(seed, index):
    """The case, after its signature was verified on an ordinary (randn) draw: what
    made the difference silent."""
    fc = fuzz.draw_case(seed, index)
    tally = fuzz.Tally()
    fuzz.run_case(dataclasses.replace(fc, case=dataclasses.replace(fc.case, data="randn")), tally)
    fuzz.run_case(fc, tally)
    assert tally.silent == [], tally.silent


def test_regression_operand_dtype_is_part_of_the_launch_key():
    """Fuzz seed 0, cases 3061, 3469, 4877, ... (2026-12-01): layer_norm_f32 with x of one
    dtype and D=5120 verified with fp32 weights, then served bf16 weights with the kernel
    compiled for fp32 ones (FastLaunch's key held only x's dtype): whole rows differed,
    silently. Both weight dtypes, alternating, at one geometry, each bitwise eager."""
    spec = SPECS["layer_norm_f32"]
    for i, layout in enumerate(("fp32", "bf16", "fp32", "bf16")):
        args = spec.make_args(cases.Case(1, 1031, 5120, torch.bfloat16, layout, "randn", seed=i, device="cuda"))
        plan = spec.plan(*args)
        assert plan.__class__ is not str, plan
        assert same_bits(policy.gated(spec, "lossless", plan, args), spec.reference(*args)), layout
        assert policy.state(spec, "lossless", plan) is True, layout


def test_fuzz_run_has_no_silent_difference():
    tally = fuzz.run_parallel(CASES, seed=int(os.environ.get("BITFUSE_FUZZ_SEED", "0")),
                              workers=min(8, os.cpu_count() or 1))
    print("\n" + tally.line())
    assert tally.cases == CASES
    assert tally.fast > CASES // 4  # most signatures run their kernels here
    assert tally.silent == [], "\n".join(tally.silent[:20])
