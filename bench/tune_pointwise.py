"""Sweep launch shapes of the pointwise kernels on the GPU; check exactness of each.

    python3 bench/tune_pointwise.py [--out DIR]

Prints, per op and shape, the median time of each (BLOCK_R, BLOCK_D, num_warps)
with its exactness, the current default's time, and the host cost of one call
on tiny tensors (eager expression, raw launch, site). Used to pick
`_pointwise.launch_shape`; the numbers that count are bench/ops.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bitfuse import sites  # noqa: E402
from bitfuse.ops import gated_residual as _g  # noqa: E402,F401
from bitfuse.ops import modulate as _m  # noqa: E402,F401

M = sys.modules["bitfuse.ops.modulate"]
G = sys.modules["bitfuse.ops.gated_residual"]
from bitfuse.ops._pointwise import launch_shape  # noqa: E402


def copy_ceiling() -> float:
    src = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    return 2 * src.numel() * 2 / (t * 1e-3) / 1e12


def operands(B, S, D, per_token, dtype):
    x = torch.randn(B, S, D, device="cuda", dtype=dtype)
    y = torch.randn(B, S, D, device="cuda", dtype=dtype)
    T = S if per_token else 1
    table = torch.randn(B, T, 3, D, device="cuda", dtype=dtype) * 0.5
    scale, shift, gate = table.unbind(2)
    return x, y, scale, shift, gate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    ceiling = copy_ceiling()
    print(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"copy ceiling {ceiling:.3f} TB/s")
    configs = [(r, d, w) for d in (1024, 2048) for r in (1, 2, 4, 8) for w in (4, 8)
               if 1024 <= r * d <= 16384]
    rows = []
    for D, S in ((4096, 6144), (2048, 6144), (4096, 24576)):
        for per_token in (False, True):
            for dtype in (torch.bfloat16,):
                x, y, scale, shift, gate = operands(1, S, D, per_token, dtype)
                ref_m = x * (1 + scale) + shift
                ref_g = x + y * gate
                pm = M.plan_modulate(x, scale, shift)
                pg = G.plan_gated_residual(x, y, gate)
                floor_m = (2 + (2 if per_token else 0)) * x.numel() * x.element_size() / (ceiling * 1e12) * 1e6
                floor_g = (3 + (1 if per_token else 0)) * x.numel() * x.element_size() / (ceiling * 1e12) * 1e6
                eager_m = do_bench(lambda: x * (1 + scale) + shift, return_mode="median") * 1e3
                eager_g = do_bench(lambda: x + y * gate, return_mode="median") * 1e3
                best = {}
                for op, plan, launch, ref, floor in (
                    ("modulate", pm, M.launch_modulate, ref_m, floor_m),
                    ("gated_residual", pg, G.launch_gated_residual, ref_g, floor_g),
                ):
                    results = []
                    for cfg in configs + [None]:
                        out = launch(plan, True, cfg)
                        exact = torch.equal(out, ref)
                        t = do_bench(lambda: launch(plan, True, cfg), warmup=10, rep=100, return_mode="median") * 1e3
                        results.append((t, cfg, exact))
                    results.sort(key=lambda r: r[0])
                    default_t = next(t for t, c, e in results if c is None)
                    default_cfg = launch_shape(D, S, 2)
                    t, cfg, exact = results[0]
                    all_exact = all(e for _, _, e in results)
                    best[op] = (t, cfg)
                    row = dict(op=op, D=D, S=S, per_token=per_token, best_us=t, best_cfg=cfg, default_us=default_t,
                               default_cfg=default_cfg, floor_us=floor, all_exact=all_exact,
                               eager_us=eager_m if op == "modulate" else eager_g,
                               top5=[(round(a, 2), c) for a, c, _ in results[:5]])
                    rows.append(row)
                    print(f"{op:15s} D={D} S={S} pt={per_token:d}: floor {floor:6.1f} eager {row['eager_us']:6.1f} "
                          f"best {t:6.1f} {cfg} default {default_t:6.1f} {default_cfg} exact={all_exact} "
                          f"top5={row['top5']}")
    # host cost on tiny tensors: GPU time per call is a few us, so wall time per call is host time
    x, y, scale, shift, gate = operands(1, 8, 64, False, torch.bfloat16)
    pm = M.plan_modulate(x, scale, shift)
    sites.modulate_site(x, scale, shift)

    def per_call(fn, n=3000):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    host = {
        "eager_expression": per_call(lambda: x * (1 + scale) + shift),
        "launch_only": per_call(lambda: M.launch_modulate(pm)),
        "plan_and_launch": per_call(lambda: M.launch_modulate(M.plan_modulate(x, scale, shift))),
        "modulate_site": per_call(lambda: sites.modulate_site(x, scale, shift)),
        "custom_op": per_call(lambda: torch.ops.bitfuse.modulate(x, scale, shift)),
    }
    print("host us/call:", {k: round(v, 2) for k, v in host.items()})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_pointwise.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           ceiling_tbps=ceiling, rows=rows, host_us=host), f, indent=1)


if __name__ == "__main__":
    main()
