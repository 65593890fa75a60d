"""Projections of one input as one GEMM (`ops.projections`) against the separate calls,
at the shapes the integrations run: bitwise check, device time, host time.

    python -m bench.projections                  # every case below, bf16
    python -m bench.projections --cases sana-self,sana-caption

A case: `nn.Linear` modules K -> N_i reading one x [B, S, K] (the stock calls), packed
as `accelerate` packs them (`sites.pack_linears`). Rows, per case:
- exact: the fused GEMM's parts (launched past the gate) and the site's result
  (`sites.linear_projections_site`, first sight then the bound launch) bitwise equal to
  the separate calls (`numerics.same_bits`), and the gate's verdict;
- device µs a call, separate and fused: CUDA graphs over x sets beyond the L2, the two
  variants in interleaved rounds, the median (bench/timing.py);
- host µs a call at the real shape, separate (`F.linear` each) and the site: the loop
  timed without synchronising (the GPU runs behind; 100 calls queue well under the
  launch queue's depth), the minimum of 7 loops.
Writes bench/results/projections-<gpu>.json.

Cases (B, S, K, parts, bias): sana-self (2, 1024, 2240, 3 x 2240, no bias), sana-caption
(2, 300, 2240, 2 x 2240, bias: 64 zero rows pad the gap), sana-caption-20 (the 20 blocks'
k, v of one caption: 40 parts), flux-image (1, 4096, 3072, 3 x 3072, bias), flux-text
(1, 512, ...), wan (1, 32760, 5120, 3 x 5120, bias), ltx2-video (2, 6144, 4096, 3 x 4096,
bias), ltx2-audio (2, 126, 2048, 3 x 2048, bias).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.timing import GraphTimer, interleaved_us, sets_for
from bitfuse import policy, sites
from bitfuse.numerics import same_bits
from bitfuse.ops import projections

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: name -> (B, S, K, parts' widths, bias)
CASES = {
    "sana-self": (2, 1024, 2240, (2240,) * 3, False),
    "sana-caption": (2, 300, 2240, (2240,) * 2, True),
    "sana-caption-20": (2, 300, 2240, (2240,) * 40, True),
    "flux-image": (1, 4096, 3072, (3072,) * 3, True),
    "flux-text": (1, 512, 3072, (3072,) * 3, True),
    "wan": (1, 32760, 5120, (5120,) * 3, True),
    "ltx2-video": (2, 6144, 4096, (4096,) * 3, True),
    "ltx2-audio": (2, 126, 2048, (2048,) * 3, True),
}


def linears(K, widths, bias, dtype=torch.bfloat16, device="cuda", seed=0):
    """The case's `nn.Linear` modules (torch's default init), without autograd."""
    torch.manual_seed(seed)
    mods = []
    for n in widths:
        m = torch.nn.Linear(K, n, bias=bias, device=device, dtype=dtype).requires_grad_(False)
        mods.append(m)
    return mods


def host_us(fn, n: int = 100, loops: int = 7) -> float:
    """Host microseconds a call at the real shape (see the module docstring)."""
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return best


def run_case(name: str) -> dict:
    B, S, K, widths, bias = CASES[name]
    mods = linears(K, widths, bias)
    assert sites.pack_linears(*mods), name
    weights = tuple(m.weight for m in mods)
    biases = tuple(m.bias for m in mods)
    out_bytes = B * S * sum(widths) * 2
    xs = [torch.randn(B, S, K, device="cuda", dtype=torch.bfloat16) for _ in range(sets_for(B * S * K * 2 + out_bytes, 8))]
    row = dict(case=name, B=B, S=S, K=K, parts=len(widths), widths=widths[0], bias=bias,
               rows_packed=projections.layout(weights)[1])
    with torch.no_grad():
        ref = projections.projections_reference(xs[0], weights, biases)
        plan = projections.plan_projections(xs[0], weights, biases)
        fused = projections.launch_projections(plan)
        site = [sites.linear_projections_site(xs[0], *mods) for _ in range(2)]  # first sight, bound
        row["exact"] = all(same_bits(o, r) for outs in (fused, *site) for o, r in zip(outs, ref))
        row["verdict"] = policy.state(projections.SPEC, "lossless", plan)
        timers = {
            "separate": GraphTimer([lambda x=x: [F.linear(x, w, b) for w, b in zip(weights, biases)] for x in xs]),
            "fused": GraphTimer([lambda x=x: projections.launch_projections(
                projections.plan_projections(x, weights, biases)) for x in xs]),
        }
        us = interleaved_us(timers)
        for t in timers.values():
            t.close()
        row.update(separate_us=round(us["separate"], 2), fused_us=round(us["fused"], 2))
        x = xs[0]
        row["separate_host_us"] = round(host_us(lambda: [F.linear(x, w, b) for w, b in zip(weights, biases)]), 2)
        row["site_host_us"] = round(host_us(lambda: sites.linear_projections_site(x, *mods)), 2)
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.projections", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", help=f"comma-separated (default all: {', '.join(CASES)})")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    args.names = [n for n in (args.cases or "").split(",") if n] or list(CASES)
    unknown = [n for n in args.names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/projections.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    gpu = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"projections-{slug}.json")
    rows: list = []
    result = dict(bench="projections", gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python -m bench.projections " + " ".join(sys.argv[1:] if argv is None else argv),
                  dtype="bfloat16", method=__doc__.strip(), rows=rows)
    print(f"{'case':16s} {'exact':>5s} {'verdict':>8s} {'sep us':>8s} {'fused us':>8s} {'sep host':>8s} {'site host':>9s}")
    for name in args.names:
        row = run_case(name)
        rows.append(row)
        torch.cuda.empty_cache()
        with open(path, "w") as f:  # after every case: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
        print(f"{name:16s} {str(row['exact']):>5s} {str(row['verdict']):>8s} {row['separate_us']:8.1f} "
              f"{row['fused_us']:8.1f} {row['separate_host_us']:8.1f} {row['site_host_us']:9.1f}")
    ratio = [r["separate_us"] / r["fused_us"] for r in rows if r["fused_us"]]
    if ratio:
        print(f"device time separate / fused: median {statistics.median(ratio):.2f}x; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
