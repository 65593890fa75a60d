"""Host time of a forward: where the CPU time goes when the GPU waits for it.

    python -m bench.host_profile ltx2 --layers 4 --batch 1 --video 1 4 4 --audio-tokens 4 --text-tokens 8

The model of a bench/models.py preset (same options); pass a tiny token count, as
above, so that GPU work is negligible and the wall time of a forward is the host's:
the floor under the wall time of a non-graph forward at any size (at tiny M each
linear also pays cuBLAS's heuristics, so it overstates that floor). Prints ms per
forward for each mode, then for the last mode cProfile's functions by own time and
the top-level aten ops one forward dispatches.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time

import torch

from bench.models import PresetUnavailable, add_model_arguments, build, resolve
from bitfuse import modes


def wall_ms(call, n: int = 30) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap, modes_default=("eager", "lossless"))
    ap.add_argument("--top", type=int, default=40, help="cProfile rows (default 40)")
    args = resolve(ap, ap.parse_args(argv))
    if not torch.cuda.is_available() or args.device.type != "cuda":
        print("bench/host_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        _, model, workloads = build(args)
    except PresetUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    describe, kwargs = next(iter(workloads.values()))
    print(f"{args.preset}, {model.config.num_layers} layers, {describe}")

    def call():
        with torch.no_grad():
            return model(**kwargs)

    for i, mode in enumerate(args.modes):
        with modes.entered(mode, model):
            print(f"{mode:<9} {wall_ms(call):8.2f} ms/forward")
            if i < len(args.modes) - 1:
                continue
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                call()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as p:
                call()
    ops = collections.Counter()
    for e in p.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            ops[e.name] += 1
    print(f"top-level aten ops per forward ({args.modes[-1]}): {sum(ops.values())}")
    print(", ".join(f"{k[6:]} {v}" for k, v in ops.most_common(30)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
