"""`OpSpec`: an op's facts, declared once in its module.

The gate (`policy.gated`), `bitfuse verify`, `bench/ops.py`, the fuzz run and
the tests iterate over these declarations instead of restating them.

Vocabulary: a *tier* is what a caller asks for ("lossless": the bits eager
gives; "high": at least as accurate as eager against the float64 value of the
same expression). An op has a kernel per tier it lists in `tiers`; any other
tier runs its lossless kernel (memory-bound ops gain nothing from fewer
roundings, so they are exact in every tier).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

TIERS = ("lossless", "high")


@dataclass(frozen=True, eq=False)
class OpSpec:
    """What the rest of bitfuse needs to know about one op.

    name: the op's name in gate verdicts, reports and benchmarks.
    reference: `reference(*args)`, the eager expression as models write it (the
        lossless contract: bitwise equal to it).
    plan: `plan(*args, tier=...)` -> a plan (an object with a hashable `.key`: the
        signature the gate keys its verdicts on) or a string saying why this call
        takes the reference.
    launch: kernel tier -> `launch(plan, out=None)`, the kernel for a plan, written
        into `out` (contiguous, the output's shape) if given.
    tiers: the tiers with a kernel of their own (see `kernel_tier`).
    reference64: `reference64(*args)`, the float64 value of the same expression
        (inputs as given, every op exact): the high contract's yardstick.
    terms: `terms(*args)`, the float64 magnitude of the expression's largest term,
        elementwise: the scale at which the high contract counts ULPs.
    make_args: `make_args(case)` -> args for a `cases.Case` (shape, dtype, layout,
        data draw): how verify, the benchmarks, the fuzz run and the tests build
        operands.
    layouts: the parameter layouts `make_args` knows, most common first.
    bind: kernel tier -> `bind(plan)`, the launch with everything but the tensors
        fixed: a function of the op's arguments (`reference`'s) for any call whose
        guard would plan the same (the site keys it by shapes, strides, dtypes,
        devices), returning the result, or None where this call needs the planner.
    bandwidth_bound: the op moves memory (its yardstick is the copy ceiling,
        `bench/ops.py`); False for an op around a GEMM (`projections`).
    probe: `probe(plan)` -> None, or why the fast path may not run for this plan's
        signature: a check of the running build on operands built for it (not the
        call's own), run once by the gate at first sight after the call's own check,
        where agreement on one draw proves too little (`projections`: two GEMMs that
        reduce K in different orders agree on most draws).
    may_differ: why the fast path can give other bits than the reference on some
        problems without a fault of its own (a library picking its kernel per
        problem), or None: any difference is a finding. The gate verifies each
        problem either way and gives those the reference; `bitfuse verify` reports
        them as eager fallbacks, not mismatches.
    """

    name: str
    reference: Callable[..., Any]
    plan: Callable[..., Any]
    launch: Mapping[str, Callable[..., Any]]
    tiers: tuple[str, ...] = ("lossless",)
    reference64: Callable[..., Any] | None = None
    terms: Callable[..., Any] | None = None
    make_args: Callable[..., tuple] | None = None
    layouts: tuple[str, ...] = ()
    bind: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    bandwidth_bound: bool = True
    probe: Callable[[Any], str | None] | None = None
    may_differ: str | None = None

    def probe_why(self, plan) -> str | None:
        """`probe(plan)` as the gate and `bitfuse verify` run it: None where there is no
        probe or it passes; an exception is its why (a probe that cannot run proves
        nothing), but for running out of memory, which propagates."""
        if self.probe is None:
            return None
        try:
            return self.probe(plan)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001
            return f"the probe failed: {type(exc).__name__}: {exc}"

    def kernel_tier(self, tier: str) -> str:
        """The kernel a requested tier runs: its own, or the lossless one."""
        return tier if tier in self.tiers else "lossless"

    def __repr__(self) -> str:
        return f"OpSpec({self.name!r}, tiers={self.tiers})"
