"""The fuzz harness on CPU: deterministic cases, and a planted silent difference is caught."""

import dataclasses
import os

import pytest
import torch

from bitfuse import fuzz
from bitfuse.ops import SPECS, _params, cases
from bitfuse.ops._launch import HAS_TRITON

interpreter = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter (CPU runs)"
)


def test_cases_are_deterministic_and_cover_every_op():
    assert fuzz.draw_case(3, 17) == fuzz.draw_case(3, 17)
    assert fuzz.draw_case(3, 17) != fuzz.draw_case(4, 17)
    drawn = [fuzz.draw_case(0, i) for i in range(600)]
    assert {d.op for d in drawn} == set(SPECS)
    assert {d.case.data for d in drawn} == set(cases.DATA)
    assert {d.tier for d in drawn} == {"lossless", "high"}
    assert all(not (d.tier == "high" and d.case.dtype is torch.float32) for d in drawn)
    assert "seed" in drawn[0].describe()


def _small_fp32(seed, n):
    out = []
    for i in range(n):
        fc = fuzz.draw_case(seed, i, "cpu")
        c = fc.case
        if fc.op in ("modulate", "gated_residual") and c.dtype is torch.float32 and c.B * c.S * c.D <= 20000:
            out.append(fc)
    return out


@interpreter
def test_a_kernel_wrong_on_later_draws_is_a_silent_difference(monkeypatch):
    """The gate verifies a signature on its first draw; the fuzz compares every draw. A
    kernel that is right at first sight and wrong on NaN inputs afterwards is reported."""
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    spec = SPECS["modulate"]
    real = spec.launch["lossless"]
    seen = set()

    def sly(plan, out=None):
        result = real(plan, out=out)
        if plan.key in seen and plan.x.isnan().any():
            result.view(-1)[0] = 0.5  # wrong, but only after first sight
        seen.add(plan.key)
        return result

    monkeypatch.setitem(SPECS, "modulate", dataclasses.replace(spec, launch={"lossless": sly}))
    todo = [fc for fc in _small_fp32(5, 3000) if fc.op == "modulate"][:60]
    tally = fuzz.Tally()
    for fc in todo:
        fuzz.run_case(fc, tally)
    assert tally.cases == len(todo) and tally.fast > 0
    assert tally.silent and all("modulate[lossless]" in s and "differ bitwise" in s for s in tally.silent)
    assert tally.line().startswith(f"fuzz: {len(todo)} cases, ")


@interpreter
def test_the_real_pointwise_kernels_have_no_silent_difference(monkeypatch):
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    tally = fuzz.Tally()
    for fc in _small_fp32(1, 1500):
        fuzz.run_case(fc, tally)
    assert tally.cases > 10 and tally.silent == [], tally.silent
