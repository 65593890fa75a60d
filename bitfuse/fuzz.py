"""A seeded fuzz run of every op through the first-sight gate (`bitfuse verify --fuzz N`).

Each case draws an op (`ops.SPECS`), a tier it has a kernel for, a dtype, a
parameter layout, a data draw (randn, outlier channels, signed zeros,
subnormals, NaN/inf, large, tiny), a shape (odd and prime sizes among them) and
dense or strided x, builds fresh operands, and runs the call as a site does:
the planner, then `policy.gated`. Signatures repeat across cases on purpose:
the gate verifies a signature once, on its first draw, and every later draw
of it is compared here too. The output is compared with eager:

- a lossless call (and any call that fell back) must be eager's bits
  (`numerics.same_bits`: signed zeros count, NaN equals NaN);
- a high call served by its fast path must keep the high contract against
  float64 (`numerics.high_contract`);
- where the op binds its launch (`OpSpec.bind`, what a site keeps for later
  calls of the same metadata), that launch, run on another draw of the same
  case, must keep the same contract.

A case that breaks this is a *silent difference*: the gate let through a
kernel that is wrong on this draw. Its seed and description are printed; a
seed that finds one becomes a regression test. One summary line:
cases, signatures, fast paths, fallbacks, silent differences.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
import warnings
import zlib

import torch

from . import policy
from .numerics import differing, high_contract, same_bits
from .ops import SPECS, cases

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BATCHES = (1, 2, 3)
ROWS = (1, 2, 7, 31, 126, 257, 1031)
WIDTHS = {  # per op family: supported widths, and some the guards refuse (the fallbacks count too)
    "pointwise": (64, 100, 2048, 2240, 3072, 4096, 5120),
    "norm": (256, 1000, 1002, 2048, 3072, 4096, 5120),
    "rotary": (64, 130, 256, 2048, 4096),
    "qk": (128, 384, 2048, 4096),  # heads of 128 (FLUX, Qwen-Image) or rows of all heads (LTX-2)
    "gemm": (64, 100, 2240, 3072),  # projections: x [B, S, D], weights [D, D]
}


def _family(name: str) -> str:
    if name.startswith("rotary"):
        return "rotary"
    if name.startswith("qk"):
        return "qk"
    if name == "projections":
        return "gemm"
    return "norm" if "norm" in name else "pointwise"


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    index: int
    op: str
    tier: str
    case: cases.Case

    def describe(self) -> str:
        c = self.case
        return (f"case {self.index} (seed {c.seed}): {self.op}[{self.tier}] {str(c.dtype).replace('torch.', '')} "
                f"B={c.B} S={c.S} D={c.D} {c.layout}{' strided x' if c.strided else ''} {c.data}")


def draw_case(seed: int, index: int, device: str = "cuda") -> FuzzCase:
    """Case `index` of the run seeded `seed` (deterministic: the same pair, the same case)."""
    rng = random.Random(seed * 1_000_003 + index)
    name = rng.choice(sorted(SPECS))
    spec = SPECS[name]
    dtype = rng.choice(DTYPES)
    tier = rng.choice([t for t in spec.tiers if not (t == "high" and dtype is torch.float32)])
    case = cases.Case(
        B=rng.choice(BATCHES), S=rng.choice(ROWS), D=rng.choice(WIDTHS[_family(name)]), dtype=dtype,
        layout=rng.choice(spec.layouts), data=rng.choice(cases.DATA), seed=seed * 1_000_003 + index,
        device=device, strided=rng.random() < 0.25,
    )
    return FuzzCase(index, name, tier, case)


@dataclasses.dataclass
class Tally:
    cases: int = 0
    fast: int = 0
    fallbacks: int = 0
    silent: list = dataclasses.field(default_factory=list)
    signatures: set = dataclasses.field(default_factory=set)

    def line(self) -> str:
        return (f"fuzz: {self.cases} cases, {len(self.signatures)} signatures, {self.fast} fast paths, "
                f"{self.fallbacks} fallbacks, {len(self.silent)} silent differences")


def run_case(fc: FuzzCase, tally: Tally) -> None:
    """One case through the planner and the gate, compared with eager."""
    spec = SPECS[fc.op]
    args = spec.make_args(fc.case)
    tally.cases += 1
    plan = spec.plan(*args, tier=fc.tier)
    if plan.__class__ is str:
        out, fast = spec.reference(*args), False
        tally.signatures.add((fc.op, fc.tier, "planner: " + plan))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", policy.FallbackWarning)  # a mismatch at first sight is the gate's job
            out = policy.gated(spec, fc.tier, plan, args)
        fast = policy.state(spec, fc.tier, plan) is True
        tally.signatures.add((fc.op, fc.tier, plan.key))
    tally.fast += fast
    tally.fallbacks += not fast
    why = _miss(spec, fc.tier if fast else "lossless", out, args)
    if fast and fc.tier in spec.bind:
        # the launch a site keeps for this call's metadata, run on another draw of the same case
        later = spec.make_args(dataclasses.replace(fc.case, seed=fc.case.seed + 1))
        again = spec.bind[fc.tier](plan)(*later)
        if again is None:
            why = why or "the bound launch declined operands the planner accepted"
        else:
            why = why or _miss(spec, fc.tier, again, later, " (bound launch, another draw)")
    if why:
        tally.silent.append(f"{fc.describe()}: {why}")


def _miss(spec, tier: str, out, args, where: str = "") -> str | None:
    """How `out` breaks the contract of `tier` against eager on `args`, or None."""
    ref = spec.reference(*args)
    if tier == "high":
        why = high_contract(out, ref, spec.reference64(*args), spec.terms(*args))
    elif isinstance(ref, tuple):
        why = None if all(same_bits(o, r) for o, r in zip(out, ref)) else \
            f"{sum(differing(o, r) for o, r in zip(out, ref))} elements differ bitwise"
    else:
        why = None if same_bits(out, ref) else f"{differing(out, ref)} of {ref.numel()} elements differ bitwise"
    return why and why + where


def run(n: int, seed: int = 0, device: str = "cuda", progress: bool = False, indices=None) -> Tally:
    """`n` cases of the run seeded `seed` (or only `indices` of it), through one gate."""
    tally = Tally()
    t0 = time.perf_counter()
    todo = range(n) if indices is None else indices
    for k, i in enumerate(todo):
        run_case(draw_case(seed, i, device), tally)
        if progress and (k + 1) % 500 == 0:
            print(f"  {k + 1} cases, {len(tally.signatures)} signatures, {len(tally.silent)} silent, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return tally


def _worker(args):
    n, seed, device, shard, shards = args
    if torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
    # a shard takes whole (op, dtype, width) groups, so workers compile different kernels
    indices = [i for i in range(n) if zlib.crc32(repr(_group(draw_case(seed, i, device))).encode()) % shards == shard]
    tally = run(n, seed, device, indices=indices)
    return tally.cases, tally.fast, tally.fallbacks, tally.silent, tally.signatures


def _group(fc: FuzzCase) -> tuple:
    return (fc.op, str(fc.case.dtype), fc.case.D)


def run_parallel(n: int, seed: int = 0, workers: int = 1, device: str = "cuda") -> Tally:
    """`run` split over `workers` processes on one GPU (Triton compiles in parallel)."""
    if workers <= 1:
        return run(n, seed, device, progress=True)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        parts = pool.map(_worker, [(n, seed, device, w, workers) for w in range(workers)])
    tally = Tally()
    for c, f, fb, silent, sigs in parts:
        tally.cases += c
        tally.fast += f
        tally.fallbacks += fb
        tally.silent += silent
        tally.signatures |= sigs
    return tally
