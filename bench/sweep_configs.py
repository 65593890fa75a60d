"""Launch-config sweeps for the norm + modulate kernels, and where a site's host time goes.

    python3 bench/sweep_configs.py [--out bench/results] [--budget 240]

Norm + modulate at 4096 x 6144 bf16 (per-sample and per-token parameters):
each (rows per program, warps) config of the exact and one-pass kernels, timed
as bench/ops.py times (bench/timing.py, configs interleaved), exact configs checked `torch.equal`
to the reference. Then the host cost of a modulate call on tiny tensors, piece
by piece. Picks nothing: it prints the best configs and writes
sweep-<gpu>.json, evidence for the defaults in the ops modules.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from timing import GraphTimer, copy_ceiling_tbps, host_us, interleaved_us, sets_for  # noqa: E402

import bitfuse.ops.layer_norm_modulate  # noqa: E402,F401
import bitfuse.ops.modulate  # noqa: E402,F401
import bitfuse.ops.rms_norm_modulate  # noqa: E402,F401
from bitfuse import sites  # noqa: E402

M = sys.modules["bitfuse.ops.modulate"]
RMS = sys.modules["bitfuse.ops.rms_norm_modulate"]
LN = sys.modules["bitfuse.ops.layer_norm_modulate"]
EPS = 1e-6

EXACT_CONFIGS = [(1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8)]
HIGH_CONFIGS = [(1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)]


def operands(S, D, per_token, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    c, h = (torch.randn(1, S if per_token else 1, 6, D, device="cuda", dtype=torch.bfloat16, generator=g)
            * 0.3).unbind(2)[:2]
    return x, c, h


def norm_ops():
    return {
        "rms_norm[diffusers]": (lambda x, c, h, e: RMS.plan_rms_norm_modulate(x, c, h, EPS, "diffusers", exact=e),
                                RMS.launch_rms_norm_modulate,
                                lambda x, c, h: RMS.rms_norm_modulate_reference(x, c, h, EPS, "diffusers")),
        "rms_norm[aten]": (lambda x, c, h, e: RMS.plan_rms_norm_modulate(x, c, h, EPS, "aten", exact=e),
                           RMS.launch_rms_norm_modulate,
                           lambda x, c, h: RMS.rms_norm_modulate_reference(x, c, h, EPS, "aten")),
        "layer_norm": (lambda x, c, h, e: LN.plan_layer_norm_modulate(x, c, h, EPS, exact=e),
                       LN.launch_layer_norm_modulate,
                       lambda x, c, h: LN.layer_norm_modulate_reference(x, c, h, EPS)),
    }


def sweep_norms(ceiling, rows, deadline):
    S, D = 6144, 4096
    for per_token in (False, True):
        moved = 2 * S * D * 2 + (2 * S * D * 2 if per_token else 2 * D * 2)
        sets = [operands(S, D, per_token, i) for i in range(sets_for(moved))]
        for name, (plan_of, launch, reference) in norm_ops().items():
            ref = reference(*sets[0])
            for exact, configs in ((True, EXACT_CONFIGS), (False, HIGH_CONFIGS)):
                if time.monotonic() > deadline:
                    print("budget spent: stopping the norm sweep")
                    return
                timers, ok = {}, {}
                for config in [None] + configs:
                    plans = [plan_of(*s, exact) for s in sets]
                    calls = [lambda p=p, config=config: launch(p, exact, config=config) for p in plans]
                    try:
                        ok[config] = torch.equal(calls[0](), ref) if exact else None
                        timers[config] = GraphTimer(calls)
                    except Exception as exc:  # a config that does not compile is a finding
                        print(f"  {name} exact={exact} {config}: {type(exc).__name__}: {str(exc)[:120]}")
                times = interleaved_us(timers, rounds=4, replays=4)
                for t in timers.values():
                    t.close()
                for config, t in times.items():
                    pct = 100 * moved / (t * 1e-6) / 1e12 / ceiling
                    rows.append(dict(op=name, params="per-token" if per_token else "per-sample", exact=exact,
                                     config=config or "default", us=round(t, 2), pct_ceiling=round(pct, 1),
                                     equal_to_reference=ok[config]))
                    print(f"  {name:20s} {'per-token' if per_token else 'per-sample':10s} "
                          f"{'exact' if exact else 'high':5s} {str(config or 'default'):9s} {t:6.1f} us {pct:5.1f}%"
                          + ("" if ok[config] is None else f" equal={ok[config]}"))
        del sets
        torch.cuda.empty_cache()


def host_pieces():
    """Host microseconds of the pieces of one modulate_site call (tiny tensors)."""
    x = torch.randn(1, 8, 64, device="cuda", dtype=torch.bfloat16)
    c, h = torch.randn(1, 1, 2, 64, device="cuda", dtype=torch.bfloat16).unbind(2)
    plan = M.plan_modulate(x, c, h)
    out = torch.empty_like(x)
    M.launch_modulate(plan, out=out)
    M.launch_modulate(plan, out=out)
    fl = M._launch
    tensors = (x, c, h, out, c, h)
    rows = {
        "eager x*(1+c)+h (3 ops)": lambda: x * (1 + c) + h,
        "one aten add": lambda: x + h,
        "torch.empty_like": lambda: torch.empty_like(x),
        "alignment key (6 data_ptr)": lambda: tuple([t.data_ptr() & 15 == 0 for t in tensors]),
        "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "plan_modulate (guard)": lambda: M.plan_modulate(x, c, h),
        "launch_modulate(out=...)": lambda: M.launch_modulate(plan, out=out),
        "launch_modulate": lambda: M.launch_modulate(plan),
        "modulate_site": lambda: sites.modulate_site(x, c, h),
    }
    result = {name: round(host_us(fn, n=1000, repeats=3), 2) for name, fn in rows.items()}
    result["direct launch active"] = bool(fl.direct and fl.compiled)
    for k, v in result.items():
        print(f"  host {k:28s} {v}")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--budget", type=float, default=240, help="seconds for the norm sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/sweep_configs.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    ceiling = copy_ceiling_tbps()
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, copy ceiling {ceiling:.3f} TB/s")
    result = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  copy_ceiling_tbps=round(ceiling, 3), method=__doc__.strip(), host_us=host_pieces(), norm_rows=[])
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sweep-{slug}.json")
    try:
        sweep_norms(ceiling, result["norm_rows"], time.monotonic() + args.budget)
    finally:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    best = {}
    for r in result["norm_rows"]:
        k = (r["op"], r["params"], r["exact"])
        if r["equal_to_reference"] is not False and (k not in best or r["us"] < best[k]["us"]):
            best[k] = r
    for (op, params, exact), r in best.items():
        dflt = next(x for x in result["norm_rows"] if (x["op"], x["params"], x["exact"], x["config"]) ==
                    (op, params, exact, "default"))
        print(f"best {op:20s} {params:10s} {'exact' if exact else 'high':5s} {str(r['config']):9s} {r['us']:6.1f} us "
              f"{r['pct_ceiling']:5.1f}% (default {dflt['us']:.1f} us)")


if __name__ == "__main__":
    main()
