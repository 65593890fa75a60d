"""Host time of one LTX-2 forward: where the CPU time goes when the GPU waits for it.

    python3 bench/host_profile.py [--layers 4] [--top 40]

Full-width model (4 layers), but a tiny token count (16 video, 4 audio, 8 text),
so that GPU work is negligible and the wall time of a forward is the host's:
the floor under the wall time of a non-graph forward at any size. Prints ms per
forward for eager and bitfuse lossless, then cProfile of the bitfuse forward
(functions by own time) and the aten ops it dispatches.
"""

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bitfuse  # noqa: E402
from bitfuse.models.ltx2_configs import build_model, full_config, make_inputs  # noqa: E402


def wall_ms(call, n=30):
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    model = build_model(full_config(args.layers), device="cuda", dtype=torch.bfloat16, seed=0)
    kw = make_inputs(model, batch=1, video_tokens_shape=(1, 4, 4), audio_tokens=4, text_tokens=8)

    def call():
        with torch.no_grad():
            return model(**kw)

    print(f"eager            {wall_ms(call):7.2f} ms/forward (host-bound)")
    handle = bitfuse.accelerate(model)
    print(f"bitfuse lossless {wall_ms(call):7.2f} ms/forward (host-bound)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        call()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        call()
    ops = collections.Counter()
    for e in p.events():
        par = e.cpu_parent
        if e.name.startswith("aten::") and (par is None or not par.name.startswith("aten::")):
            ops[e.name] += 1
    print(f"top-level aten ops per forward: {sum(ops.values())}")
    print(", ".join(f"{k[6:]} {v}" for k, v in ops.most_common(30)))
    handle.restore()


if __name__ == "__main__":
    main()
