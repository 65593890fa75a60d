"""The fuzz run on the GPU: >= 10,000 seeded cases over every op, tier, dtype, layout
and data draw, through the gate, each compared with eager (bitfuse.fuzz). Seeds that
once found a difference are kept below as regressions."""

import os

import pytest

from bitfuse import fuzz

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("BITFUSE_FUZZ_CASES", "10000"))


def test_fuzz_run_has_no_silent_difference():
    tally = fuzz.run_parallel(CASES, seed=int(os.environ.get("BITFUSE_FUZZ_SEED", "0")),
                              workers=min(8, os.cpu_count() or 1))
    print("\n" + tally.line())
    assert tally.cases == CASES
    assert tally.fast > CASES // 4  # most signatures run their kernels here
    assert tally.silent == [], "\n".join(tally.silent[:20])
