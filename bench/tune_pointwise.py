"""Sweep launch shapes of the pointwise kernels on the GPU, timed as bench/ops.py
times (bench/timing.py), checking exactness of each; prints the best per shape.

    python3 bench/tune_pointwise.py

Used to pick `_pointwise.launch_shape`; the numbers that count are bench/ops.py's.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bitfuse.ops.gated_residual  # noqa: E402,F401
import bitfuse.ops.modulate  # noqa: E402,F401
from bitfuse.ops._pointwise import launch_shape  # noqa: E402
from timing import GraphTimer, copy_ceiling_tbps, interleaved_us, sets_for  # noqa: E402

M = sys.modules["bitfuse.ops.modulate"]
G = sys.modules["bitfuse.ops.gated_residual"]

CONFIGS = [(r, d, w) for d in (512, 1024, 2048, 4096) for r in (1, 2, 4, 8) for w in (2, 4, 8)
           if 512 <= r * d <= 8192 and r * d // (32 * w) in (4, 8, 16, 32)]


def operands(S, D, per_token, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    y = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    c, h, gate = torch.randn(1, S if per_token else 1, 6, D, device="cuda", dtype=torch.bfloat16,
                             generator=g).unbind(2)[:3]
    return x, y, c, h, gate


def main():
    ceiling = copy_ceiling_tbps()
    print(f"{torch.cuda.get_device_name()} copy ceiling {ceiling:.3f} TB/s; {len(CONFIGS)} configs")
    for D, S in ((4096, 6144), (2048, 6144), (4096, 1024), (4096, 24576)):
        for per_token in (False, True):
            full = S * D * 2
            moved_m = 2 * full + (2 * full if per_token else 0)
            moved_g = 3 * full + (full if per_token else 0)
            sets = [operands(S, D, per_token, i) for i in range(sets_for(moved_m))]
            for op, moved in (("modulate", moved_m), ("gated_residual", moved_g)):
                streams = (2 + 2 * per_token) if op == "modulate" else (3 + per_token)
                timers, exact = {}, {}
                for cfg in CONFIGS + [None]:
                    if op == "modulate":
                        plans = [M.plan_modulate(x, c, h) for x, y, c, h, g in sets]
                        calls = [lambda p=p, cfg=cfg: M.launch_modulate(p, cfg) for p in plans]
                        exact[cfg] = torch.equal(calls[0](), sets[0][0] * (1 + sets[0][2]) + sets[0][3])
                    else:
                        plans = [G.plan_gated_residual(x, y, g) for x, y, c, h, g in sets]
                        calls = [lambda p=p, cfg=cfg: G.launch_gated_residual(p, cfg) for p in plans]
                        exact[cfg] = torch.equal(calls[0](), sets[0][0] + sets[0][1] * sets[0][4])
                    timers[cfg] = GraphTimer(calls)
                times = interleaved_us(timers, rounds=4, replays=4)
                for t in timers.values():
                    t.close()
                res = [(t, cfg, exact[cfg]) for cfg, t in times.items()]
                res.sort(key=lambda r: r[0])
                dflt = next(t for t, c, _ in res if c is None)
                pct = lambda t: 100 * moved / (t * 1e-6) / 1e12 / ceiling  # noqa: E731
                print(f"{op:15s} D={D} S={S:5d} pt={per_token:d} default {dflt:6.1f}us {pct(dflt):5.1f}% "
                      f"{launch_shape(D, S, 2, streams)} | best " + ", ".join(f"{t:.1f}us {pct(t):.0f}% {c}" for t, c, _ in res[:4])
                      + f" | all exact={all(o for _, _, o in res)}")
            del sets
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
