"""Where a non-graph LTX-2 forward waits: host time against device time, per segment.

    python3 bench/timeline.py [--layers 4] [--modes eager lossless high]

Full-width model, the token counts of bench/ltx2.py. For one synchronised
forward (as bench/ltx2.py times it) it records, at every block boundary, the
host clock and a CUDA event. Where the device clock runs close behind the host
clock the device waits for the host (host-bound); where it runs ahead of the
host the launch queue is full (device-bound). Prints, at each point, when the
host reached it and when the device did (ms from the start of the call), the
same per segment, and the host time of a forward with no synchronisation at
all (the host floor of back-to-back calls).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bitfuse  # noqa: E402
from bitfuse.models.ltx2_configs import build_model, full_config, make_inputs  # noqa: E402

VIDEO, AUDIO, TEXT = (16, 16, 24), 126, 256


class Marks:
    """Host time and a CUDA event at each module boundary of interest."""

    def __init__(self, model):
        self.points = []
        self.handles = []
        for name, mod in [("time_embed", model.time_embed), ("caption", model.caption_projection),
                          *[(f"block{i}", b) for i, b in enumerate(model.transformer_blocks)],
                          ("proj_out", model.proj_out)]:
            self.handles.append(mod.register_forward_pre_hook(self._hook(name)))
        self.handles.append(model.audio_proj_out.register_forward_hook(self._hook("end")))

    def _hook(self, name):
        def hook(*_):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append((name, time.perf_counter(), ev))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def one_forward(call, marks):
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
    rows = [(n, (t - t0) * 1e3, start.elapsed_time(ev)) for n, t, ev in marks.points]
    rows.append(("return", (t_end - t0) * 1e3, start.elapsed_time(end)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["eager", "lossless", "high"])
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.layers} layers, video {VIDEO} latents, {AUDIO} audio, {TEXT} text tokens, bf16, "
          f"median of {args.iters} synchronised forwards")
    model = build_model(full_config(args.layers), device="cuda", dtype=torch.bfloat16, seed=0)
    kw = make_inputs(model, batch=1, video_tokens_shape=VIDEO, audio_tokens=AUDIO, text_tokens=TEXT)

    def call():
        with torch.no_grad():
            return model(**kw)

    for mode in args.modes:
        handle = None if mode == "eager" else bitfuse.accelerate(model, quality=mode)
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
        print(f"{'at':>10} {'host ms':>9} {'device ms':>10} {'seg host':>9} {'seg device':>11}")
        prev_h = prev_d = 0.0
        for i, (name, _, _) in enumerate(runs[0]):
            h = statistics.median(r[i][1] for r in runs)
            d = statistics.median(r[i][2] for r in runs)
            print(f"{name:>10} {h:9.2f} {d:10.2f} {h - prev_h:9.2f} {d - prev_d:11.2f}")
            prev_h, prev_d = h, d
        if handle is not None:
            handle.restore()


if __name__ == "__main__":
    main()
