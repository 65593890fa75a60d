"""The fuzz run on the GPU: >= 10,000 seeded cases over every op, tier, dtype, layout
and data draw, through the gate, each compared with eager (bitfuse.fuzz). Seeds that
once found a difference are kept below as regressions."""

import dataclasses
import os

import pytest

from bitfuse import fuzz

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


def test_fuzz_run_has_no_silent_difference():
    tally = fuzz.run_parallel(CASES, seed=int(os.environ.get("BITFUSE_FUZZ_SEED", "0")),
                              workers=min(8, os.cpu_count() or 1))
    print("\n" + tally.line())
    assert tally.cases == CASES
    assert tally.fast > CASES // 4  # most signatures run their kernels here
    assert tally.silent == [], "\n".join(tally.silent[:20])
