"""`bitfuse verify`: which fast paths are active here, and do they keep their contract?

For each op (`bitfuse.ops.SPECS`) x tier with a kernel x dtype x parameter
layout, runs the kernel and eager on a sweep of shapes with fresh random
inputs, each launch into a NaN-poisoned output, and compares: lossless paths
must be bitwise equal to eager (signed zeros count, NaN equals NaN), high paths
must keep the high contract against float64 (`numerics.high_contract`). A path
whose bits depend on a library's choice per problem (`OpSpec.may_differ`: the
projections' GEMM) and differs on a shape is reported as an eager fallback there,
which is what the gate makes of it. An op's `OpSpec.probe` runs after each shape's
comparison, as the gate runs it: a why is a mismatch (an eager fallback for such a
path).
"""

from __future__ import annotations

import json
import platform
import sys

import torch

from .numerics import differing, high_contract, same_bits
from .ops import SPECS, cases
from .ops._launch import HAS_TRITON

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPES = [(1, 126, 2048), (2, 1031, 3072), (2, 1, 4096), (1, 6144, 4096), (2, 257, 5120)]
QUICK_SHAPES = [(1, 126, 2048), (2, 1031, 3072), (2, 1, 4096)]


def jobs() -> list[tuple]:
    """(spec, tier, dtype name, layout) for every path: fp32 norm sites take the
    lossless kernel in every tier, so their high rows are not listed."""
    out = []
    for spec in SPECS.values():
        for tier in spec.tiers:
            for dn in DTYPES:
                if tier == "high" and dn == "fp32":
                    continue
                out.extend((spec, tier, dn, layout) for layout in spec.layouts)
    return out


def _poisoned(ref):
    if isinstance(ref, tuple):
        return tuple(_poisoned(r) for r in ref)
    return torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=ref.device)


def check(spec, tier: str, dtype, layout: str, shapes, seed: int = 0, data: str = "randn") -> dict:
    """One path on `shapes`: {"status": verified | mismatch | error | eager fallback, "detail"}."""
    for i, (B, S, D) in enumerate(shapes):
        args = spec.make_args(cases.Case(B, S, D, dtype, layout, data, seed + i))
        plan = spec.plan(*args, tier=tier)
        if plan.__class__ is str:
            return dict(status="eager fallback", detail=plan)
        ref = spec.reference(*args)
        for launch_no in (1, 2):  # the first launch compiles through Triton, the second is the direct launch
            try:
                out = spec.launch[tier](plan, out=_poisoned(ref))
            except Exception as exc:  # a failing kernel is a finding, not a crash
                return dict(status="error", detail=f"{type(exc).__name__}: {exc}")
            where = f"B={B} S={S} D={D}, launch {launch_no}"
            if tier == "high":
                why = high_contract(out, ref, spec.reference64(*args), spec.terms(*args))
                if why:
                    return dict(status="mismatch", detail=f"{why} at {where}")
            else:
                pairs = zip(out, ref) if isinstance(ref, tuple) else ((out, ref),)
                for o, r in pairs:
                    if not same_bits(o, r):
                        found = f"{differing(o, r)} of {r.numel()} differ at {where}"
                        if spec.may_differ:  # the gate gives this problem the reference
                            return dict(status="eager fallback", detail=f"{found}: {spec.may_differ}")
                        return dict(status="mismatch", detail=found)
        why = spec.probe_why(plan)  # the gate's check beyond the data, as it runs it
        if why:
            status = "eager fallback" if spec.may_differ else "mismatch"
            return dict(status=status, detail=f"B={B} S={S} D={D}: {why}")
    contract = "high contract (float64)" if tier == "high" else "bitwise"
    return dict(status="verified", detail=f"{len(shapes)} shapes, {contract}")


def run_checks(quick: bool = False, progress=None) -> dict:
    """The report as a dict: versions, and one row per op x tier x dtype x layout
    (none without a CUDA device: every path runs eager there)."""
    import importlib.metadata as md

    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = None
    cuda = torch.cuda.is_available()
    report = dict(
        gpu=torch.cuda.get_device_name() if cuda else None,
        capability=".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        torch=torch.__version__,
        triton=triton_version,
        python=platform.python_version(),
        cuda=cuda,
        paths=[],
    )
    if not cuda or not HAS_TRITON:
        return report
    shapes = QUICK_SHAPES if quick else SHAPES
    todo = jobs()
    for i, (spec, tier, dn, layout) in enumerate(todo):
        row = dict(op=spec.name, tier=tier, dtype=dn, layout=layout)
        row.update(check(spec, tier, DTYPES[dn], layout, shapes))
        report["paths"].append(row)
        if progress:
            progress(i + 1, len(todo), row)
    return report


def format_table(report: dict) -> str:
    lines = [
        f"GPU: {report['gpu'] or 'none'}" + (f" (sm_{report['capability'].replace('.', '')})" if report["capability"] else ""),
        f"torch {report['torch']}, triton {report['triton'] or 'not installed'}, python {report['python']}",
    ]
    if not report["cuda"]:
        lines.append("No CUDA device: every site runs eager PyTorch here (exact by construction); nothing to verify.")
        return "\n".join(lines)
    if not report["paths"]:
        lines.append("Triton is not installed: every site runs eager PyTorch here; nothing to verify.")
        return "\n".join(lines)
    head = ("op", "tier", "dtype", "layout", "status", "detail")
    rows = [head] + [tuple(str(p[k]) for k in head) for p in report["paths"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    counts: dict = {}
    for p in report["paths"]:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    lines.append("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer shapes per path")
    parser.add_argument("--fuzz", type=int, default=0, metavar="N",
                        help="instead: N seeded random cases through the gate, each compared with eager (bitfuse.fuzz)")
    parser.add_argument("--seed", type=int, default=0, help="the fuzz run's seed (default 0)")
    parser.add_argument("--workers", type=int, default=1, help="fuzz processes on the GPU (default 1)")


def _fuzz(args) -> int:
    from . import fuzz

    if not torch.cuda.is_available() or not HAS_TRITON:
        print("bitfuse verify: no CUDA device with Triton here: every site runs eager PyTorch; nothing to fuzz.")
        return 0
    tally = fuzz.run_parallel(args.fuzz, seed=args.seed, workers=args.workers)
    for line in tally.silent:
        print("SILENT DIFFERENCE " + line)
    line = tally.line() + f" (seed {args.seed})"
    print(json.dumps({"summary": line, "cases": tally.cases, "signatures": len(tally.signatures), "fast": tally.fast,
                      "fallbacks": tally.fallbacks, "silent": tally.silent}, indent=1) if args.json else line)
    return 1 if tally.silent else 0


def main(args) -> int:
    if args.fuzz:
        return _fuzz(args)
    cuda = torch.cuda.is_available()

    def progress(i, n, row):
        if not args.json and sys.stderr.isatty():
            print(f"\r[{i}/{n}] {row['op']} {row['tier']} {row['dtype']} {row['layout']}".ljust(78),
                  end="", file=sys.stderr, flush=True)

    report = run_checks(quick=args.quick, progress=progress)
    if cuda and not args.json and sys.stderr.isatty():
        print(file=sys.stderr)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    bad = [p for p in report["paths"] if p["status"] in ("mismatch", "error")]
    return 1 if bad else 0
