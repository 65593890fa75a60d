"""`bitfuse verify`: which fast paths are active here, and are they exact?

For each op x dtype x parameter layout x tier (and RoPE per frequency layout), runs the fast path and eager
on a sweep of shapes with fresh random inputs and compares them: lossless
paths must be `torch.equal` to eager, high paths within one ULP.
"""

from __future__ import annotations

import json
import platform
import sys

import torch
import torch.nn.functional as F

from .numerics import max_ulp, same_values, within_one_ulp_at
from .ops import gated_residual as _g  # noqa: F401  (modules, reached through sys.modules)
from .ops import layer_norm_modulate as _ln  # noqa: F401
from .ops import modulate as _m  # noqa: F401
from .ops import rms_norm_modulate as _rms  # noqa: F401
from .ops import rotary as _rot  # noqa: F401
from .ops._pointwise import HAS_TRITON
from .sites import NORM_HIGH_ULPS

M = sys.modules["bitfuse.ops.modulate"]
G = sys.modules["bitfuse.ops.gated_residual"]
RMS = sys.modules["bitfuse.ops.rms_norm_modulate"]
LN = sys.modules["bitfuse.ops.layer_norm_modulate"]
ROT = sys.modules["bitfuse.ops.rotary"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("per-sample", "per-token", "shared", "strided")
TIERS = {"lossless": True, "high": False}  # tier -> exact flag of the launcher
SHAPES = [(1, 126, 2048), (2, 1031, 3072), (2, 1, 4096), (1, 6144, 4096), (2, 257, 5120)]
QUICK_SHAPES = [(1, 126, 2048), (2, 1031, 3072), (2, 1, 4096)]

EPS = 1e-6
POINTWISE = ("modulate", "gated_residual")


def _mod_terms(n, c, h):
    return (n.float() * (1 + c.float())).abs().maximum(h.float().abs())


def _ops():
    """(name, make_plan(x, y, scale, shift, gate, exact), launch(plan, exact), reference(...),
    terms(...): the magnitude of the op's largest term, the high tier's ULP scale)."""
    return [
        ("modulate",
         lambda x, y, c, h, g, e: M.plan_modulate(x, c, h),
         lambda plan, exact, out: M.launch_modulate(plan, out=out),
         lambda x, y, c, h, g: M.modulate_reference(x, c, h),
         lambda x, y, c, h, g: _mod_terms(x, c, h)),
        ("gated_residual",
         lambda x, y, c, h, g, e: G.plan_gated_residual(x, y, g),
         lambda plan, exact, out: G.launch_gated_residual(plan, out=out),
         lambda x, y, c, h, g: G.gated_residual_reference(x, y, g),
         lambda x, y, c, h, g: x.float().abs().maximum((y.float() * g.float()).abs())),
        ("rms_norm_modulate[diffusers]",
         lambda x, y, c, h, g, e: RMS.plan_rms_norm_modulate(x, c, h, EPS, "diffusers", exact=e),
         lambda plan, exact, out: RMS.launch_rms_norm_modulate(plan, exact),
         lambda x, y, c, h, g: RMS.rms_norm_modulate_reference(x, c, h, EPS, "diffusers"),
         lambda x, y, c, h, g: _mod_terms(RMS.rms_norm_reference(x, EPS, "diffusers"), c, h)),
        ("rms_norm_modulate[aten]",
         lambda x, y, c, h, g, e: RMS.plan_rms_norm_modulate(x, c, h, EPS, "aten", exact=e),
         lambda plan, exact, out: RMS.launch_rms_norm_modulate(plan, exact),
         lambda x, y, c, h, g: RMS.rms_norm_modulate_reference(x, c, h, EPS, "aten"),
         lambda x, y, c, h, g: _mod_terms(RMS.rms_norm_reference(x, EPS, "aten"), c, h)),
        ("layer_norm_modulate",
         lambda x, y, c, h, g, e: LN.plan_layer_norm_modulate(x, c, h, EPS, exact=e),
         lambda plan, exact, out: LN.launch_layer_norm_modulate(plan, exact),
         lambda x, y, c, h, g: LN.layer_norm_modulate_reference(x, c, h, EPS),
         lambda x, y, c, h, g: _mod_terms(F.layer_norm(x, (x.shape[-1],), eps=EPS), c, h)),
    ]


def _operands(layout, B, S, D, dtype, gen):
    x = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=gen) * 2
    y = torch.randn(B, S, D, device="cuda", dtype=dtype, generator=gen)
    if layout == "per-sample":
        c, h, g = (torch.randn(B, 1, D, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    elif layout == "per-token":
        c, h, g = (torch.randn(B, S, D, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    elif layout == "shared":
        c, h, g = (torch.randn(D, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    else:  # the unbind views diffusers makes of a [B, T, n, D] table
        c, h, g = torch.randn(B, S, 6, D, device="cuda", dtype=dtype, generator=gen).unbind(2)[:3]
    return x, y, c, h, g


def _check(op, tier, dtype, layout, shapes, gen) -> dict:
    name, make_plan, launch, reference, terms = op
    exact = TIERS[tier]
    worst, checked = 0, 0
    for B, S, D in shapes:
        args = _operands(layout, B, S, D, dtype, gen)
        plan = make_plan(*args, exact)
        if isinstance(plan, str):
            return dict(status="eager fallback", detail=plan)
        ref = reference(*args)
        for launch_no in (1, 2):  # the first launch compiles through Triton, the second is the direct launch
            out = torch.full(args[0].shape, float("nan"), dtype=dtype, device="cuda")
            try:
                result = launch(plan, exact, out=out)
                if result is not out:
                    out.copy_(result)
            except Exception as exc:  # a failing kernel is a finding, not a crash
                return dict(status="error", detail=f"{type(exc).__name__}: {exc}")
            where = f"B={B} S={S} D={D}, launch {launch_no}"
            if exact and not same_values(out, ref):
                return dict(status="mismatch", detail=f"{int((out != ref).sum())} of {ref.numel()} differ at {where}")
            if not exact:
                worst = max(worst, max_ulp(out, ref))
                if not within_one_ulp_at(out, ref, terms(*args).maximum(ref.float().abs()), NORM_HIGH_ULPS):
                    return dict(status="mismatch", detail=f"over {NORM_HIGH_ULPS} ULPs of the terms at {where}")
        checked += 1
    detail = (f"{checked} shapes, torch.equal" if exact
              else f"{checked} shapes, <= {NORM_HIGH_ULPS} ULPs of the terms (max {worst} ULP of the output)")
    return dict(status="verified", detail=detail)


# RoPE: frequency layouts as diffusers builds them (interleaved: [B, S, C] per sample or
# shared by the batch; split: [B, H, S, r] dense or the swapaxes view diffusers passes)
ROTARY_LAYOUTS = {"interleaved": ("per-sample", "batch-broadcast"), "split": ("dense", "strided")}


def _rotary_operands(rope_type, layout, B, S, C, dtype, gen):
    q, k = (torch.randn(B, S, C, device="cuda", dtype=dtype, generator=gen) * 2 for _ in range(2))
    if rope_type == "interleaved":
        shape = (1 if layout == "batch-broadcast" else B, S, C)
    else:
        shape = (B, S, C // 128, 64)
    theta = torch.rand(*shape, device="cuda", generator=gen) * 40 - 20
    freqs = theta.cos(), theta.sin()
    if rope_type == "split":
        freqs = tuple(f.swapaxes(1, 2) for f in freqs)
        if layout == "dense":
            freqs = tuple(f.contiguous() for f in freqs)
    return q, k, freqs


def _check_rotary(rope_type, dtype, layout, shapes, gen) -> dict:
    for B, S, C in shapes:
        q, k, freqs = _rotary_operands(rope_type, layout, B, S, C, dtype, gen)
        plan = ROT.plan_rotary(q, *freqs, rope_type, y=k)
        if isinstance(plan, str):
            return dict(status="eager fallback", detail=plan)
        refs = ROT.rotary_reference(q, freqs, rope_type), ROT.rotary_reference(k, freqs, rope_type)
        for launch_no in (1, 2):
            out = tuple(torch.full(r.shape, float("nan"), dtype=dtype, device="cuda") for r in refs)
            try:
                ROT.launch_rotary(plan, out=out)
            except Exception as exc:
                return dict(status="error", detail=f"{type(exc).__name__}: {exc}")
            for o, r in zip(out, refs):
                if not same_values(o, r):
                    return dict(status="mismatch", detail=f"{int((o != r).sum())} of {r.numel()} differ at "
                                                          f"B={B} S={S} C={C}, launch {launch_no}")
    return dict(status="verified", detail=f"{len(shapes)} shapes, query+key, torch.equal")


def run_checks(quick: bool = False, progress=None) -> dict:
    """The report as a dict: versions, and one row per op x dtype x layout x tier."""
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
    shapes = QUICK_SHAPES if quick else SHAPES
    gen = torch.Generator(device="cuda").manual_seed(0) if cuda else None
    # modulate and gated_residual have one kernel, exact in every tier: listed once;
    # fp32 norm sites take the exact kernel in every tier (sites._norm_mode)
    jobs = [(op, tier, dn, layout) for op in _ops() for tier in TIERS for dn in DTYPES for layout in LAYOUTS
            if tier == "lossless" or (op[0] not in POINTWISE and dn != "fp32")]
    jobs += [(rope_type, "all", dn, layout) for rope_type, layouts in ROTARY_LAYOUTS.items()
             for dn in DTYPES for layout in layouts]
    for i, (op, tier, dn, layout) in enumerate(jobs):
        rope = op in ROTARY_LAYOUTS
        name = f"rotary[{op}]" if rope else op[0]
        row = dict(op=name, tier="all" if rope or name in POINTWISE or dn == "fp32" else tier, dtype=dn, layout=layout)
        if not cuda:
            row.update(status="eager fallback", detail="no CUDA device")
        elif not HAS_TRITON:
            row.update(status="eager fallback", detail="triton is not installed")
        elif rope:
            row.update(_check_rotary(op, DTYPES[dn], layout, shapes, gen))
        else:
            row.update(_check(op, tier, DTYPES[dn], layout, shapes, gen))
        report["paths"].append(row)
        if progress:
            progress(i + 1, len(jobs), row)
    return report


def format_table(report: dict) -> str:
    lines = [
        f"GPU: {report['gpu'] or 'none'}" + (f" (sm_{report['capability'].replace('.', '')})" if report["capability"] else ""),
        f"torch {report['torch']}, triton {report['triton'] or 'not installed'}, python {report['python']}",
    ]
    if not report["cuda"]:
        lines.append("No CUDA device: every path runs eager PyTorch (exact by construction).")
    head = ("op", "tier", "dtype", "layout", "status", "detail")
    rows = [head] + [tuple(str(p[k]) for k in ("op", "tier", "dtype", "layout", "status", "detail"))
                     for p in report["paths"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    counts = {}
    for p in report["paths"]:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    lines.append("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer shapes per path")


def main(args) -> int:
    def progress(i, n, row):
        if not args.json and report_cuda:
            print(f"\r[{i}/{n}] {row['op']} {row['tier']} {row['dtype']} {row['layout']}".ljust(78),
                  end="", file=sys.stderr, flush=True)

    report_cuda = torch.cuda.is_available()
    report = run_checks(quick=args.quick, progress=progress)
    if report_cuda and not args.json:
        print(file=sys.stderr)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    bad = [p for p in report["paths"] if p["status"] in ("mismatch", "error")]
    return 1 if bad else 0
