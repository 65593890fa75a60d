"""`bitfuse run`: diffusers' LTX-2 pipeline in each mode, timed, its decoded video and
audio compared bit for bit with the stock pipeline's, and written as mp4.

The pipeline is `LTX2Pipeline` (`LTX2ImageToVideoPipeline` with `--image`):
text connectors, the transformer's denoising loop with the pipeline's own
guidance, the video VAE decode, the audio VAE and the vocoder. It is built
once, from random components in code (`--preset`, see bitfuse.pipeline) or
from a local checkpoint (`--checkpoint`), and each mode (bitfuse.modes) is
entered on it and undone after. Every mode makes the same call with the same
seed: first a two-step warm-up call (the first step compiles bitfuse's kernels
in the background, the second verifies them at first sight; CUDA-graph capture
and compilation happen there too), then the timed call. Eager, the stock
pipeline, runs first and is the reference.

Context parallelism (`torchrun --nproc-per-node N -m bitfuse run ...
--context-parallel ulysses|ring`): every rank builds the same pipeline and runs
eager on its own GPU first (the one-GPU reference), then the transformer is
sharded with diffusers' engine and bitfuse's LTX-2 plan
(bitfuse.models.ltx2_parallel) and each mode runs again across the N GPUs;
eager under context parallelism is then the reference the other modes must equal
bit for bit, and its difference from one GPU is reported. Rank 0 reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

import torch

from . import modes as _modes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_PROMPT = "A red fox trots through fresh snow at dawn, its breath steaming in the cold air"
CPU_FLOPS = 1e11  # what the estimate of a CPU run assumes a CPU sustains
CPU_LIMIT_S = 600  # a longer CPU run needs --yes
# the warm-up call's steps: the first compiles bitfuse's kernels in the background, the second
# verifies them (bitfuse.background_compiles), so the timed call runs verified kernels only
WARMUP_STEPS = 2
_OURS = ("FallbackWarning", "GraphCaptureWarning")  # bitfuse's warnings: collected into the report


class UsageError(Exception):
    """A bad argument: message to stderr, exit 2."""


class RunError(Exception):
    """The run cannot go on: message to stderr, exit 1."""


# ---------------------------------------------------------------- arguments


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .pipeline import PRESETS

    parser.description = (
        "Run diffusers' LTX-2 pipeline (text connectors, denoising loop, VAE decode, audio VAE, vocoder) "
        "in each mode, time it, check the decoded video and audio against the stock pipeline bit for bit, "
        "and write each mode's video as mp4."
    )
    tiny, ltx2 = PRESETS["tiny"], PRESETS["ltx2"]
    g = parser.add_argument_group("pipeline")
    g.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="random components built in code: tiny (default; a CPU runs it in seconds) or ltx2 "
                        "(the full-width transformer; a GPU job)")
    g.add_argument("--variant", choices=("2.0", "2.3"), default=None,
                   help="LTX-2.0 (default) or LTX-2.3 (gated attention, prompt modulation, split RoPE)")
    g.add_argument("--layers", type=int, default=None,
                   help=f"transformer blocks of a preset (tiny {tiny['layers']}, ltx2 {ltx2['layers']})")
    g.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a local diffusers-format LTX-2 or LTX-2.3 pipeline folder (text encoder included)")
    g.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default: bf16 on a GPU, fp32 on a CPU")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights, prompt and latents")
    g.add_argument("--yes", action="store_true",
                   help="run on a CPU what is estimated to take more than 10 minutes there (--preset ltx2: hours)")
    c = parser.add_argument_group("generation")
    c.add_argument("--prompt", default=None, help="text prompt (needs a --checkpoint with a text encoder)")
    c.add_argument("--image", default=None, metavar="PATH", help="image-to-video from this image")
    c.add_argument("--height", type=int, default=None,
                   help=f"pixels, a multiple of 32 (tiny {tiny['height']}, ltx2 and --checkpoint {ltx2['height']})")
    c.add_argument("--width", type=int, default=None,
                   help=f"pixels, a multiple of 32 (tiny {tiny['width']}, ltx2 and --checkpoint {ltx2['width']})")
    c.add_argument("--frames", type=int, default=None,
                   help=f"video frames (tiny {tiny['frames']}, ltx2 and --checkpoint {ltx2['frames']})")
    c.add_argument("--fps", type=_finite, default=24.0, help="frame rate (default 24)")
    c.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    c.add_argument("--guidance-scale", type=_finite, default=3.0, help="video CFG scale (default 3.0, as LTX2Pipeline)")
    c.add_argument("--audio-guidance-scale", type=_finite, default=7.0,
                   help="audio CFG scale (default 7.0, as LTX2Pipeline)")
    c.add_argument("--text-tokens", type=int, default=None,
                   help=f"length of the random prompt embeddings used without a text encoder "
                        f"(tiny {tiny['text_tokens']}, ltx2 {ltx2['text_tokens']})")
    r = parser.add_argument_group("modes and output")
    r.add_argument("--modes", default=None,
                   help=f"comma-separated, from {', '.join(_modes.MODES)} (default: eager, lossless, high, and "
                        "graphs on a CUDA GPU); eager, the stock pipeline, always runs first as the reference")
    r.add_argument("--out", default="bitfuse-run", metavar="DIR",
                   help="folder for the videos, one <mode>.mp4 each (default ./bitfuse-run)")
    r.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON ('-': stdout)")
    r.add_argument("--plot", default=None, metavar="PATH", help="write a bar chart of per-step time (.png, .svg, .pdf)")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bars (there are none either when stderr is not a terminal)")
    p = parser.add_argument_group("context parallelism (launch with torchrun --nproc-per-node N)")
    p.add_argument("--context-parallel", choices=("ulysses", "ring"), default=None,
                   help="split the transformer's sequences over the torchrun processes' GPUs with diffusers' "
                        "Ulysses (all-to-all over heads) or ring attention and bitfuse's LTX-2 plan")
    p.add_argument("--cp-anything", action="store_true",
                   help="diffusers' uneven mode (ulysses_anything / ring_anything): sequence lengths (and, with "
                        "Ulysses, head counts) that the GPU count does not divide")
    p.add_argument("--cp-backend", default=None,
                   help="diffusers attention backend for every run (default: native for ulysses, _native_cudnn "
                        "for ring, which needs the log-sum-exp native does not return)")


# ---------------------------------------------------------------- validation


def _resolve(args) -> dict:
    """Check every argument, the environment and the output paths before any work; return the settings."""
    _check_requirements()
    from . import pipeline as P

    checkpoint = index = None
    if args.checkpoint is not None:
        given = [f for f, v in (("--preset", args.preset), ("--variant", args.variant), ("--layers", args.layers))
                 if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} apply to the random presets; --checkpoint has its own model")
        try:
            index = P.check_checkpoint(args.checkpoint)
        except P.CheckpointError as exc:
            raise UsageError(f"--checkpoint {exc}") from None
        checkpoint = args.checkpoint
    preset = args.preset or "tiny"
    p = P.PRESETS["ltx2" if checkpoint else preset]  # a checkpoint takes LTX-2's default sizes

    def positive(name, value, default):
        value = default if value is None else value
        if value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")
        return value

    layers = positive("layers", args.layers, p["layers"])
    steps = positive("steps", args.steps, 8)
    frames = positive("frames", args.frames, p["frames"])
    text_tokens = positive("text-tokens", args.text_tokens, p["text_tokens"])
    height, width = positive("height", args.height, p["height"]), positive("width", args.width, p["width"])
    if height % 32 or width % 32:
        raise UsageError(f"--height and --width must be multiples of 32 (LTX2Pipeline), got {height}x{width}")
    if args.fps <= 0:
        raise UsageError(f"--fps must be positive, got {args.fps}")
    if args.guidance_scale < 0 or args.audio_guidance_scale < 0:
        raise UsageError("guidance scales must not be negative")

    cp = _context_parallel(args)
    device = cp["device"] if cp else _device(args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    mode_list = _mode_list(args.modes, device, cp)

    has_text_encoder = bool(index and index.get("text_encoder") not in (None, [None, None]))
    if args.prompt is not None and not has_text_encoder:
        raise UsageError("--prompt needs a --checkpoint with a text encoder; "
                         "without one the prompt is random embeddings (--text-tokens)")
    image = _load_image(args.image) if args.image is not None else None

    s = dict(
        preset=None if checkpoint else preset, variant=args.variant or "2.0", layers=layers, checkpoint=checkpoint,
        text_encoder=has_text_encoder, prompt=args.prompt or DEFAULT_PROMPT, image=args.image, image_data=image,
        height=height, width=width, frames=frames, fps=args.fps, steps=steps, text_tokens=text_tokens,
        guidance_scale=args.guidance_scale, audio_guidance_scale=args.audio_guidance_scale, seed=args.seed,
        modes=mode_list, device=device, dtype_name=dtype_name, dtype=DTYPES[dtype_name],
        out=_check_out_dir(args.out), json=_check_output("--json", args.json), plot=_check_plot(args.plot),
        cp=cp,
    )
    if device.type == "cpu" and not args.yes:
        seconds, what = _cpu_estimate(s)
        if seconds > CPU_LIMIT_S:
            raise UsageError(f"on a CPU this is {what}: about {seconds / 3600:.1f} hours at {CPU_FLOPS / 1e9:.0f} "
                             "GFLOP/s. Use a CUDA GPU or smaller sizes, or pass --yes to run it here anyway.")
    return s


def _device(arg: str | None) -> torch.device:
    cuda = torch.cuda.is_available()
    try:
        device = torch.device(arg or ("cuda" if cuda else "cpu"))
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {arg!r}; use cuda, cuda:N or cpu") from None
    if device.type == "cuda":
        if not cuda:
            raise UsageError("--device cuda, but no CUDA GPU is available here (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {str(device)!r}; use cuda, cuda:N or cpu")
    return device


def _mode_list(arg: str | None, device: torch.device, cp: dict | None = None) -> list[str]:
    """The modes to run, eager (the reference) first."""
    graphs = device.type == "cuda" and not cp
    names = [m.strip() for m in (arg or "eager,lossless,high" + (",graphs" * graphs)).split(",")]
    names = [m for m in names if m]
    if not names:
        raise UsageError(f"--modes is empty; choose from: {', '.join(_modes.MODES)}")
    for m in names:
        if cp and m in ("graphs", "compile"):
            raise UsageError(f"mode {m!r} does not run with --context-parallel (its collectives run inside the "
                             "forward; tested are eager, lossless and high); drop it from --modes")
        try:
            _modes.check(m, device)
        except _modes.ModeError as exc:
            raise UsageError(f"{exc}; drop it from --modes") from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return ["eager"] + [m for m in dict.fromkeys(names) if m != "eager"]


def _context_parallel(args) -> dict | None:
    """--context-parallel: the torchrun process's rank, world size and GPU; checked before any work."""
    if args.context_parallel is None:
        given = [f for f, v in (("--cp-anything", args.cp_anything), ("--cp-backend", args.cp_backend)) if v]
        if given:
            raise UsageError(f"{', '.join(given)} apply with --context-parallel")
        return None
    launch = f"torchrun --nproc-per-node N -m bitfuse run ... --context-parallel {args.context_parallel}"
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise UsageError(f"--context-parallel runs one process per GPU: launch with {launch}")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world < 2:
        raise UsageError(f"--context-parallel with one process has nothing to split: launch {world} more with "
                         f"{launch} (N >= 2), or drop --context-parallel")
    if not torch.cuda.is_available():
        raise UsageError("--context-parallel needs CUDA GPUs (NCCL); none is available here")
    if local >= torch.cuda.device_count():
        raise UsageError(f"process {rank} (local rank {local}) has no GPU: {torch.cuda.device_count()} here; "
                         "use --nproc-per-node at most the GPU count")
    if args.device not in (None, "cuda"):
        raise UsageError(f"--device {args.device}: with --context-parallel each process takes the GPU of its "
                         "LOCAL_RANK (cuda:LOCAL_RANK)")
    return {"kind": args.context_parallel, "world": world, "rank": rank, "device": torch.device("cuda", local),
            "anything": args.cp_anything,
            "backend": args.cp_backend or ("_native_cudnn" if args.context_parallel == "ring" else None)}


def _cp_config(cp: dict):
    from diffusers.models._modeling_parallel import ContextParallelConfig

    key = "ulysses" if cp["kind"] == "ulysses" else "ring"
    return ContextParallelConfig(**{f"{key}_degree": cp["world"], f"{key}_anything": cp["anything"]})


def _check_requirements() -> None:
    try:
        import diffusers
    except ImportError:
        raise RunError("bitfuse run needs diffusers, which is not installed: "
                       "pip install 'bitfuse[diffusers]'") from None
    if not hasattr(diffusers, "LTX2Pipeline"):
        raise RunError(f"bitfuse run needs diffusers 0.42 (LTX-2), found {diffusers.__version__}: "
                       "pip install 'bitfuse[diffusers]'")
    for module, why in (("transformers", "LTX-2 pipeline's text classes"), ("av", "mp4 writer (PyAV)")):
        try:
            __import__(module)
        except ImportError:
            raise RunError(f"bitfuse run needs {module} (the {why}), which is not installed: "
                           "pip install 'bitfuse[diffusers]'") from None


def _load_image(path: str):
    import PIL.Image

    try:
        with PIL.Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError) as exc:
        raise UsageError(f"--image {path}: cannot read it as an image ({exc})") from None


def _check_output(flag: str, path: str | None) -> str | None:
    """A file path that can be written: not a folder, in a folder that exists and is writable. '-' is stdout."""
    if path is None or path == "-":
        return path
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot write in {folder}")
    return path


def _check_plot(path: str | None) -> str | None:
    if path is None:
        return None
    if path == "-":
        raise UsageError("--plot writes a file; give it a name")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or 'bitfuse[plot]')") from None
    kinds = ("png", "svg", "pdf")
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in kinds or ext not in Figure().canvas.get_supported_filetypes():
        raise UsageError(f"--plot {path}: give a .png, .svg or .pdf name")
    return _check_output("--plot", path)


def _check_out_dir(path: str) -> str:
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path}: exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"--out {path}: folder {parent} does not exist")
    if not os.access(path if os.path.isdir(path) else parent, os.W_OK):
        raise UsageError(f"--out {path}: cannot write there")
    return path


def _cpu_estimate(s: dict) -> tuple[float, str]:
    """(seconds, what) this run would take on a CPU at CPU_FLOPS, from the transformer's
    config alone (built on the meta device) and LTX-2's 32x / 8x latent compression."""
    from diffusers import LTX2VideoTransformer3DModel

    from .pipeline import transformer_config

    if s["checkpoint"]:
        with open(os.path.join(s["checkpoint"], "transformer", "config.json")) as f:
            config = json.load(f)
    else:
        config = transformer_config(s["preset"], s["variant"], s["layers"])
    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    c = model.config
    video = ((s["frames"] - 1) // 8 + 1) * (s["height"] // 32) * (s["width"] // 32)
    audio = round(s["frames"] / s["fps"] * 25)
    attention = 4 * c.num_layers * (video**2 * c.num_attention_heads * c.attention_head_dim
                                    + audio**2 * c.audio_num_attention_heads * c.audio_attention_head_dim)
    # a step is 4 samples' forwards: CFG's batch of 2, then the pipeline's STG and modality-isolation calls
    seconds = (2 * params * (video + audio) + attention) * 4 * (s["steps"] + WARMUP_STEPS) * len(s["modes"]) / CPU_FLOPS
    size = f"{params / 1e9:.1f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"
    weights = params * torch.finfo(s["dtype"]).bits / 8
    weights = f"{weights / 2**30:.1f} GiB" if weights >= 2**30 else f"{weights / 2**20:.0f} MiB"
    return seconds, (f"a {size}-parameter transformer ({weights} in {s['dtype_name']}) over "
                     f"{video:,} video + {audio:,} audio tokens, {s['steps'] + 1} steps in each of "
                     f"{len(s['modes'])} modes")


# ---------------------------------------------------------------- one pipeline call, timed


class _Clock:
    """Wall time of one pipeline call, of each denoising step (from the callback at each
    step's end) and of the transformer's calls (forward hooks); CUDA-synchronized."""

    def __init__(self, pipe, device, on_step=None):
        self.pipe, self.on_step = pipe, on_step
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.marks: list[float] = []  # the first transformer call's start, then each step's end
        self.transformer_s = 0.0
        self.first_output = None  # the first transformer call's output: step 0 of every call has the same inputs
        self._start = 0.0

    def _pre(self, module, args, kwargs):
        self.sync()
        self._start = time.perf_counter()
        if not self.marks:
            self.marks.append(self._start)

    def _post(self, module, args, kwargs, out):
        self.sync()
        self.transformer_s += time.perf_counter() - self._start
        if self.first_output is None:
            self.first_output = [o.detach().clone() for o in out]

    def _step_end(self, pipe, i, t, tensors):
        self.sync()
        self.marks.append(time.perf_counter())
        if self.on_step:
            self.on_step()
        return {}

    def __call__(self, call: dict):
        hooks = [self.pipe.transformer.register_forward_pre_hook(self._pre, with_kwargs=True),
                 self.pipe.transformer.register_forward_hook(self._post, with_kwargs=True)]
        try:
            self.sync()
            t0 = time.perf_counter()
            out = self.pipe(**call, callback_on_step_end=self._step_end)
            self.sync()
            self.total_s = time.perf_counter() - t0
        finally:
            for h in hooks:
                h.remove()
        self.step_ms = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return out


def _call_kwargs(pipe, s: dict) -> dict:
    from .pipeline import is_ltx23, random_prompt

    call = dict(height=s["height"], width=s["width"], num_frames=s["frames"], frame_rate=s["fps"],
                num_inference_steps=s["steps"], guidance_scale=s["guidance_scale"],
                audio_guidance_scale=s["audio_guidance_scale"],
                use_cross_timestep=is_ltx23(pipe.transformer),  # False is LTX-2.0's behaviour
                output_type="pt", return_dict=False)
    if pipe.text_encoder is not None:
        call.update(prompt=s["prompt"], negative_prompt="")
    else:
        call.update(random_prompt(pipe, s["text_tokens"], seed=s["seed"]))
    if s["image_data"] is not None:
        call["image"] = s["image_data"]
    return call


def _run_mode(mode: str, pipe, s: dict, progress: bool) -> dict:
    from tqdm.auto import tqdm

    from . import policy
    from .numerics import same_bits

    device = s["device"]
    call = _call_kwargs(pipe, s)
    policy.reset_verdicts()  # each mode meets its fast paths at first sight, in its own warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bar = tqdm(total=s["steps"] + WARMUP_STEPS, desc=f"{mode:>8}", unit="step", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    with warnings.catch_warnings(record=True) as caught, bar:
        warnings.simplefilter("always")
        undo = _modes.enter(mode, pipe)
        try:
            warm = _Clock(pipe, device, bar.update)
            warm(dict(call, num_inference_steps=WARMUP_STEPS, generator=torch.Generator(device).manual_seed(s["seed"])))
            clock = _Clock(pipe, device, bar.update)
            video, audio = clock(dict(call, generator=torch.Generator(device).manual_seed(s["seed"])))
        finally:
            undo()
    for w in caught:  # hand every warning but bitfuse's own on as it was
        if w.category.__name__ not in _OURS:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    tiers = {"lossless": ("lossless",), "graphs": ("lossless",), "high": ("lossless", "high")}.get(mode, ())
    seen = [v for v in policy.verdicts() if v.tier in tiers]
    result = dict(
        mode=mode, error=None,
        warmup_ms=warm.total_s * 1e3,
        step_ms=clock.step_ms,
        median_step_ms=statistics.median(clock.step_ms),
        total_ms=clock.total_s * 1e3,
        transformer_ms=clock.transformer_s * 1e3,
        transformer_share=clock.transformer_s / clock.total_s,
        # the warm-up call's first step has the timed call's inputs (same seed, sigma 1.0): the same output
        repeatable=all(same_bits(a, b) for a, b in zip(warm.first_output, clock.first_output)),
        fast_paths={k: sum(v.status == k for v in seen) for k in ("verified", "mismatch", "error")},
        verdicts=[dict(op=v.op, tier=v.tier, signature=v.signature, status=v.status, device=v.device,
                       detail=v.detail) for v in seen],
        warnings=sorted({str(w.message) for w in caught if w.category.__name__ in _OURS}),
        _video=video.cpu(), _audio=audio.cpu(),
    )
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def _compare_one_gpu(r: dict, single: dict) -> None:
    """How many values of a context-parallel run differ from eager on one GPU."""
    from .numerics import differing

    for kind in ("video", "audio"):
        r[f"one_gpu_{kind}_differing"] = differing(r[f"_{kind}"], single[f"_{kind}"])


def _compare(r: dict, ref: dict) -> None:
    from .numerics import differing, same_bits

    for kind in ("video", "audio"):
        a, b = r[f"_{kind}"], ref[f"_{kind}"]
        r[f"{kind}_equal"] = same_bits(a, b)
        r[f"{kind}_differing"] = 0 if r[f"{kind}_equal"] else differing(a, b)
        r[f"{kind}_values"] = b.numel()
    r["equal"] = r["video_equal"] and r["audio_equal"]
    r["speedup"] = ref["median_step_ms"] / r["median_step_ms"]


# ---------------------------------------------------------------- report


def _versions() -> dict:
    from . import __version__

    out = {"python": platform.python_version(), "torch": torch.__version__, "bitfuse": __version__}
    for name in ("triton", "diffusers", "transformers", "av"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def header(report: dict) -> str:
    c = report["config"]
    what = (f"checkpoint {c['checkpoint']}" if c["checkpoint"]
            else f"LTX-{c['variant']} {c['preset']} pipeline (random weights)")
    prompt = "text encoder" if c["text_encoder"] else f"{c['text_tokens']} random text tokens"
    task = f"image-to-video from {c['image']}" if c["image"] else "text-to-video"
    return "\n".join([
        f"bitfuse run: {what}, {_n(c['layers'], 'layer')}, {c['dtype']}, {report['device_name']}",
        f"{task}: {c['frames']} frames of {c['width']}x{c['height']} at {c['fps']:g} fps -> "
        f"{c['video_tokens']} video + {c['audio_tokens']} audio tokens, {prompt}; {_n(c['steps'], 'step')}, "
        f"guidance {c['guidance_scale']:g} (audio {c['audio_guidance_scale']:g}), seed {c['seed']}",
        f"each mode: a {WARMUP_STEPS}-step warm-up call (kernel compiles and first-sight checks, graph capture, "
        "compilation), then the timed call"
        + ("; times CUDA-synchronized" if c["cuda"] else ""),
    ] + ([f"context parallelism: {c['context_parallel']['kind']} over {c['context_parallel']['gpus']} GPUs, "
          f"attention backend {c['context_parallel']['attention_backend']}"
          + (", uneven mode" if c["context_parallel"]["uneven"] else "")] if c.get("context_parallel") else []))


def _verdict_text(r: dict) -> str:
    if r.get("error"):
        return "failed: " + r["error"].splitlines()[0][:70]
    if r["mode"] == "eager":
        return "reference"
    if r["equal"]:
        return "bit-identical"
    parts = [f"{kind} {r[kind + '_differing']:,} of {r[kind + '_values']:,} values"
             for kind in ("video", "audio") if not r[kind + "_equal"]]
    return "differs: " + ", ".join(parts)


def _fast_text(r: dict) -> str:
    if r["mode"] in ("eager", "compile"):
        return "-"
    f = r["fast_paths"]
    parts = [f"{f['verified']} verified"] + [f"{f[k]} {k}" for k in ("mismatch", "error") if f[k]]
    return ", ".join(parts)


def format_table(report: dict) -> str:
    cuda = report["config"]["cuda"]
    head = ["mode", "step ms", "total ms", "transformer"] + (["speedup", "fast paths"] if cuda else [])
    head.append("video + audio vs stock")
    rows = []
    for r in report["modes"]:
        if r.get("error"):
            rows.append([r["mode"]] + ["-"] * (len(head) - 2) + [_verdict_text(r)])
            continue
        row = [r["mode"], f"{r['median_step_ms']:.1f}", f"{r['total_ms']:.0f}", f"{r['transformer_share']:.0%}"]
        if cuda:
            row += [f"{r['speedup']:.2f}x", _fast_text(r)]
        rows.append(row + [_verdict_text(r)])
    numeric = {1, 2, 3, 4} if cuda else {1, 2, 3}
    widths = [max(len(row[i]) for row in rows + [head]) for i in range(len(head))]

    def fmt(row):
        cells = (v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows])


def write_plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = report["config"]
    runs = [r for r in report["modes"] if not r.get("error")]
    values = [r["median_step_ms"] for r in runs]
    colors = ["#888888" if r["mode"] == "eager" else "#2a9d8f" if r["equal"] else "#e9c46a" for r in runs]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(runs) + 2), 4.5))
    bars = ax.bar([r["mode"] for r in runs], values, color=colors)
    top = max(values)
    for bar, r in zip(bars, runs):
        label = "stock" if r["mode"] == "eager" else "bit-identical" if r["equal"] else "not identical"
        if c["cuda"] and r["mode"] != "eager":
            label += f"\n{r['speedup']:.2f}x"
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01 * top, label,
                ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("ms per denoising step (median)")
    ax.set_ylim(0, top * 1.25)
    title = (f"LTX-2 pipeline, {c['layers']} layers, {c['video_tokens']}+{c['audio_tokens']} tokens, "
             f"{c['dtype']}, {report['device_name']}")
    if not c["cuda"]:
        title += "\nno GPU: every mode runs the same eager code, so the differences are noise"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _strict(value):
    """The report as strict JSON values: NaN and infinities become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


# ---------------------------------------------------------------- main


def _check_shift(pipe, video_tokens: int) -> None:
    """LTX2Pipeline shifts its timesteps by exp(mu), mu linear in the video tokens: past
    about 2M tokens that overflows (OverflowError: math range error) before any step."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    c = pipe.scheduler.config
    if not c.get("use_dynamic_shifting"):
        return
    mu = calculate_shift(video_tokens, c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.95), c.get("max_shift", 2.05))
    if mu > math.log(sys.float_info.max):
        raise UsageError(f"{video_tokens:,} video tokens is more than LTX2Pipeline's timestep shift can take "
                         "(exp(mu) overflows); use a smaller --height/--width/--frames")


def _cpu_oom(exc: BaseException) -> bool:
    """torch's CPU allocator failing (a RuntimeError, where CUDA raises torch.OutOfMemoryError)."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _build(s: dict):
    from diffusers.utils import logging as dlogging

    from . import pipeline as P

    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # no notices about module dtypes and unused components
    try:
        if s["checkpoint"]:
            try:
                pipe = P.load_pipeline(s["checkpoint"], image=s["image"] is not None, device=s["device"],
                                       dtype=s["dtype"])
            except (OSError, ValueError, TypeError) as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise RunError(f"--checkpoint {s['checkpoint']}: cannot load it: {first}") from None
        else:
            pipe = P.random_pipeline(s["preset"], s["variant"], s["layers"], image=s["image"] is not None,
                                     device=s["device"], dtype=s["dtype"], seed=s["seed"])
    finally:
        dlogging.set_verbosity(verbosity)
    pipe.set_progress_bar_config(disable=True)  # bitfuse run draws its own, warm-up included
    return pipe


def main(args) -> int:
    try:
        return _main(args)
    except UsageError as exc:
        print(f"bitfuse run: error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"bitfuse run: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        cpu = _cpu_oom(exc)
        if not (cpu or isinstance(exc, torch.OutOfMemoryError)):
            raise
        first = str(exc).splitlines()[0] if str(exc) else "out of memory"
        print(f"bitfuse run: error: {'CPU' if cpu else 'CUDA'} out of memory ({first}). Try a smaller "
              "--height/--width/--frames, fewer --layers or --text-tokens, or a smaller --preset.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bitfuse run: interrupted", file=sys.stderr)
        return 130


def _main(args) -> int:
    s = _resolve(args)
    device = s["device"]
    cuda = device.type == "cuda"
    if cuda and device.index is not None:
        torch.cuda.set_device(device)
    cp = s["cp"]
    if cp:
        return _distributed(lambda: _run(args, s), device)
    return _run(args, s)


def _distributed(fn, device):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=30))
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def _enable_cp(pipe, s: dict) -> str:
    """Shard the transformer (bitfuse.models.ltx2_parallel); returns a short description."""
    from .models import ltx2_parallel

    cp = s["cp"]
    ltx2_parallel.enable_context_parallel(pipe.transformer, _cp_config(cp))
    return f"{cp['kind']} x{cp['world']}" + (" (uneven)" if cp["anything"] else "")


def _check_cp_sizes(pipe, s: dict, video_tokens: int, audio_tokens: int) -> None:
    from .models import ltx2_parallel

    text = None if pipe.text_encoder is not None else s["text_tokens"]
    try:
        ltx2_parallel.check_sizes(pipe.transformer.config, _cp_config(s["cp"]), video_tokens=video_tokens,
                                  audio_tokens=audio_tokens, text_tokens=text, audio_text_tokens=text)
    except ltx2_parallel.ContextParallelError as exc:
        raise UsageError(f"--context-parallel {s['cp']['kind']} over {s['cp']['world']} GPUs: {exc}") from None


def _run(args, s: dict) -> int:
    from .pipeline import is_ltx23, token_counts, write_mp4

    device = s["device"]
    cuda = device.type == "cuda"
    cp = s["cp"]
    lead = not cp or cp["rank"] == 0  # the rank that reports and writes
    out = sys.stderr if s["json"] == "-" else sys.stdout  # keep stdout for the JSON
    if not lead:
        out = open(os.devnull, "w")  # noqa: SIM115 - for the whole run
    progress = not args.no_progress and sys.stderr.isatty() and lead

    pipe = _build(s)
    video_tokens, audio_tokens = token_counts(pipe, s["frames"], s["height"], s["width"], s["fps"])
    _check_shift(pipe, video_tokens)
    if cp:
        _check_cp_sizes(pipe, s, video_tokens, audio_tokens)
        if cp["backend"]:
            pipe.transformer.set_attention_backend(cp["backend"])
    t = pipe.transformer.config
    config = dict(
        preset=s["preset"], checkpoint=s["checkpoint"], variant="2.3" if is_ltx23(pipe.transformer) else "2.0",
        layers=int(t.num_layers), parameters=sum(p.numel() for p in pipe.transformer.parameters()),
        text_encoder=pipe.text_encoder is not None,
        text_tokens=None if pipe.text_encoder is not None else s["text_tokens"],
        image=s["image"], height=s["height"], width=s["width"], frames=s["frames"], fps=s["fps"],
        video_tokens=video_tokens, audio_tokens=audio_tokens, steps=s["steps"], guidance_scale=s["guidance_scale"],
        audio_guidance_scale=s["audio_guidance_scale"], seed=s["seed"], dtype=s["dtype_name"], device=str(device),
        cuda=cuda, modes=s["modes"], pipeline=type(pipe).__name__,
        context_parallel=None if not cp else {"kind": cp["kind"], "gpus": cp["world"], "uneven": cp["anything"],
                                              "attention_backend": cp["backend"] or "native"},
    )
    report = dict(config=config, device_name=_device_name(device), versions=_versions(), modes=[], notes=[])
    print(header(report), file=out, flush=True)

    os.makedirs(s["out"], exist_ok=True)
    results, ref, single = [], None, None
    if cp:  # eager on this rank's GPU alone: what context parallelism is compared with
        single = _run_mode("eager", pipe, s, progress)
        single.update(mode="eager-1gpu", speedup=1.0)
        print(f"context parallelism: {_enable_cp(pipe, s)}; eager on one GPU first "
              f"({single['median_step_ms']:.1f} ms a step)", file=out, flush=True)
    for mode in s["modes"]:
        try:
            r = _run_mode(mode, pipe, s, progress)
        except Exception as exc:
            if isinstance(exc, torch.OutOfMemoryError) or _cpu_oom(exc):
                raise
            if mode == "eager":
                raise RunError(f"the stock pipeline failed: {type(exc).__name__}: {exc}") from None
            r = dict(mode=mode, error=f"{type(exc).__name__}: {exc}")
            print(f"bitfuse run: mode {mode} failed: {r['error']}", file=sys.stderr)
        if not r["error"]:
            ref = ref or r  # eager, the first mode
            if r is ref:
                r["speedup"] = 1.0
            else:
                _compare(r, ref)
            if single is not None:
                _compare_one_gpu(r, single)
            r["video"] = os.path.join(s["out"], f"{mode}.mp4")
            if lead:
                write_mp4(r["video"], pipe, r["_video"], r["_audio"], s["fps"])
            if r is not ref:
                del r["_video"], r["_audio"]
        results.append(r)
        if cuda:
            torch.cuda.empty_cache()

    notes = report["notes"]
    if single is not None:
        e = results[0]
        if not e.get("error"):
            same = e["one_gpu_video_differing"] == 0 and e["one_gpu_audio_differing"] == 0
            notes.append(
                f"Context parallelism ({config['context_parallel']['kind']} over {cp['world']} GPUs) against one "
                f"GPU: eager per step {single['median_step_ms']:.1f} -> {e['median_step_ms']:.1f} ms "
                f"({single['median_step_ms'] / e['median_step_ms']:.2f}x); its output "
                + ("is bit-identical." if same else
                   f"differs in {e['one_gpu_video_differing']:,} video and {e['one_gpu_audio_differing']:,} audio "
                   "values: each GPU runs the GEMMs on its share of the rows (cuBLAS may pick another algorithm "
                   "for another row count) and attention on a share of the heads (Ulysses) or merges partial "
                   "softmaxes in fp32 (ring); the denoising loop carries that through the steps."))
        report["one_gpu"] = {k: v for k, v in single.items() if not k.startswith("_")}
    if not cuda:
        notes.append("No CUDA GPU: bitfuse's fast paths need one, so every mode ran the same exact eager code here; "
                     "the comparison with the stock pipeline is real, the time differences between modes are noise.")
    broken = [r["mode"] for r in results[1:] if r["mode"] in _modes.BIT_IDENTICAL and not r["error"] and not r["equal"]]
    if broken:
        notes.append(f"FAIL: {', '.join(broken)} did not reproduce the stock pipeline's video and audio bit for bit.")
    if not results[0]["repeatable"]:
        notes.append("Note: the stock pipeline did not repeat itself here (its warm-up and timed calls differ at the "
                     "first step), so a difference from it need not be bitfuse's.")
    for r in results:
        notes.extend(f"{r['mode']}: {w}" for w in r.get("warnings", []))
    if cuda:
        notes.append("Peak GPU memory (GiB): " + ", ".join(
            f"{r['mode']} {r['peak_memory_gib']:.1f}" for r in results if "peak_memory_gib" in r) + ".")
    videos = [r["video"] for r in results if r.get("video")]
    notes.append("Videos (mp4, with the audio track): " + ", ".join(videos))
    report["modes"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    print("\n" + format_table(report) + "\n\n" + "\n".join(notes), file=out, flush=True)
    if not lead:
        return 1 if broken or any(r["error"] for r in results) else 0

    if s["json"]:
        text = json.dumps(_strict(report), indent=2, allow_nan=False)
        if s["json"] == "-":
            print(text)
        else:
            with open(s["json"], "w") as f:
                f.write(text + "\n")
            print(f"wrote {s['json']}", file=out)
    if s["plot"]:
        write_plot(report, s["plot"])
        print(f"wrote {s['plot']}", file=out)
    return 1 if broken or any(r["error"] for r in results) else 0
