"""Host time of a forward: where the CPU time goes when the GPU waits for it.

    python -m bench.host_profile sana --modes lossless compile     # the preset's own shape

The model of a bench/models.py preset (same options). Prints, per mode, in
interleaved rounds (--rounds, the order rotated each round), a forward's wall time
(synchronised), its host time (until the call returns, without a sync: what the
CPU takes to enqueue it) and the thread's CPU time in that call, median and min: a
forward whose wall is little above its host time is host-bound, and the host times
say by how much one mode's host work exceeds another's at the shape users run (Sana,
1024 x 1024: lossless 15.5, compile 14.2 ms; bench/NOTES.md, fifteenth session). On
a shared host whose other work takes the CPU away, host exceeds cpu (and the load
average, printed, is high): cpu is then the measure of the work itself. Then, for
the last mode (in bench/models.py's order: eager, lossless, ..., compile),
cProfile's functions by own time and the top-level aten ops one forward dispatches.

A tiny token count makes GPU work negligible, so that every call's host cost shows:

    python -m bench.host_profile ltx2 --layers 4 --batch 1 --video 1 4 4 --audio-tokens 4 --text-tokens 8

That is the host time of the tiny shape's calls, not a floor for the real shape: at
tiny M each linear pays cuBLAS's heuristics, and shape-dependent paths differ (Sana
at 64 x 64 pixels: lossless 25.3 ms a forward, where the real shape's host time is
16-18.5; bench/NOTES.md, thirteenth session).

    python -m bench.host_profile sana --split      # at the preset's own shape
    python -m bench.host_profile sana --pixels 64 --modes eager lossless compile   # the tiny shape

--split also prints, per mode, the host time of a forward split over the repeated
blocks' non-leaf children (attention, feed-forward, ...), the blocks' own code (the
adaLN sites and residuals) and everything outside the blocks: the measurement that
showed Sana's sites costing more in place than in a loop (bench/NOTES.md,
2026-12-02). Only non-leaf children are hooked: a hook on a norm or a convolution
would turn its site off.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

from bench.models import PresetUnavailable, add_model_arguments, build, resolve
from bitfuse import modes


def host_and_wall(call, n: int = 10, warmup: int = 3, sync=None) -> tuple[list[float], list[float], list[float]]:
    """ms per forward of `call()`, `n` forwards after `warmup`, each on its own: (host,
    wall, cpu). host: until the call returns, unsynchronised (the CPU's time to enqueue the
    forward; the whole of it where the GPU keeps up); wall: until the device is done
    (`sync`, default `torch.cuda.synchronize`); cpu: the CPU time this thread spent in
    the call (`time.thread_time`). Where wall exceeds host by little, the forward is
    host-bound; where host exceeds cpu, the thread waited for a CPU (a busy host) or
    blocked in the driver, so cpu is the host work a mode needs, whatever the load."""
    sync = torch.cuda.synchronize if sync is None else sync
    for _ in range(warmup):
        call()
    sync()
    host, wall, cpu = [], [], []
    for _ in range(n):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        c1 = time.thread_time()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        cpu.append((c1 - c0) * 1e3)
    return host, wall, cpu


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the classes its `_repeated_blocks` names (diffusers'
    attribute, which regional compile reads too), else every module whose class name
    ends with "Block"."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    return [m for m in model.modules() if type(m).__name__.endswith("Block")]


def module_split(model: torch.nn.Module, call, n: int = 10) -> dict[str, float]:
    """Host ms per forward of `call()` (median over `n`, after two warm-up calls), split
    into each non-leaf child of the repeated blocks (by attribute name, summed over
    blocks), "blocks, own code" (the blocks less those children) and "outside the
    blocks", with "total". Hooks are removed before returning."""
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no repeated blocks to split the host time over")
    acc: dict[str, float] = collections.defaultdict(float)
    starts: dict[int, float] = {}
    handles = []

    def timed(module, name):
        def pre(m, args):
            starts[id(m)] = time.perf_counter()

        def post(m, args, out):
            acc[name] += time.perf_counter() - starts.pop(id(m))

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    for block in blocks:
        timed(block, "blocks")
        for name, child in block.named_children():
            if any(True for _ in child.children()):  # non-leaf: no site inspects it
                timed(child, name)
    samples = collections.defaultdict(list)
    try:
        for i in range(n + 2):
            acc.clear()
            t = time.perf_counter()
            call()
            total = time.perf_counter() - t
            if i < 2:
                continue
            children = sum(v for k, v in acc.items() if k != "blocks")
            for k, v in acc.items():
                if k != "blocks":
                    samples[k].append(v)
            samples["blocks, own code"].append(acc["blocks"] - children)
            samples["outside the blocks"].append(total - acc["blocks"])
            samples["total"].append(total)
    finally:
        for h in handles:
            h.remove()
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap, modes_default=("eager", "lossless"))
    ap.add_argument("--top", type=int, default=40, help="cProfile rows (default 40)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of 10 forwards a mode (default 4)")
    ap.add_argument("--split", action="store_true",
                    help="also the host time per forward split over the blocks' children, per mode")
    args = resolve(ap, ap.parse_args(argv))
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
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

    samples = {mode: ([], [], []) for mode in args.modes}
    for r in range(args.rounds):  # interleaved, the order rotated each round
        for mode in args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]:
            with modes.entered(mode, model):
                for kept, new in zip(samples[mode], host_and_wall(call)):
                    kept.extend(new)
    print(f"ms a forward, {args.rounds} interleaved rounds x 10: wall (synchronised), host (the call's "
          "return, no sync) and cpu (the thread's CPU time in the call), median / min; "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs")
    for mode, (host, wall, cpu) in samples.items():
        print(f"{mode:<9} wall {statistics.median(wall):8.2f} / {min(wall):8.2f}   "
              f"host {statistics.median(host):8.2f} / {min(host):8.2f}   "
              f"cpu {statistics.median(cpu):8.2f} / {min(cpu):8.2f}")
    for i, mode in enumerate(args.modes):
        last = i == len(args.modes) - 1
        if not (args.split or last):
            continue
        with modes.entered(mode, model):
            if args.split:
                split = module_split(model, call)
                print(f"{mode:<9} host ms: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
            if not last:
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
