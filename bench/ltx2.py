"""LTX-2 transformer forward: eager diffusers vs torch.compile vs bitfuse, one run.

    python3 bench/ltx2.py [--layers 4] [--variant 2.0] [--iters 50] [--graphs auto|on|off]
    python3 bench/ltx2.py --plot bench/results/ltx2-<gpu>.json   # re-draw the PNG elsewhere

Full-width diffusers `LTX2VideoTransformer3DModel` (video 32 x 128, audio
32 x 64), random weights, bf16, batch 1, 6144 video tokens (16 x 16 x 24
latents) + 126 audio + 256 text tokens, per-sample ([B]) and per-token
([B, S]) timesteps. The forward computes its RoPE coordinates itself (pass
--pass-coords to give them, as the pipelines do).

Modes (each isolated: a failure is recorded and the run goes on):
  eager              diffusers as shipped
  bitfuse-lossless   bitfuse.accelerate(model)                       (must be bit-equal)
  bitfuse-high       bitfuse.accelerate(model, quality="high")
  graphs-lossless    accelerate(..., cuda_graphs=True)      } when bitfuse.graphs exists
  graphs-high        accelerate(..., quality="high", cuda_graphs=True) } (--graphs auto)
  compile-regional   model.compile_repeated_blocks(fullgraph=True) (Inductor, per block)

Per mode: median ms per forward (CUDA events, each call synchronised, after
warm-up), the mean of back-to-back calls, speedup over eager, elements that
differ from eager (video + audio) and the max ULP, first-call seconds, peak
memory. A torch.profiler pass splits CUDA kernel time into GEMM / attention /
other (bitfuse's own kernels counted inside other and also shown apart) for
eager and the bitfuse modes. Writes bench/results/ltx2-<gpu>.json and a PNG
(matplotlib, if installed), and prints a table last.

Needs torch with CUDA, triton and diffusers 0.42.x (the device machine gets
diffusers as a wheel).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bitfuse  # noqa: E402
from bitfuse import policy  # noqa: E402
from bitfuse.numerics import max_ulp  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VIDEO = (16, 16, 24)  # latent frames, height, width: 6144 tokens (121 frames at 512 x 768)
AUDIO = 126
TEXT = 256
TIMESTEPS = ("per-sample", "per-token")

_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|matmul|splitk|sm\d+_.*_tn|ampere_.*_tn", re.I)
_ATTN = re.compile(r"flash|fmha|attention|attn|sdpa|mha", re.I)
_BITFUSE = re.compile(r"^_(modulate|gated_residual|rms_norm_modulate|layer_norm_modulate|rms_norm|layer_norm)\w*kernel")


# ---------------------------------------------------------------- helpers


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "bitfuse": bitfuse.__version__}
    for mod in ("triton", "diffusers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # pragma: no cover - recorded, not fatal
            out[mod] = f"unavailable ({type(exc).__name__})"
    out["cuda"] = torch.version.cuda
    return out


def outputs_of(out) -> tuple:
    if isinstance(out, tuple):
        return out
    return (out.sample, out.audio_sample)


def compare(out, ref) -> dict:
    diff = total = 0
    ulp = 0
    for o, r in zip(out, ref):
        total += r.numel()
        if o.shape != r.shape or o.dtype != r.dtype:
            return {"mismatches": None, "numel": total, "max_ulp": None, "note": "shape or dtype differs"}
        diff += int((o != r).sum())
        ulp = max(ulp, max_ulp(o, r))
    return {"mismatches": diff, "numel": total, "max_ulp": ulp}


def time_forward(call, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return {
        "ms": statistics.median(per_call),
        "ms_min": min(per_call),
        "ms_p90": sorted(per_call)[int(0.9 * (len(per_call) - 1))],
        "ms_back_to_back": start.elapsed_time(end) / iters,
        "iters": iters,
    }


def kernel_breakdown(call, n: int = 5) -> dict:
    """CUDA kernel time per forward, split GEMM / attention / other."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    buckets = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    bitfuse_us = 0.0
    per_kernel: dict[str, float] = {}
    for evt in prof.events():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        us = evt.time_range.elapsed_us()
        name = evt.name
        if _ATTN.search(name):  # first: attention kernels can be named cutlass too (fmha_cutlassF_...)
            buckets["attention"] += us
        elif _GEMM.search(name):
            buckets["gemm"] += us
        else:
            buckets["other"] += us
            if _BITFUSE.search(name):
                bitfuse_us += us
        per_kernel[name] = per_kernel.get(name, 0.0) + us
    total = sum(buckets.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {
        "ms_per_forward": {k: v / n / 1e3 for k, v in buckets.items()},
        "total_ms_per_forward": total / n / 1e3,
        "share": {k: (v / total if total else 0.0) for k, v in buckets.items()},
        "bitfuse_kernels_ms_per_forward": bitfuse_us / n / 1e3,
        "top_kernels_ms_per_forward": [(k[:160], v / n / 1e3) for k, v in top],
    }


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}


# ---------------------------------------------------------------- modes


class Mode:
    """setup() -> a callable forward; teardown() undoes setup."""

    profile = False

    def __init__(self, name, model):
        self.name, self.model = name, model

    def setup(self, kw):
        return lambda: self.model(**kw)

    def teardown(self):
        pass


class Eager(Mode):
    profile = True


class Bitfuse(Mode):
    profile = True

    def __init__(self, name, model, quality, graphs=False):
        super().__init__(name, model)
        self.quality, self.graphs, self.handle = quality, graphs, None

    def setup(self, kw):
        self.handle = bitfuse.accelerate(self.model, quality=self.quality, cuda_graphs=self.graphs)
        return lambda: self.model(**kw)

    def teardown(self):
        if self.handle is not None:
            self.handle.restore()
            self.handle = None


class EagerGraphs(Mode):
    """Stock diffusers replayed from CUDA graphs (bitfuse.graphs without accelerate)."""

    def setup(self, kw):
        from bitfuse import graphs

        graphs.wrap_model_for_graphs(self.model)
        return lambda: self.model(**kw)

    def teardown(self):
        from bitfuse import graphs

        graphs.unwrap_model_for_graphs(self.model)


class CompileRegional(Mode):
    def setup(self, kw):
        torch._dynamo.reset()
        self.model.compile_repeated_blocks(fullgraph=True)
        return lambda: self.model(**kw)

    def teardown(self):
        for m in self.model.modules():
            if getattr(m, "_compiled_call_impl", None) is not None:
                m._compiled_call_impl = None
        torch._dynamo.reset()


def run_mode(mode: Mode, kw: dict, ref, args) -> tuple[dict, tuple | None]:
    rec: dict = {}
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        policy.reset_verdicts()
        call = mode.setup(kw)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = outputs_of(call())
            torch.cuda.synchronize()
            rec["first_call_s"] = time.perf_counter() - t0
            out = tuple(o.clone() for o in out)
            if ref is not None:
                rec.update(compare(out, ref))
            rec.update(time_forward(call, args.warmup, args.iters))
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if args.profile and mode.profile:
                try:
                    rec["kernels"] = kernel_breakdown(call)
                except Exception as exc:
                    rec["kernels"] = _error(exc)
        verdicts = policy.verdicts()
        if verdicts:
            rec["verdicts"] = [f"{v.signature}: {v.status}{' ' + v.detail if v.detail else ''}" for v in verdicts]
        return rec, out
    except Exception as exc:
        rec.update(_error(exc))
        print(f"  {mode.name}: FAILED {rec['error'][:300]}", flush=True)
        return rec, None
    finally:
        try:
            mode.teardown()
        except Exception as exc:
            rec["teardown_error"] = f"{type(exc).__name__}: {exc}"
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- report


def print_table(result: dict) -> None:
    modes = result["modes"]
    head = f"{'mode':<18}" + "".join(f" | {ts:^34}" for ts in TIMESTEPS)
    sub = f"{'':<18}" + "".join(f" | {'ms':>8} {'speedup':>8} {'differ':>9} {'ULP':>5}" for _ in TIMESTEPS)
    print()
    print(f"LTX-2 forward, {result['gpu']}, {result['config']['layers']} layers, variant {result['config']['variant']}")
    print(head)
    print(sub)
    for mode in modes:
        row = f"{mode:<18}"
        for ts in TIMESTEPS:
            r = result["results"].get(ts, {}).get(mode)
            if r is None:
                row += f" | {'-':>33}"
            elif "error" in r:
                row += f" | {'FAILED: ' + r['error'][:25]:>33}"
            else:
                mism = r.get("mismatches")
                ulp = r.get("max_ulp")
                row += (
                    f" | {r['ms']:8.2f} {r.get('speedup', float('nan')):7.2f}x "
                    f"{'-' if mism is None else mism:>9} {'-' if ulp is None else ulp:>5}"
                )
        print(row)
    prof = [(ts, m, r["kernels"]) for ts in TIMESTEPS for m, r in result["results"].get(ts, {}).items()
            if isinstance(r.get("kernels"), dict) and "ms_per_forward" in r["kernels"]]
    if prof:
        print()
        print(
            f"{'CUDA kernel ms/forward':<34} {'GEMM':>8} {'attention':>10} {'other':>8} "
            f"{'(bitfuse)':>10} {'total':>8}"
        )
        for ts, m, k in prof:
            b = k["ms_per_forward"]
            print(
                f"{ts + ' ' + m:<34} {b['gemm']:8.2f} {b['attention']:10.2f} {b['other']:8.2f} "
                f"{k['bitfuse_kernels_ms_per_forward']:10.2f} {k['total_ms_per_forward']:8.2f}"
            )


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib unavailable ({type(exc).__name__}); re-draw with: python3 bench/ltx2.py --plot <json>"
    modes = result["modes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(TIMESTEPS)
    for i, ts in enumerate(TIMESTEPS):
        xs, ys, labels = [], [], []
        for j, m in enumerate(modes):
            r = result["results"].get(ts, {}).get(m, {})
            if "ms" in r:
                xs.append(j + (i - (len(TIMESTEPS) - 1) / 2) * width)
                ys.append(r["ms"])
                labels.append(f"{r.get('speedup', 0):.2f}x")
        bars = ax1.bar(xs, ys, width, label=ts)
        for bar, label in zip(bars, labels):
            ax1.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                         fontsize=7)
    ax1.set_xticks(range(len(modes)))
    ax1.set_xticklabels(modes, rotation=25, ha="right", fontsize=8)
    ax1.set_ylabel("ms per forward (median)")
    ax1.set_title(f"LTX-2 forward, {result['config']['layers']} layers, {result['gpu']}", fontsize=9)
    ax1.legend(fontsize=8)

    rows = [(f"{ts}\n{m}", r["kernels"]["ms_per_forward"]) for ts in TIMESTEPS
            for m, r in result["results"].get(ts, {}).items()
            if isinstance(r.get("kernels"), dict) and "ms_per_forward" in r["kernels"]]
    bottom = [0.0] * len(rows)
    for key, color in (("gemm", "tab:blue"), ("attention", "tab:orange"), ("other", "tab:gray")):
        vals = [b[key] for _, b in rows]
        ax2.bar(range(len(rows)), vals, bottom=bottom, label=key, color=color)
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax2.set_xticks(range(len(rows)))
    ax2.set_xticklabels([n for n, _ in rows], fontsize=7)
    ax2.set_ylabel("CUDA kernel ms per forward")
    ax2.set_title("kernel time: GEMM / attention / other", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variant", choices=("2.0", "2.3"), default="2.0")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                    help="graphs-* modes: auto = when bitfuse.graphs exists")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--pass-coords", action="store_true", help="pass RoPE coordinates as the pipelines do")
    ap.add_argument("--timesteps", nargs="+", choices=TIMESTEPS, default=list(TIMESTEPS))
    ap.add_argument("--video", nargs=3, type=int, metavar=("F", "H", "W"), default=list(VIDEO),
                    help="video latent frames, height, width (default 16 16 24: 6144 tokens)")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tag", default="", help="suffix for the result file names")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG for an existing result file")
    args = ap.parse_args(argv)
    video = tuple(args.video)

    if args.plot:
        with open(args.plot) as f:
            result = json.load(f)
        png = os.path.splitext(args.plot)[0] + ".png"
        why = plot(result, png)
        print(why or f"wrote {png}")
        print_table(result)
        return 0 if why is None else 1

    if not torch.cuda.is_available():
        print("bench/ltx2.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        from bitfuse.models.ltx2_configs import build_model, full_config, make_inputs
        import diffusers  # noqa: F401
    except Exception as exc:
        print(f"needs diffusers 0.42.x: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2

    gpu = torch.cuda.get_device_name()
    result = {
        "bench": "ltx2",
        "gpu": gpu,
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "layers": args.layers,
            "variant": args.variant,
            "dtype": "bfloat16",
            "batch": 1,
            "video_latents": list(video),
            "video_tokens": video[0] * video[1] * video[2],
            "audio_tokens": AUDIO,
            "text_tokens": TEXT,
            "pass_coords": args.pass_coords,
            "iters": args.iters,
            "warmup": args.warmup,
        },
        "results": {},
        "notes": [],
    }
    print(f"GPU {gpu}  " + "  ".join(f"{k} {v}" for k, v in result["versions"].items()), flush=True)

    t0 = time.perf_counter()
    model = build_model(full_config(args.layers, args.variant), device="cuda", dtype=torch.bfloat16, seed=0)
    result["config"]["params"] = sum(p.numel() for p in model.parameters())
    print(f"model: {result['config']['params'] / 1e9:.2f}B parameters, built in {time.perf_counter() - t0:.1f}s",
          flush=True)

    graphs = args.graphs == "on" or (args.graphs == "auto" and importlib.util.find_spec("bitfuse.graphs") is not None)
    modes = [Eager("eager", model), Bitfuse("bitfuse-lossless", model, "lossless"),
             Bitfuse("bitfuse-high", model, "high")]
    if graphs:
        modes += [EagerGraphs("eager-graphs", model),
                  Bitfuse("graphs-lossless", model, "lossless", graphs=True),
                  Bitfuse("graphs-high", model, "high", graphs=True)]
    else:
        result["notes"].append("graphs modes skipped (bitfuse.graphs not found or --graphs off)")
    if args.compile:
        modes.append(CompileRegional("compile-regional", model))
    result["modes"] = [m.name for m in modes]

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"ltx2-{slug(gpu)}{('-' + slug(args.tag)) if args.tag else ''}")
    for ts in args.timesteps:
        kw = make_inputs(
            model, 1, video, AUDIO, TEXT, per_token=(ts == "per-token"), seed=0, device="cuda",
            dtype=torch.bfloat16, pass_coords=args.pass_coords, use_cross_timestep=args.variant == "2.3",
        )
        per_ts = result["results"][ts] = {}
        ref = None
        for mode in modes:
            print(f"[{ts}] {mode.name} ...", flush=True)
            rec, out = run_mode(mode, kw, ref, args)
            if mode.name == "eager":
                ref = out
                if ref is None:
                    result["notes"].append(f"{ts}: eager failed, no mismatch counts")
            per_ts[mode.name] = rec
            if "ms" in rec:
                print(f"  {rec['ms']:.2f} ms (first call {rec['first_call_s']:.2f}s)"
                      + (f", {rec['mismatches']} of {rec['numel']} differ" if rec.get("mismatches") is not None
                         else ""), flush=True)
            base = per_ts.get("eager", {}).get("ms")
            for rec in per_ts.values():
                if base and "ms" in rec:
                    rec["speedup"] = base / rec["ms"]
            with open(stem + ".json", "w") as f:  # after every mode: a cut-short run keeps what it measured
                json.dump(result, f, indent=1)

    why = plot(result, stem + ".png")
    if why:
        result["notes"].append(why)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {stem}.json" + ("" if why else f" and {stem}.png"))
    for note in result["notes"]:
        print(f"note: {note}")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
