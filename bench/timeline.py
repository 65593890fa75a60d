"""Where a non-graph forward waits: host time against device time, at every block boundary.

    python -m bench.timeline ltx2 --layers 4 --batch 1 [--modes eager lossless high] [--iters 15]

The model and inputs of a bench/models.py preset (same options). For one
synchronised forward (as bench/models.py times it) it records, when each of the
model's direct children and each of its repeated blocks is entered, the host clock
and a CUDA event. Where the device reaches a point just after the host did, the
device waits for the host (host-bound); where it reaches it long after, the launch
queue is full (device-bound). Prints, per point, when the host and the device
reached it (ms from the start of the call, medians over --iters forwards), the
same per segment, and the host time of a forward with no synchronisation at all
(the host floor of back-to-back calls). Graphs mode replays without running the
modules, so it has no points: leave it out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.models import PresetUnavailable, add_model_arguments, build, resolve
from bitfuse import modes


class Marks:
    """Host time and a CUDA event when each direct child of the model and each repeated
    block is entered, and when the forward returns."""

    def __init__(self, model):
        self.points, self.handles = [], []
        repeated = set(getattr(model, "_repeated_blocks", None) or ())
        blocks = [m for m in model.modules() if type(m).__name__ in repeated]
        named = [(name, m) for name, m in model.named_children() if m not in blocks]
        named += [(f"block{i}", b) for i, b in enumerate(blocks)]
        for name, mod in named:
            self.handles.append(mod.register_forward_pre_hook(self._hook(name)))
        self.handles.append(model.register_forward_hook(self._hook("end")))

    def _hook(self, name):
        def hook(*_):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append((name, time.perf_counter(), event))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def one_forward(call, marks) -> list[tuple]:
    """(point, host ms, device ms) from the start of one synchronised call."""
    marks.points.clear()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    call()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    t_end = time.perf_counter()
    end.synchronize()
    rows = [(n, (t - t0) * 1e3, start.elapsed_time(e)) for n, t, e in marks.points]
    return rows + [("return", (t_end - t0) * 1e3, start.elapsed_time(end))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap, modes_default=("eager", "lossless", "high"))
    ap.add_argument("--iters", type=int, default=15, help="synchronised forwards per mode (default 15)")
    args = resolve(ap, ap.parse_args(argv))
    if not torch.cuda.is_available() or args.device.type != "cuda":
        print("bench/timeline.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        _, model, workloads = build(args)
    except PresetUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    describe, kwargs = next(iter(workloads.values()))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.preset}, "
          f"{model.config.num_layers} layers, {describe}; median of {args.iters} synchronised forwards")

    def call():
        with torch.no_grad():
            return model(**kwargs)

    for mode in args.modes:
        with modes.entered(mode, model):
            for _ in range(3):
                call()
            marks = Marks(model)
            runs = [one_forward(call, marks) for _ in range(args.iters)]
            marks.remove()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.iters):
                call()
            host_only = (time.perf_counter() - t) / args.iters * 1e3
            torch.cuda.synchronize()
        print(f"\n== {mode}: host time of an unsynchronised forward {host_only:.2f} ms")
        print(f"{'at':>12} {'host ms':>9} {'device ms':>10} {'seg host':>9} {'seg device':>11}")
        prev_h = prev_d = 0.0
        for i, (name, _, _) in enumerate(runs[0]):
            h = statistics.median(r[i][1] for r in runs)
            d = statistics.median(r[i][2] for r in runs)
            print(f"{name:>12} {h:9.2f} {d:10.2f} {h - prev_h:9.2f} {d - prev_d:11.2f}")
            prev_h, prev_d = h, d
    return 0


if __name__ == "__main__":
    sys.exit(main())
