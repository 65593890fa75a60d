"""Accuracy of the norm + modulate paths against float64 (issue 17's evidence).

    python -m bench.norm_accuracy [--S 6144] [--D 4096] [--out bench/results]

For each reference (diffusers' RMSNorm, aten's F.rms_norm, F.layer_norm: the specs
`rms_norm_modulate[diffusers]`, `rms_norm_modulate[aten]`, `layer_norm_modulate`),
dtype (bf16, fp16) and row draw (`cases.draw`: randn, and outlier: a few channels
64x larger), on per-sample parameters as diffusers hands them (strided views of one
[B, 1, n, D] tensor), three outputs:
  eager     the spec's reference (the norm, then three roundings of the modulate);
  lossless  the exact kernel (must equal eager bit for bit);
  high      the one-pass kernel (one rounding at the end).
Each against the float64 value of the same expression (`spec.reference64`): mean
and max error in ULPs of the output dtype at the scale of the expression's largest
term (`numerics.ulp_errors` with `spec.terms`); against eager: how many elements
differ bitwise (`numerics.differing`) and the largest ULP distance; and whether
the high tier's contract (`numerics.high_contract`: within one ULP everywhere,
mean no worse than eager's) holds. Kernels launch into NaN-poisoned buffers.
Writes norm-accuracy-<gpu>.json and .txt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch

from bitfuse import numerics
from bitfuse.ops import SPECS, cases

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REFERENCES = {"diffusers": "rms_norm_modulate[diffusers]", "aten": "rms_norm_modulate[aten]",
              "layer_norm": "layer_norm_modulate"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DATA = ("randn", "outlier")
LAYOUT = "unbind-sample"  # [B, 1, D] views of a [B, 1, n, D] tensor, as LTX-2's get_mod_params makes them


def _poisoned(ref):
    return torch.full(ref.shape, float("nan"), dtype=ref.dtype, device=ref.device)


def evaluate(reference: str, dtype, data: str, S: int, D: int, device: str, seed: int = 0) -> dict:
    """One row: eager, lossless and high against float64 and against eager."""
    spec = SPECS[REFERENCES[reference]]
    args = spec.make_args(cases.Case(1, S, D, dtype, LAYOUT, data, seed, device))
    eager = spec.reference(*args)
    ref64, terms64 = spec.reference64(*args), spec.terms(*args)
    row = dict(reference=reference, op=spec.name, dtype=str(dtype).replace("torch.", ""), data=data, S=S, D=D,
               numel=eager.numel(), variants={})
    for variant in ("eager", "lossless", "high"):
        if variant == "eager":
            out = eager
        else:
            plan = spec.plan(*args, tier=variant)
            if plan.__class__ is str:
                row["variants"][variant] = dict(error=f"no kernel for this case: {plan}")
                continue
            out = spec.launch[spec.kernel_tier(variant)](plan, out=_poisoned(eager))
        err = numerics.ulp_errors(out, ref64, terms64)
        finite = torch.isfinite(err)
        row["variants"][variant] = dict(
            mean_ulp=round(float(err[finite].mean()), 4), max_ulp=round(float(err[finite].max()), 3),
            nonfinite=int((~finite).sum()), differ_from_eager=numerics.differing(out, eager),
            max_ulp_from_eager=numerics.max_ulp(out, eager),
            high_contract=numerics.high_contract(out, eager, ref64, terms64) or "holds")
    return row


def table(rows) -> str:
    head = (f"{'reference':10s} {'dtype':8s} {'data':7s} {'variant':8s} {'mean ULP':>9s} {'max ULP':>8s} "
            f"{'differ from eager':>18s} {'max ULP from eager':>18s}  high contract")
    lines = [head]
    for r in rows:
        for v, m in r["variants"].items():
            if "error" in m:
                lines.append(f"{r['reference']:10s} {r['dtype']:8s} {r['data']:7s} {v:8s} {m['error']}")
                continue
            lines.append(f"{r['reference']:10s} {r['dtype']:8s} {r['data']:7s} {v:8s} {m['mean_ulp']:9.4f} "
                         f"{m['max_ulp']:8.3f} {m['differ_from_eager']:18,d} {m['max_ulp_from_eager']:18d}  "
                         f"{m['high_contract']}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.norm_accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=6144, help="rows (tokens)")
    ap.add_argument("--D", type=int, default=4096, help="width")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only runs eager (kernels need a GPU)")
    ap.add_argument("--out", default=RESULTS)
    return ap.parse_args(argv)


def run(S: int, D: int, device: str) -> list[dict]:
    rows = []
    for reference in REFERENCES:
        for dtype in DTYPES.values():
            for data in DATA:
                rows.append(evaluate(reference, dtype, data, S, D, device))
                print(f"  {reference} {dtype} {data}: done", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/norm_accuracy.py needs a CUDA GPU (--device cpu runs eager only)", file=sys.stderr)
        return 2
    import triton

    rows = run(args.S, args.D, args.device)
    text = table(rows)
    print(text)
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    head = (f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; 1 x {args.S} x {args.D}")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"norm-accuracy-{slug}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(bench="norm_accuracy", gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                       shape=[1, args.S, args.D], layout=LAYOUT, method=__doc__.strip(), rows=rows), f, indent=1)
    with open(stem + ".txt", "w") as f:
        f.write(head + "\n\n" + __doc__.strip() + "\n\n" + text + "\n")
    print(f"wrote {stem}.json and .txt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
