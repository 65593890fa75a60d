"""One benchmark for an accelerated diffusers transformer, at the shape users run.

    python -m bench.models ltx2 --pass-coords                      # LTX-2.0, 48 layers, batch 2 (CFG)
    python -m bench.models ltx2 --layers 4 --batch 1               # the quick variant
    python -m bench.models ltx2.3 --pass-coords --stg              # LTX-2.3's STG call, without and with a mask
    python -m bench.models ltx2 --layers 4 --batch 1 --cold-start  # + first calls with cold and warm caches
    python -m bench.models ltx2 --tiny --device cpu                # the whole flow on a CPU (times mean nothing)
    python -m bench.models --plot bench/results/ltx2-nvidia-h200-b2.json

Presets (`PRESETS`): a builder of the random-init model and the forward kwargs its
pipeline passes. ltx2 / ltx2.3: diffusers' LTX2VideoTransformer3DModel at full width
(`ltx2_configs.full_config(layers, variant)`, 48 layers unless --layers), 6,144
video + 126 audio + 256 text tokens (121 frames at 512 x 768), batch 2 as
LTX2Pipeline runs CFG. flux, qwenimage: hooks for `bitfuse.models.flux_configs` /
`qwenimage_configs` (FLUX.1-dev at 1024 x 1024: 4,096 image + 512 text tokens, 19
double + 38 single blocks, B=1; Qwen-Image at 1328 x 1328, 60 layers, B=1). flux2:
`flux2_configs` (FLUX.2-dev at 1024 x 1024, 8 double + 48 single blocks, B=1; built in
bf16: 32B parameters, 64 GB). wan,
wan2.2-5b: `wan_configs` (Wan 2.1 14B at 832 x 480 x 81: 32,760 tokens, 40 layers;
Wan 2.2 TI2V 5B at 1280 x 704 x 121: 27,280 tokens, per-token timestep, 30 layers;
B=1, text 512 tokens). sana:
`sana_configs` (Sana 1.6B at 1024 x 1024: 1,024 image + 300 caption tokens, 20 layers,
B=2 as SanaPipeline runs CFG; its configs name the blocks for regional compile).

Method: every mode in one process, on one model, through `bitfuse.modes`.
1. First calls, in the order eager, lossless, high, graphs, compile: the mode is
   entered, two forwards timed (first and second call), their outputs compared
   with eager's, the mode undone. The bitfuse modes start from first sight
   (verdicts reset): their first call holds Triton's JIT of the kernels not yet
   compiled in this process, in the background (so lossless carries most of it;
   high compiles its own kernels in place), their second the gate's checks of
   those, and for graphs the first holds warm-up and capture;
   compile's holds Dynamo and Inductor with this machine's caches (--cold-start
   measures cold and warm caches in fresh processes).
2. --rounds interleaved rounds: a round visits every mode, in an order rotated each
   round; a visit enters the mode, runs one untimed forward (graphs capture again,
   compile reuses its compiled code), times --per-round synchronised forwards,
   compares the last with eager's output bit for bit, and undoes the mode. Each
   mode's samples are kept per round.
3. One profiled forward per mode (torch.profiler): CUDA kernel time split into
   GEMM / attention / other, and bitfuse's own kernels within other.
A thread samples the SM clock, power and temperature (NVML, through torch.cuda;
needs nvidia-ml-py) while the timed forwards run and files each sample under the
mode running.

Per mode: median / min / p90 ms per forward, speedup vs eager and vs compile,
output elements differing from eager bitwise and the max ULP, first-call seconds,
peak memory, kernel split, clock and power, gate verdicts. Writes
bench/results/<preset>-<gpu>-<tag>.json after every step (a run cut short keeps
what it measured), then a PNG (matplotlib, if installed), then prints a table;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import inspect
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Callable

import torch

from bench.timing import rotated, summary
from bitfuse import modes, numerics, policy
from bitfuse.models import UnsupportedModelError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
BITFUSE_MODES = ("lossless", "high", "graphs")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model to benchmark. `build(configs, args) -> (config, model)` and
    `workloads(configs, model, args) -> {name: (description, forward kwargs)}`,
    where `configs` is the module named `module`, imported when the preset runs.
    `options`: the preset-specific flags it takes (tokens, per_token, pass_coords, stg, pixels)."""

    name: str
    module: str
    about: str
    build: Callable
    workloads: Callable
    batch: int
    options: tuple = ()


class PresetUnavailable(RuntimeError):
    """The preset's configs module is not in this checkout."""


LTX2_VIDEO, LTX2_AUDIO, LTX2_TEXT = (16, 16, 24), 126, 256
LTX2_STG_BLOCK = 28  # LTX2Pipeline's default spatio_temporal_guidance_blocks


def _ltx2_build(configs, args, variant):
    if args.tiny:
        config = configs.tiny_config(variant, num_layers=args.layers or 2)
    else:
        config = configs.full_config(args.layers or 48, variant)
    return config, configs.build_model(config, device=args.device, dtype=args.dtype, seed=0)


def _ltx2_workloads(configs, model, args, variant):
    tokens = {} if args.tiny else dict(video_tokens_shape=tuple(args.video or LTX2_VIDEO),
                                       audio_tokens=args.audio_tokens or LTX2_AUDIO,
                                       text_tokens=args.text_tokens or LTX2_TEXT)
    # use_cross_timestep: LTX2Pipeline's default (True) is the 2.3 behaviour; 2.0 is run without it
    common = dict(tokens, pass_coords=args.pass_coords, use_cross_timestep=variant == "2.3", seed=0)
    coords = ", coordinates passed" if args.pass_coords else ""
    if args.stg:
        block = min(LTX2_STG_BLOCK, model.config.num_layers - 1)
        return {
            "stg": (f"STG call: B=1, block {block} perturbed, perturbation_mask=None as LTX2Pipeline "
                    f"passes it{coords}", configs.make_inputs(model, 1, stg_blocks=[block], **common)),
            "stg-mask": (f"the same call with perturbation_mask=[0] on the device (the same perturbation; "
                         f"the mask takes diffusers' torch.all(mask == 0) host sync){coords}",
                         configs.make_inputs(model, 1, stg_blocks=[block], perturbation_mask=torch.zeros(1),
                                             **common)),
        }
    out = {"per-sample": (f"B={args.batch}, per-sample timestep{coords}",
                          configs.make_inputs(model, args.batch, **common))}
    if args.per_token:
        out["per-token"] = (f"B={args.batch}, per-token timestep{coords}",
                            configs.make_inputs(model, args.batch, per_token=True, **common))
    return out


def _hook_build(configs, args):
    if args.tiny:
        config = configs.tiny_config()
    else:
        config = configs.full_config(args.layers) if args.layers else configs.full_config()
    return config, configs.build_model(config, device=args.device, dtype=args.dtype, seed=0)


def _hook_workloads(configs, model, args, pixels):
    """`make_inputs(model, batch=...)`, with height/width in pixels (--pixels, else the
    preset's) where it takes them (the recorded input shapes say what ran)."""
    kwargs = dict(batch=args.batch)
    pixels = args.pixels or pixels
    if not args.tiny and {"height", "width"} <= set(inspect.signature(configs.make_inputs).parameters):
        kwargs.update(height=pixels, width=pixels)
    return {"default": (f"B={args.batch}, {pixels} x {pixels}" if "height" in kwargs else f"B={args.batch}",
                        configs.make_inputs(model, **kwargs))}


#: Wan presets: (variant, height, width, frames): Wan 2.1 14B at 480p, 81 frames (21 x 60 x 104 latents,
#: 32,760 tokens, text 512); Wan 2.2 TI2V 5B at 1280 x 704, 121 frames (27,280 tokens), per-token timestep
WAN_VIDEO = {"2.1-14b": (480, 832, 81), "2.2-5b": (704, 1280, 121)}


def _wan_build(configs, args, variant):
    if args.tiny:
        config = configs.tiny_config(variant, num_layers=args.layers or 2)
    else:
        config = configs.full_config(variant, args.layers)
    return config, configs.build_model(config, device=args.device, dtype=args.dtype, seed=0)


def _wan_workloads(configs, model, args, variant):
    height, width, frames = (64, 96, 9) if args.tiny and variant == "2.1-14b" else \
        (128, 160, 9) if args.tiny else WAN_VIDEO[variant]
    tokens = configs.video_tokens(variant, height, width, frames)
    timestep = "per-token timestep" if variant == "2.2-5b" else "per-sample timestep"
    return {"default": (f"B={args.batch}, {width} x {height}, {frames} frames ({tokens} tokens), {timestep}",
                        configs.make_inputs(model, args.batch, height, width, frames, variant=variant,
                                            text_tokens=16 if args.tiny else 512))}


LTX_OPTIONS = ("tokens", "per_token", "pass_coords")
PRESETS = {
    p.name: p
    for p in (
        Preset("ltx2", "bitfuse.models.ltx2_configs", "LTX-2.0 transformer, full width",
               functools.partial(_ltx2_build, variant="2.0"), functools.partial(_ltx2_workloads, variant="2.0"), 2,
               LTX_OPTIONS),
        Preset("ltx2.3", "bitfuse.models.ltx2_configs", "LTX-2.3 flags (gated attention, prompt modulation, STG)",
               functools.partial(_ltx2_build, variant="2.3"), functools.partial(_ltx2_workloads, variant="2.3"), 2,
               LTX_OPTIONS + ("stg",)),
        Preset("flux", "bitfuse.models.flux_configs", "FLUX.1-dev at 1024 x 1024 (4,096 image + 512 text tokens)",
               _hook_build, functools.partial(_hook_workloads, pixels=1024), 1, ("pixels",)),
        Preset("flux2", "bitfuse.models.flux2_configs", "FLUX.2-dev at 1024 x 1024 (4,096 image + 512 text tokens)",
               _hook_build, functools.partial(_hook_workloads, pixels=1024), 1, ("pixels",)),
        Preset("qwenimage", "bitfuse.models.qwenimage_configs", "Qwen-Image at 1328 x 1328, 60 layers",
               _hook_build, functools.partial(_hook_workloads, pixels=1328), 1, ("pixels",)),
        Preset("wan", "bitfuse.models.wan_configs", "Wan 2.1 T2V 14B at 832 x 480, 81 frames (32,760 tokens)",
               functools.partial(_wan_build, variant="2.1-14b"), functools.partial(_wan_workloads, variant="2.1-14b"),
               1),
        Preset("wan2.2-5b", "bitfuse.models.wan_configs",
               "Wan 2.2 TI2V 5B at 1280 x 704, 121 frames (27,280 tokens), per-token timestep",
               functools.partial(_wan_build, variant="2.2-5b"), functools.partial(_wan_workloads, variant="2.2-5b"), 1),
        Preset("sana", "bitfuse.models.sana_configs", "Sana 1.6B at 1024 x 1024 (1,024 tokens, 300 caption tokens), "
               "20 layers, B=2 (CFG)", _hook_build, functools.partial(_hook_workloads, pixels=1024), 2, ("pixels",)),
    )
}


def load_configs(preset: Preset):
    """The preset's configs module, or PresetUnavailable saying it is missing."""
    try:
        return importlib.import_module(preset.module)
    except ModuleNotFoundError as exc:
        if exc.name == preset.module:
            raise PresetUnavailable(f"preset {preset.name!r} needs {preset.module}, which this checkout "
                                    "does not have yet") from None
        raise


def build(args) -> tuple:
    """(config, model, {workload: (description, kwargs)}) for parsed arguments; raises
    PresetUnavailable when the preset's configs module is missing."""
    preset = PRESETS[args.preset]
    configs = load_configs(preset)
    config, model = preset.build(configs, args)
    return config, model, preset.workloads(configs, model, args)


# ---------------------------------------------------------------- arguments


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model_arguments(ap: argparse.ArgumentParser, modes_default=modes.MODES) -> None:
    """The preset and its model and input options, and --modes (also used by
    bench/timeline.py and bench/host_profile.py)."""
    ap.add_argument("preset", nargs="?", choices=tuple(PRESETS), help="the model to run")
    g = ap.add_argument_group("model and inputs")
    g.add_argument("--layers", type=_positive, help="transformer blocks (default: the released depth, LTX-2 48)")
    g.add_argument("--batch", type=_positive, help="batch (default: the pipeline's; ltx2 2 for CFG, flux and "
                                                   "qwenimage 1)")
    g.add_argument("--per-token", action="store_true", help="ltx2: also a per-token timestep, as its own row")
    g.add_argument("--pass-coords", action="store_true",
                   help="ltx2: pass video/audio RoPE coordinates as LTX2Pipeline does")
    g.add_argument("--stg", action="store_true",
                   help="ltx2.3: the pipeline's STG call instead (B=1, one perturbed block, "
                        "perturbation_mask=None; and with a mask as a second row)")
    g.add_argument("--video", nargs=3, type=_positive, metavar=("F", "H", "W"),
                   help=f"ltx2: video latent frames, height, width (default {' '.join(map(str, LTX2_VIDEO))}: "
                        "6,144 tokens)")
    g.add_argument("--audio-tokens", type=_positive, help=f"ltx2: audio tokens (default {LTX2_AUDIO})")
    g.add_argument("--text-tokens", type=_positive, help=f"ltx2: text tokens (default {LTX2_TEXT})")
    g.add_argument("--pixels", type=_positive,
                   help="flux, qwenimage, sana: the image side in pixels (default the preset's: 1024, 1328, 1024); "
                        "a small image (sana: 64, 4 tokens a sample) times the host's floor (bench/host_profile.py)")
    g.add_argument("--tiny", action="store_true", help="the preset's tiny config (a CPU smoke of the flow)")
    g.add_argument("--device", default=None, help="cuda (default), cuda:N, or cpu (graphs and compile skipped)")
    g.add_argument("--modes", nargs="+", choices=modes.MODES, default=list(modes_default),
                   help=f"modes to run (default {' '.join(modes_default)}; eager always runs: it is the reference)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap)
    g = ap.add_argument_group("measurement")
    g.add_argument("--rounds", type=_positive, default=5, help="interleaved rounds (default 5)")
    g.add_argument("--per-round", type=_positive, default=3, help="timed forwards per mode a round (default 3)")
    g.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled forward")
    g.add_argument("--cold-start", action="store_true",
                   help="first, lossless's and compile's first calls in two fresh processes: empty Triton and "
                        "Inductor caches, then the same caches warm")
    g = ap.add_argument_group("output")
    g.add_argument("--out", default=RESULTS, help="results folder (default bench/results)")
    g.add_argument("--tag", help="file-name suffix (default from layers, batch, --pass-coords, --stg, --tiny)")
    g.add_argument("--plot", metavar="JSON", help="only redraw the PNG and print the table of a result file")
    ap.add_argument("--first-calls-json", help=argparse.SUPPRESS)  # the --cold-start child
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    return args if args.plot else resolve(ap, args)


def resolve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Check the model arguments (argparse's error, exit 2, on a bad combination) and
    fill in the batch, the mode list (eager first), the device and the dtype."""
    if args.preset is None:
        ap.error("name a preset: " + ", ".join(PRESETS))
    preset = PRESETS[args.preset]
    given = dict(per_token=args.per_token, pass_coords=args.pass_coords, stg=args.stg,
                 tokens=args.video or args.audio_tokens or args.text_tokens, pixels=args.pixels)
    for option, value in given.items():
        if value and option not in preset.options:
            flag = "--video/--audio-tokens/--text-tokens" if option == "tokens" else "--" + option.replace("_", "-")
            ap.error(f"{flag} does not apply to preset {preset.name}")
    if args.stg:
        if args.batch not in (None, 1):
            ap.error("--stg runs the pipeline's STG call, which is batch 1: drop --batch")
        if args.per_token:
            ap.error("--stg and --per-token: choose one workload")
    args.batch = 1 if args.stg else (args.batch or preset.batch)
    args.modes = [m for m in modes.MODES if m == "eager" or m in args.modes]
    args.device = torch.device(args.device or "cuda")
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", 0)
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    return args


def default_tag(args) -> str:
    parts = ([f"{args.layers}l"] if args.layers else []) + [f"b{args.batch}"]
    parts += [f"{args.pixels}px"] if getattr(args, "pixels", None) else []
    parts += [flag for flag, on in (("coords", args.pass_coords), ("stg", args.stg), ("tiny", args.tiny)) if on]
    return "-".join(parts)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


# ---------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensors_of(out) -> list[torch.Tensor]:
    """The output tensors of a forward, in order (tuples, lists, dicts, ModelOutputs)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors_of(o)]
    return []


def compare(outs: list, ref: list) -> dict:
    """Elements of `outs` differing bitwise from `ref` (numerics.differing) and the max ULP."""
    if len(outs) != len(ref):
        return dict(differing=None, numel=sum(r.numel() for r in ref), max_ulp=None,
                    note=f"{len(outs)} outputs against eager's {len(ref)}")
    diff = ulp = 0
    for o, r in zip(outs, ref):
        diff += numerics.differing(o, r)
        if o.shape == r.shape and o.dtype == r.dtype and r.dtype in (torch.bfloat16, torch.float16, torch.float32):
            ulp = max(ulp, numerics.max_ulp(o, r))
    return dict(differing=diff, numel=sum(r.numel() for r in ref), max_ulp=ulp)


def peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|wgmma|matmul|splitk|triton_tem_", re.I)
_ATTN = re.compile(r"flash|fmha|attention|attn|sdpa|mha", re.I)
_BITFUSE = re.compile(r"^_\w+_kernel$")  # bitfuse's Triton kernels (bitfuse/ops); Inductor's are triton_*


def kernel_class(name: str) -> str:
    """"attention", "gemm" or "other" for a CUDA kernel name (attention first: flash
    kernels are named cutlass too)."""
    if _ATTN.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "other"


def is_bitfuse_kernel(name: str) -> bool:
    return bool(_BITFUSE.match(name))


def split_kernels(kernels, forwards: int = 1) -> dict:
    """`kernels`: (name, microseconds) of each CUDA kernel run in `forwards` forwards.
    ms per forward by class, the bitfuse kernels' share of "other", the top kernels."""
    ms = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    ours = 0.0
    per_kernel: Counter = Counter()
    for name, us in kernels:
        ms[kernel_class(name)] += us / 1e3 / forwards
        if is_bitfuse_kernel(name):
            ours += us / 1e3 / forwards
        per_kernel[name] += us / 1e3 / forwards
    total = sum(ms.values())
    return dict(ms=ms, total_ms=total, bitfuse_ms=ours,
                top=[[name[:120], round(v, 4)] for name, v in per_kernel.most_common(12)])


def profile_kernels(call, device) -> dict | None:
    """One forward under torch.profiler: its CUDA kernel time split (`split_kernels`)."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        sync(device)
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if getattr(e, "device_type", None) == DeviceType.CUDA]
    if not kernels:
        return dict(note="the profiler saw no CUDA kernels (graph replays untraced by this build?)")
    return split_kernels(kernels)


class GpuSampler:
    """Samples (SM clock MHz, power W, temperature C) every `interval` seconds in a
    thread and files each under the tag set by `tagged(...)` (untagged time is not
    sampled). `read` defaults to torch.cuda's NVML queries; without NVML `why` says
    so and nothing is sampled."""

    FIELDS = ("sm_clock_mhz", "power_w", "temperature_c")

    def __init__(self, device, interval: float = 0.025, read: Callable | None = None):
        self.samples: dict[str, list] = {}
        self.tag = None
        self.why = None
        self.read_s = 0.0  # time spent in reads (the sampler's own cost)
        self.interval = interval
        self.read = read or self._nvml(device)
        self._stop = threading.Event()
        self._thread = None

    def _nvml(self, device):
        if device.type != "cuda":
            self.why = "not a CUDA device"
            return None

        def read():
            return (torch.cuda.clock_rate(device), torch.cuda.power_draw(device) / 1e3,
                    torch.cuda.temperature(device))

        try:
            read()
        except Exception as exc:
            self.why = f"NVML unavailable ({type(exc).__name__}: {exc}); install nvidia-ml-py for clocks and power"
            return None
        return read

    def start(self) -> "GpuSampler":
        if self.read is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self):
        while not self._stop.wait(self.interval):
            tag = self.tag
            if tag is None:
                continue
            t0 = time.perf_counter()
            try:
                value = self.read()
            except Exception as exc:  # recorded, and sampling stops
                self.why = f"sampling failed: {type(exc).__name__}: {exc}"
                return
            self.read_s += time.perf_counter() - t0
            self.samples.setdefault(tag, []).append(value)

    @contextlib.contextmanager
    def tagged(self, tag: str):
        self.tag = tag
        try:
            yield
        finally:
            self.tag = None

    def summary(self, tag: str) -> dict | None:
        rows = self.samples.get(tag)
        if not rows:
            return None
        out = {"samples": len(rows)}
        for i, field in enumerate(self.FIELDS):
            s = summary([r[i] for r in rows])
            out[field] = dict(median=s["median"], min=s["min"], max=max(r[i] for r in rows))
        return out


# ---------------------------------------------------------------- one workload, every mode


class Workload:
    """Every mode on one model and one set of forward kwargs: `run()` does the first
    calls, the interleaved rounds and the profile, recording into `self.rec` (a node
    of the result JSON) and calling `save()` after every step."""

    def __init__(self, model, kwargs: dict, args, sampler: GpuSampler, save: Callable, rec: dict,
                 enter: Callable = modes.enter):
        self.model, self.kwargs, self.args = model, kwargs, args
        self.device = args.device
        self.sampler, self.save, self.rec, self.enter = sampler, save, rec, enter
        self.reference = None
        self.live: list[str] = []
        rec.setdefault("modes", {})

    def _call(self):
        with torch.no_grad():
            return self.model(**self.kwargs)

    def _timed(self):
        """(ms of the synchronised forward, the thread's CPU ms until the call returned,
        the output). The CPU time leaves out the sync (a spinning wait) and any time the
        thread waited for a CPU: on a shared host, the host work the mode itself needs."""
        sync(self.device)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        out = self._call()
        c1 = time.thread_time()
        sync(self.device)
        return (time.perf_counter() - t0) * 1e3, (c1 - c0) * 1e3, out

    @contextlib.contextmanager
    def _entered(self, mode):
        undo = self.enter(mode, self.model)
        try:
            yield
        finally:
            undo()
            self._free()

    def _free(self):
        """What the mode held goes back before the next one runs (graphs' pools above all)."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _guarded(self, mode: str, step: str, fn) -> bool:
        """Run one step of a mode; an exception marks the mode failed (recorded, the run goes on)."""
        try:
            fn()
            return True
        except (modes.ModeError, UnsupportedModelError) as exc:  # the mode cannot run here: a reason, not a failure
            self.rec["modes"][mode] = dict(skipped=str(exc))
            log(f"  {mode}: skipped ({exc})")
        except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others
            self.rec["modes"][mode].update(error=f"{step}: {type(exc).__name__}: {exc}"[:2000])
            log(f"  {mode}: FAILED in {step}: {type(exc).__name__}: {str(exc)[:300]}")
            self._free()
        if mode in self.live:
            self.live.remove(mode)
        return False

    def run(self) -> None:
        for mode in self.args.modes:
            self.rec["modes"][mode] = {}
            log(f"  {mode}: first call")
            if self._guarded(mode, "first call", lambda m=mode: self.first_call(m)):
                self.live.append(mode)
            self.save()
            if mode == "eager" and self.reference is None:
                raise RuntimeError("eager, the reference, failed: " + self.rec["modes"]["eager"].get("error", ""))
        for r in range(self.args.rounds):
            for mode in rotated(list(self.live), r):
                self._guarded(mode, f"round {r}", lambda m=mode, r=r: self.visit(m, r))
                self.finish()
                self.save()
            log(f"  round {r + 1}/{self.args.rounds}: " + ", ".join(
                f"{m} {self.rec['modes'][m]['ms']:.2f}" for m in self.live if self.rec["modes"][m].get("ms")) + " ms")
        if self.args.profile and self.device.type == "cuda":
            for mode in list(self.live):
                log(f"  {mode}: profiled forward")
                self._guarded(mode, "profile", lambda m=mode: self.profile(m))
                self.save()
        self.rec["verdicts_at_end"] = dict(Counter(f"{v.tier} {v.status}" for v in policy.verdicts()))

    def first_call(self, mode: str) -> None:
        rec = self.rec["modes"][mode]
        if mode in BITFUSE_MODES:
            policy.reset_verdicts()
        peak_reset(self.device)
        frames = _dynamo_frames()
        with self._entered(mode):
            ms, _, out = self._timed()
            rec["first_call_s"] = ms / 1e3
            outs = tensors_of(out)
            if mode == "eager":
                self.reference = [t.clone() for t in outs]
            check = compare(outs, self.reference)
            rec["first_call_differing"] = check["differing"]
            _merge(rec, check)
            del out, outs
            # the second call: where bitfuse verifies the kernels the first compiled in the background
            ms, _, out = self._timed()
            rec["second_call_s"] = ms / 1e3
            _merge(rec, compare(tensors_of(out), self.reference))
            del out
            rec["peak_mem_gib"] = peak_gib(self.device)
        if mode in BITFUSE_MODES:
            found = policy.verdicts()
            rec["verdicts"] = dict(Counter(v.status for v in found))
            bad = [f"{v.signature}: {v.status} {v.detail}".strip() for v in found if v.status != "verified"]
            if bad:
                rec["verdict_problems"] = bad[:20]
        if mode == "compile":
            rec["dynamo_frames_first_call"] = _dynamo_frames() - frames

    def visit(self, mode: str, r: int) -> None:
        rec = self.rec["modes"][mode]
        peak_reset(self.device)
        frames = _dynamo_frames()
        t0 = time.perf_counter()
        with self._entered(mode):
            self._call()
            sync(self.device)
            reentry = time.perf_counter() - t0
            times, cpu = [], []
            load = os.getloadavg()[0]
            with self.sampler.tagged(mode):
                for _ in range(self.args.per_round):
                    ms, cpu_ms, out = self._timed()
                    times.append(ms)
                    cpu.append(cpu_ms)
            check = compare(tensors_of(out), self.reference)
            del out
            peak = peak_gib(self.device)
        rec.setdefault("rounds_ms", []).append([round(t, 4) for t in times])
        rec.setdefault("rounds_cpu_ms", []).append([round(t, 4) for t in cpu])
        rec.setdefault("load_1min", []).append(round(load, 2))
        rec.setdefault("reentry_s", []).append(round(reentry, 4))
        rec.setdefault("differing_per_round", []).append(check["differing"])
        _merge(rec, check)
        if peak is not None:
            rec["peak_mem_gib"] = max(rec.get("peak_mem_gib") or 0.0, peak)
        if mode == "compile":
            rec["dynamo_frames_in_rounds"] = rec.get("dynamo_frames_in_rounds", 0) + _dynamo_frames() - frames

    def finish(self) -> None:
        """Statistics, speedups and clock/power of every mode from the samples so far."""
        ms = {}
        for mode, rec in self.rec["modes"].items():
            samples = [t for r in rec.get("rounds_ms", []) for t in r]
            if not samples:
                continue
            s = summary(samples)
            rec.update(ms=s["median"], ms_min=s["min"], ms_p90=s["p90"], samples=s["n"])
            cpu = [t for r in rec.get("rounds_cpu_ms", []) for t in r]
            if cpu:
                rec["cpu_ms"] = summary(cpu)["median"]
            ms[mode] = s["median"]
            gpu = self.sampler.summary(mode)
            if gpu is not None:
                rec["gpu"] = gpu
        for mode, rec in self.rec["modes"].items():
            if mode in ms:
                rec["speedup_vs_eager"] = ms["eager"] / ms[mode] if "eager" in ms else None
                rec["speedup_vs_compile"] = ms["compile"] / ms[mode] if "compile" in ms else None

    def profile(self, mode: str) -> None:
        with self._entered(mode):
            self._call()  # graphs capture again here
            sync(self.device)
            self.rec["modes"][mode]["kernels"] = profile_kernels(self._call, self.device)


def _merge(rec: dict, check: dict) -> None:
    """Fold one comparison with eager into a mode's record: the most elements that
    differed in any checked forward, and the largest ULP (None: not comparable)."""
    rec["numel"] = check["numel"]
    for key in ("differing", "max_ulp"):
        if check[key] is None or (key in rec and rec[key] is None):
            rec[key] = None
        else:
            rec[key] = max(rec.get(key, 0), check[key])


def _dynamo_frames() -> int:
    """Frames Dynamo has compiled in this process (a recompile during the timed rounds
    would show here)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["total"])
    except Exception:  # noqa: BLE001 - a diagnostic only
        return 0


# ---------------------------------------------------------------- cold start


def first_calls(args, model, kwargs) -> dict:
    """The --cold-start child's work: eager's first call (CUDA, cuBLAS and the
    allocator warm up there), then lossless's and compile's, each in a fresh mode."""
    w = Workload(model, kwargs, args, GpuSampler(torch.device("cpu")), lambda: None, {})
    out = {"triton_cache": os.environ.get("TRITON_CACHE_DIR"),
           "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    for mode in ("eager", "lossless", "compile"):
        if mode != "eager" and mode not in args.modes:
            continue
        try:
            modes.check(mode, args.device)
        except modes.ModeError as exc:
            out[mode] = dict(skipped=str(exc))
            continue
        w.rec["modes"][mode] = {}
        w.first_call(mode)
        rec = w.rec["modes"][mode]
        out[mode] = {k: rec[k] for k in ("first_call_s", "second_call_s", "differing", "verdicts") if k in rec}
        log(f"  child: {mode} first call {rec['first_call_s']:.2f} s, second {rec['second_call_s']:.2f} s")
    return out


def cold_start(argv: list, timeout_s: float = 420) -> dict:
    """Two child processes running `first_calls` with the same fresh TRITON_CACHE_DIR
    and TORCHINDUCTOR_CACHE_DIR: the first compiles everything (cold), the second
    finds it cached (warm)."""
    child = [a for a in argv if a != "--cold-start"]
    out = {}
    with tempfile.TemporaryDirectory(prefix="bitfuse-cold-start-") as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
        for phase in ("cold", "warm"):
            path = os.path.join(tmp, f"{phase}.json")
            log(f"cold start: {phase} caches, a child process")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, "-m", "bench.models", *child, "--first-calls-json", path],
                                      cwd=ROOT, env=env, timeout=timeout_s, stdout=sys.stderr)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            out[phase] = json.load(open(path)) if rc == 0 and os.path.exists(path) else dict(error=f"exit {rc}")
            out[phase]["process_s"] = round(time.perf_counter() - t0, 2)
    return out


def cold_start_text(cs: dict) -> str:
    lines = []
    for phase, what in (("cold", "empty Triton and Inductor caches"), ("warm", "the same caches, warm")):
        r = cs.get(phase, {})
        if "error" in r:
            lines.append(f"{phase} ({what}): child failed, {r['error']}")
            continue
        parts = [f"{m} {r[m]['first_call_s']:.2f} s" + (f" (then {r[m]['second_call_s']:.2f} s)" if "second_call_s" in r[m] else "")
                 for m in ("eager", "lossless", "compile") if isinstance(r.get(m), dict) and "first_call_s" in r[m]]
        lines.append(f"first calls, {phase} ({what}): " + ", ".join(parts))
    return "\n".join(lines)


# ---------------------------------------------------------------- output


def versions() -> dict:
    import bitfuse

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "bitfuse": bitfuse.__version__}
    for mod in ("triton", "diffusers"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            out[mod] = f"unavailable ({type(exc).__name__})"
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "bitfuse"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        if out["commit"] and changed:
            out["commit"] += "+changes"  # the package differs from that commit: `source` says what ran
    except Exception:  # noqa: BLE001 - not a git checkout
        out["commit"] = None
    out["source"] = source_digest()
    return out


def source_digest() -> str:
    """sha256 (first 16 hex digits) of the bitfuse package's Python sources, by path:
    what ran, checkable against a checkout of any commit (`python -c "from bench.models
    import source_digest; print(source_digest())"`) where the copy that ran was not one."""
    import hashlib

    package = os.path.join(ROOT, "bitfuse")
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(package)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, package).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def write_json(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def _cell(v, fmt: str, width: int, suffix: str = "") -> str:
    return ("-" if v is None else format(v, fmt) + suffix).rjust(width)


COLUMNS = (("ms", 9), ("min", 9), ("p90", 9), ("vs eager", 8), ("vs comp", 8), ("differing", 12), ("ULP", 6),
           ("1st s", 7), ("GiB", 6), ("gemm/attn/other (bitfuse) ms", 29), ("MHz", 5), ("W", 4))


def table(result: dict) -> str:
    """The printed summary: one block per workload, one row per mode."""
    cfg = result["config"]
    lines = [f"{result['preset']}: {result.get('about', '')}, {cfg.get('layers')} layers, batch {cfg.get('batch')}, "
             f"{result['gpu']}, {cfg.get('rounds')} rounds x {cfg.get('per_round')} forwards ({result['status']})"]
    if result.get("cold_start"):
        lines.append(cold_start_text(result["cold_start"]))
    head = f"{'mode':<9}" + "".join(" " + name.rjust(width) for name, width in COLUMNS)
    for name, w in result["workloads"].items():
        lines += ["", f"[{name}] {w.get('describe', '')}", head]
        for mode, r in w["modes"].items():
            if "skipped" in r or "error" in r:
                why = "skipped: " + r["skipped"] if "skipped" in r else "FAILED: " + r["error"]
                lines.append(f"{mode:<9} {why}"[:160])
                continue
            k = r.get("kernels") or {}
            split = (f"{k['ms']['gemm']:.1f}/{k['ms']['attention']:.1f}/{k['ms']['other']:.1f} ({k['bitfuse_ms']:.1f})"
                     if k.get("ms") else None)
            gpu = r.get("gpu") or {}
            diff = "reference" if mode == "eager" else (None if r.get("differing") is None else f"{r['differing']:,}")
            cells = [_cell(r.get("ms"), ".2f", 9), _cell(r.get("ms_min"), ".2f", 9), _cell(r.get("ms_p90"), ".2f", 9),
                     _cell(r.get("speedup_vs_eager"), ".2f", 8, "x"), _cell(r.get("speedup_vs_compile"), ".2f", 8, "x"),
                     _cell(diff, "s", 12), _cell(r.get("max_ulp"), "d", 6), _cell(r.get("first_call_s"), ".2f", 7),
                     _cell(r.get("peak_mem_gib"), ".1f", 6), _cell(split, "s", 29),
                     _cell((gpu.get("sm_clock_mhz") or {}).get("median"), ".0f", 5),
                     _cell((gpu.get("power_w") or {}).get("median"), ".0f", 4)]
            lines.append(f"{mode:<9} " + " ".join(cells))
            if r.get("verdicts"):
                lines.append(f"{'':<9} verdicts: " + ", ".join(f"{n} {k}" for k, n in r["verdicts"].items()))
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Median ms per mode and workload (labelled with the speedup over eager), and the
    kernel split of the first workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["workloads"].items())
    names = [m for m in modes.MODES if any("ms" in w["modes"].get(m, {}) for _, w in workloads)]
    cfg = result["config"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(1, len(workloads))
    for i, (wname, w) in enumerate(workloads):
        timed = [(j, w["modes"][m]) for j, m in enumerate(names) if "ms" in w["modes"].get(m, {})]
        offset = (i - (len(workloads) - 1) / 2) * width
        bars = ax1.bar([j + offset for j, _ in timed], [r["ms"] for _, r in timed], width, label=wname)
        for bar, (_, r) in zip(bars, timed):
            ax1.annotate(f"{r.get('speedup_vs_eager') or 0:.2f}x", (bar.get_x() + width / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylabel("ms per forward (median)")
    ax1.set_title(f"{result['preset']}, {cfg.get('layers')} layers, batch {cfg.get('batch')}, {result['gpu']}",
                  fontsize=9)
    ax1.legend(fontsize=8)
    first = workloads[0][1]["modes"] if workloads else {}
    split = [(m, first[m]["kernels"]["ms"]) for m in names if (first.get(m, {}).get("kernels") or {}).get("ms")]
    bottom = [0.0] * len(split)
    for key, color in (("gemm", "tab:blue"), ("attention", "tab:orange"), ("other", "tab:gray")):
        values = [k[key] for _, k in split]
        ax2.bar(range(len(split)), values, bottom=bottom, label=key, color=color)
        bottom = [a + v for a, v in zip(bottom, values)]
    ax2.set_xticks(range(len(split)), [m for m, _ in split])
    ax2.set_ylabel("CUDA kernel ms per forward")
    ax2.set_title(f"kernel time ({workloads[0][0] if workloads else ''}): GEMM / attention / other", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


class Interrupted(BaseException):
    """SIGTERM (a timeout): stop, keep what was measured."""


def _on_sigterm(signum, frame):
    raise Interrupted(f"signal {signum}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.plot:
        result = json.load(open(args.plot))
        png = os.path.splitext(args.plot)[0] + ".png"
        plot(result, png)
        print(table(result))
        print(f"wrote {png}")
        return 0
    preset = PRESETS[args.preset]
    try:
        load_configs(preset)
    except PresetUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run on a GPU, or pass --device cpu (with --tiny) for a smoke run", file=sys.stderr)
        return 2

    if args.first_calls_json:  # the --cold-start child
        _, model, workloads = build(args)
        _, kwargs = next(iter(workloads.values()))
        write_json(args.first_calls_json, first_calls(args, model, kwargs))
        return 0

    signal.signal(signal.SIGTERM, _on_sigterm)
    gpu = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    result = dict(
        bench="models", preset=preset.name, about=preset.about, gpu=gpu, device=str(args.device),
        versions=versions(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python -m bench.models " + shlex.join(argv), method=__doc__.split("Method: ", 1)[1].strip(),
        config=dict(batch=args.batch, dtype=str(args.dtype).replace("torch.", ""), rounds=args.rounds,
                    per_round=args.per_round, modes=args.modes, pass_coords=args.pass_coords, tiny=args.tiny),
        workloads={}, notes=[], status="running",
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{slug(preset.name)}-{slug(gpu)}-{slug(args.tag or default_tag(args))}")
    path = stem + ".json"
    sampler = GpuSampler(args.device)
    if sampler.why:
        result["notes"].append(f"clock and power not recorded: {sampler.why}")
        log(f"clock and power not recorded: {sampler.why}")
    log(f"{gpu}; " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
    try:
        if args.cold_start:
            result["cold_start"] = cold_start(argv)
            write_json(path, result)
            log(cold_start_text(result["cold_start"]))
        t0 = time.perf_counter()
        config, model, workloads = build(args)
        result["config"].update(model=config, layers=getattr(model.config, "num_layers", args.layers),
                                params=sum(p.numel() for p in model.parameters()))
        log(f"model: {result['config']['params'] / 1e9:.2f}B parameters, built in {time.perf_counter() - t0:.1f} s")
        sampler.start()
        for name, (describe, kwargs) in workloads.items():
            rec = result["workloads"][name] = dict(describe=describe, inputs={
                k: list(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            log(f"[{name}] {describe}")
            Workload(model, kwargs, args, sampler, lambda: write_json(path, result), rec).run()
            if "compile" in args.modes:
                torch._dynamo.reset()  # the next workload compiles afresh, as a new process would
        result["status"] = "complete"
    except (Interrupted, KeyboardInterrupt) as exc:
        result["status"] = f"interrupted ({exc or type(exc).__name__})"
        log(result["status"])
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        result["status"] = f"failed: {type(exc).__name__}: {exc}"[:2000]
        log(result["status"])
    finally:
        sampler.stop()
        if sampler.read is not None and sampler.why:
            result["notes"].append(f"clock and power sampling stopped: {sampler.why}")
        reads = sum(len(v) for v in sampler.samples.values())
        if reads:
            result["nvml_reads"] = dict(n=reads, mean_ms=round(sampler.read_s / reads * 1e3, 3),
                                        interval_ms=sampler.interval * 1e3)
        write_json(path, result)
    log(f"wrote {path}")
    try:
        plot(result, stem + ".png")
        log(f"wrote {stem}.png")
    except Exception as exc:  # noqa: BLE001 - the JSON is written; a plot is a convenience
        log(f"no plot: {type(exc).__name__}: {exc}")
    print(table(result))
    return 0 if result["status"] == "complete" else 1


if __name__ == "__main__":
    sys.exit(main())
