"""Accuracy of the fused norm + modulate kernels against eager and against fp64.

    python3 bench/norm_accuracy.py [--out bench/results] [--S 6144] [--D 4096]

For each reference (diffusers' RMSNorm, F.rms_norm, F.layer_norm), dtype
(bf16, fp16) and input kind, on per-sample strided parameters as diffusers
makes them:
  * eager: the reference norm followed by eager's modulate (three roundings);
  * lossless: the exact kernel (counts elements that differ from eager: 0 expected);
  * high-r0, high-r1, high-r2: the one-pass kernel with one rounding at the end
    (r0), eager's roundings of n and 1 + scale then one FMA (r1), or all of
    eager's roundings (r2, the shipped HIGH_ROUNDING), the sum in any order.
Each output is compared
  * with eager: ULP distance histogram (0, 1, 2, 3, >= 4 ULP of the output), and
    the largest distance in ULPs at the scale of the modulate's largest term
    (|n * t|, |shift|, |out|: the gate's one-ULP criterion, bitfuse.numerics);
  * with fp64 (the norm and the modulate computed in float64 from the same
    inputs): the histogram of ULP distances to the correctly rounded value, and
    the mean and largest |out - exact| in ULPs at the scale of the largest term.
Writes norm-accuracy-<gpu>.json and .txt. `--smoke` runs tiny shapes on CPU
under Triton's interpreter (a check that the script runs; no results written).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import sys
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("randn", "mixed")
VARIANTS = ("eager", "lossless", "high-r0", "high-r1", "high-r2")


def inputs(S, D, dtype, kind, device, seed):
    """x [1, S, D]; scale, shift: unbind views of a [1, 1, 6, D] table. "mixed": rows of
    large and small magnitude, tiny variance, a constant value, an offset mean."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, S, D, generator=g, device=device)
    if kind == "mixed":
        k = torch.randint(0, 6, (1, S, 1), generator=g, device=device)
        x = torch.where(k == 1, x * 1e3, x)
        x = torch.where(k == 2, 3.0 + 1e-2 * x, x)
        x = torch.where(k == 3, x[..., :1].expand_as(x), x)
        x = torch.where(k == 4, 10.0 + x, x)
        x = torch.where(k == 5, x * 1e-3, x)
    table = (torch.randn(1, 1, 6, D, generator=g, device=device) * 0.5).to(dtype)
    shift, scale = table.unbind(2)[:2]
    return x.to(dtype), scale, shift


def fp64_value(ref, x, scale, shift):
    x64 = x.double()
    if ref == "layer_norm":
        x64 = x64 - x64.mean(-1, keepdim=True)
    n64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    return n64, n64 * (1 + scale.double()) + shift.double()


def hist(d):
    return torch.bincount(d.clamp(max=4).flatten(), minlength=5).tolist()


def evaluate(ref, dtype, kind, S, D, device, cpu):
    from bitfuse.numerics import ulp_distance, ulp_of
    LN = importlib.import_module("bitfuse.ops.layer_norm_modulate")  # the modules, not the functions
    RMS = importlib.import_module("bitfuse.ops.rms_norm_modulate")  # bitfuse.ops re-exports by those names

    x, scale, shift = inputs(S, D, dtype, kind, device, seed=zlib.crc32(f"{ref}/{kind}/{dtype}".encode()))
    if ref == "layer_norm":
        mod, plan = LN, LN._plan(x, scale, shift, EPS, True, cpu_ok=cpu)
        eager = LN.layer_norm_modulate_reference(x, scale, shift, EPS)
    else:
        mod, plan = RMS, RMS._plan(x, scale, shift, EPS, ref, True, cpu_ok=cpu)
        eager = RMS.rms_norm_modulate_reference(x, scale, shift, EPS, ref)
    if isinstance(plan, str):
        raise RuntimeError(f"{ref}: the kernel does not take this shape: {plan}")
    launch = LN.launch_layer_norm_modulate if ref == "layer_norm" else RMS.launch_rms_norm_modulate
    n64, v64 = fp64_value(ref, x, scale, shift)
    exact = v64.to(dtype)
    # the scale of the modulate's largest term, per element
    mag = (n64 * (1 + scale.double())).abs().maximum(shift.double().abs()).maximum(v64.abs()).float()
    unit = ulp_of(mag, dtype).double()
    rows = {}
    shipped = mod.HIGH_ROUNDING
    try:
        for variant in VARIANTS:
            if variant == "eager":
                out = eager
            else:
                mod.HIGH_ROUNDING = int(variant[-1]) if variant.startswith("high") else shipped
                out = torch.full_like(x, float("nan"))
                launch(plan, variant == "lossless", out=out)
            d_eager = ulp_distance(out, eager)
            at_mag = torch.where(out == eager, 0.0, (out.double() - eager.double()).abs() / unit)
            err = (out.double() - v64).abs() / unit
            rows[variant] = dict(
                vs_eager_hist=hist(d_eager), vs_eager_differ=int((d_eager > 0).sum()),
                vs_eager_max_ulp_at_term_scale=round(float(at_mag.max()), 3),
                vs_fp64_hist=hist(ulp_distance(out, exact)),
                vs_fp64_mean_ulp=round(float(err.mean()), 4), vs_fp64_max_ulp=round(float(err.max()), 3),
                nan=int(out.isnan().sum()),
            )
    finally:
        mod.HIGH_ROUNDING = shipped
    return dict(reference=ref, dtype=str(dtype).replace("torch.", ""), kind=kind, S=S, D=D,
                numel=x.numel(), shipped_high_rounding=shipped, variants=rows)


def table(results):
    lines = [f"{'reference':10s} {'dtype':8s} {'kind':6s} {'variant':9s} | vs eager: differ  hist[0,1,2,3,>=4]"
             f"{'':24s} max@term | vs fp64: hist[0,1,2,3,>=4]{'':28s} mean   max (ULP@term)"]
    for r in results:
        for v, m in r["variants"].items():
            lines.append(f"{r['reference']:10s} {r['dtype']:8s} {r['kind']:6s} {v:9s} | {m['vs_eager_differ']:10d}  "
                         f"{str(m['vs_eager_hist']):40s} {m['vs_eager_max_ulp_at_term_scale']:8.3f} | "
                         f"{str(m['vs_fp64_hist']):52s} {m['vs_fp64_mean_ulp']:.4f} {m['vs_fp64_max_ulp']:6.3f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--S", type=int, default=6144)
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device, S, D = "cpu", 5, 512
    elif not torch.cuda.is_available():
        sys.exit("bench/norm_accuracy.py needs a CUDA GPU (or --smoke)")
    else:
        device, S, D = "cuda", args.S, args.D
    import triton

    results = []
    for ref in ("diffusers", "aten", "layer_norm"):
        for dname, dtype in DTYPES.items():
            for kind in KINDS:
                results.append(evaluate(ref, dtype, kind, S, D, device, args.smoke))
                print(f"  {ref} {dname} {kind}: done", flush=True)
    text = table(results)
    print(text)
    if args.smoke:
        return
    gpu = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    head = (f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; 1 x {S} x {D}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"norm-accuracy-{slug}.json"), "w") as f:
        json.dump(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, shape=[1, S, D], eps=EPS,
                       method=__doc__.strip(), results=results), f, indent=1)
    with open(os.path.join(args.out, f"norm-accuracy-{slug}.txt"), "w") as f:
        f.write(head + "\n" + __doc__.strip() + "\n\n" + text + "\n")
    print(f"wrote {args.out}/norm-accuracy-{slug}.json and .txt")


if __name__ == "__main__":
    main()
