"""`bitfuse run`: a real LTX-2 denoising loop, timed in every mode and checked bit for bit.

The loop mirrors diffusers' `LTX2Pipeline.__call__` (pipelines/ltx2/pipeline_ltx2.py)
in compact form: `LTX2VideoTransformer3DModel` over seeded video and audio
latents, `FlowMatchEulerDiscreteScheduler` with the pipeline's resolution-
dependent shift (one scheduler for video, a copy for audio), classifier-free
guidance as a batch of two (uncond, cond) combined in x0 space, RoPE
coordinates computed once before the loop. Weights cannot be downloaded here,
so the transformer is random-init with a fixed seed (or `--checkpoint PATH`
loads a local diffusers-format one), and the text embeddings are random.

Every mode runs the same loop from the same initial latents on the same model
(built once; bitfuse is mounted before a mode and restored after it):

- eager     plain diffusers, the reference;
- lossless  `bitfuse.accelerate(model, quality="lossless")`: must be bit-identical;
- high      `bitfuse.accelerate(model, quality="high")`: within 1 ULP per op;
- compile   `torch.compile` of the model's repeated blocks (regional), no bitfuse;
- graphs    `bitfuse.accelerate(model, cuda_graphs=True)` (needs `bitfuse.graphs`).

Each mode takes one untimed warm-up step (first-sight verification, compilation
and graph capture happen there), then the timed loop, CUDA-synchronized per step.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

import torch

MODES = ("eager", "lossless", "high", "compile", "graphs")
DEFAULT_MODES = ("eager", "lossless", "high")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FPS = 24.0

# Shapes in latent units. ltx2: the LTX-2 pipeline's default 121 frames at
# 512x768 pixels -> 16 x 16 x 24 = 6144 video tokens and 126 audio tokens.
PRESETS = {
    "tiny": dict(layers=2, frames=2, height=4, width=4, text_tokens=8),
    "ltx2": dict(layers=8, frames=16, height=16, width=24, text_tokens=256),
}

# FlowMatchEulerDiscreteScheduler with the shift parameters LTX2Pipeline reads
# (its defaults: base 0.95, max 2.05 over 1024..4096 tokens).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
)


class UsageError(Exception):
    """A bad argument: message to stderr, exit 2."""


class RunError(Exception):
    """The run cannot go on: message to stderr, exit 1."""


# ---------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run an LTX-2 denoising loop (diffusers' LTX2VideoTransformer3DModel, FlowMatchEulerDiscreteScheduler, "
        "CFG) in each mode, time it, and check the final latents against eager bit for bit."
    )
    g = parser.add_argument_group("model")
    g.add_argument("--preset", default="tiny", help="tiny (default: runs on a CPU in seconds) or ltx2 (full width)")
    g.add_argument("--variant", default="2.0",
                   help="2.0 (LTX-2.0, default) or 2.3 (gated attention, prompt modulation, split RoPE)")
    g.add_argument("--layers", type=int, default=None, help="transformer blocks (tiny: 2, ltx2: 8)")
    g.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="a local diffusers-format LTX-2 transformer folder (or a pipeline folder with transformer/)")
    g.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on a GPU, fp32 on a CPU)")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    g.add_argument("--seed", type=int, default=0, help="seed for the weights, latents and text embeddings")
    s = parser.add_argument_group("shape (latent units)")
    s.add_argument("--frames", type=int, default=None, help="latent frames (tiny: 2, ltx2: 16)")
    s.add_argument("--height", type=int, default=None, help="latent height (tiny: 4, ltx2: 16)")
    s.add_argument("--width", type=int, default=None, help="latent width (tiny: 4, ltx2: 24)")
    s.add_argument("--text-tokens", type=int, default=None, help="text embedding length (tiny: 8, ltx2: 256)")
    d = parser.add_argument_group("denoising")
    d.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    d.add_argument("--guidance-scale", type=float, default=3.0, help="video CFG scale (default 3.0, as LTX2Pipeline)")
    d.add_argument("--audio-guidance-scale", type=float, default=7.0,
                   help="audio CFG scale (default 7.0, as LTX2Pipeline)")
    d.add_argument("--no-cfg", action="store_true", help="no classifier-free guidance (batch of 1)")
    r = parser.add_argument_group("modes and report")
    r.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, from {', '.join(MODES)} (default {','.join(DEFAULT_MODES)}); "
                        "eager always runs first as the reference")
    r.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    r.add_argument("--plot", default=None, metavar="PATH", help="write a PNG bar chart of per-step time (matplotlib)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")


# ---------------------------------------------------------------- validation


def _resolve(args) -> dict:
    """Check every argument before anything heavy runs; return the resolved settings."""
    preset = args.preset
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    p = PRESETS[preset]

    def positive(name, value, default):
        value = default if value is None else value
        if value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")
        return value

    layers = positive("layers", args.layers, p["layers"])
    steps = positive("steps", args.steps, 8)
    frames = positive("frames", args.frames, p["frames"])
    height = positive("height", args.height, p["height"])
    width = positive("width", args.width, p["width"])
    text_tokens = positive("text-tokens", args.text_tokens, p["text_tokens"])

    variant = str(args.variant)
    if variant not in ("2.0", "2.3"):
        raise UsageError(f"unknown variant {variant!r}; choose 2.0 or 2.3")

    modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
    if not modes:
        raise UsageError(f"--modes is empty; choose from: {', '.join(MODES)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UsageError(f"unknown mode {unknown[0]!r}; choose from: {', '.join(MODES)}")
    modes = ["eager"] + [m for m in dict.fromkeys(modes) if m != "eager"]

    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {args.device!r}; use cuda, cuda:N or cpu") from None
    if device.type == "cuda":
        if not cuda:
            raise UsageError("--device cuda, but no CUDA GPU is available here (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {str(device)!r}; use cuda, cuda:N or cpu")

    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if dtype_name not in DTYPES:
        raise UsageError(f"unknown dtype {dtype_name!r}; choose one of: {', '.join(DTYPES)}")

    if "graphs" in modes:
        if device.type != "cuda":
            raise UsageError("mode 'graphs' needs a CUDA GPU (CUDA graphs); drop it from --modes on a CPU")
        if importlib.util.find_spec("bitfuse.graphs") is None:
            raise UsageError("mode 'graphs' needs bitfuse.graphs, which this installation of bitfuse does not have")
    if "compile" in modes and not hasattr(torch, "compile"):
        raise UsageError("mode 'compile' needs torch.compile (torch >= 2.0)")

    checkpoint = None
    if args.checkpoint is not None:
        checkpoint = _check_checkpoint(args.checkpoint)

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib (or bitfuse[plot])") from None

    if args.guidance_scale < 0 or args.audio_guidance_scale < 0:
        raise UsageError("guidance scales must not be negative")

    return dict(
        preset=preset, variant=variant, layers=layers, steps=steps, frames=frames, height=height, width=width,
        text_tokens=text_tokens, modes=modes, device=device, dtype_name=dtype_name, dtype=DTYPES[dtype_name],
        checkpoint=checkpoint, cfg=not args.no_cfg, guidance_scale=float(args.guidance_scale),
        audio_guidance_scale=float(args.audio_guidance_scale), seed=int(args.seed),
    )


def _check_checkpoint(path: str) -> tuple[str, str | None]:
    """(folder, subfolder) of an LTX-2 transformer, or UsageError saying why not."""
    if not os.path.exists(path):
        raise UsageError(f"--checkpoint {path}: no such file or directory")
    if not os.path.isdir(path):
        raise UsageError(f"--checkpoint {path}: not a directory (expected a diffusers-format transformer folder)")
    for sub in (None, "transformer"):
        cfg_path = os.path.join(path, sub or "", "config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path) as f:
                    cls = json.load(f).get("_class_name")
            except (OSError, ValueError) as exc:
                raise UsageError(f"--checkpoint {path}: cannot read {cfg_path}: {exc}") from None
            if cls != "LTX2VideoTransformer3DModel":
                raise UsageError(
                    f"--checkpoint {path}: not an LTX-2 transformer ({cfg_path} names {cls!r}, "
                    "expected 'LTX2VideoTransformer3DModel')"
                )
            return path, sub
    raise UsageError(
        f"--checkpoint {path}: not an LTX-2 transformer (no config.json there or in transformer/; "
        "expected a diffusers-format LTX2VideoTransformer3DModel folder)"
    )


# ---------------------------------------------------------------- model and inputs


def _build_model(s: dict):
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.utils import logging as dlogging

    from .models.ltx2_configs import build_model, full_config, tiny_config

    device, dtype = s["device"], s["dtype"]
    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # no "modules kept in float32: []" notice on .to(dtype)
    try:
        if s["checkpoint"] is not None:
            path, sub = s["checkpoint"]
            try:
                model = LTX2VideoTransformer3DModel.from_pretrained(path, subfolder=sub, torch_dtype=dtype)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                raise RunError(
                    f"--checkpoint {path}: could not load an LTX-2 transformer: {type(exc).__name__}: {exc}"
                ) from None
            return model.to(device).eval().requires_grad_(False)
        if s["preset"] == "tiny":
            config = tiny_config(s["variant"], num_layers=s["layers"])
        else:
            config = full_config(s["layers"], s["variant"])
        # built directly on the device: the ltx2 preset has billions of parameters
        return build_model(config, device=device, dtype=dtype, seed=s["seed"])
    finally:
        dlogging.set_verbosity(verbosity)


def _is_ltx23(cfg) -> bool:
    return bool(cfg.cross_attn_mod or cfg.audio_cross_attn_mod or not cfg.use_prompt_embeddings)


def _audio_frames(cfg, frames: int) -> int:
    """Audio latent length for `frames` latent video frames, as LTX2Pipeline computes it."""
    pixel_frames = (frames - 1) * int(cfg.vae_scale_factors[0]) + 1
    per_second = cfg.audio_sampling_rate / cfg.audio_hop_length / float(cfg.audio_scale_factor)
    return max(1, round(pixel_frames / FPS * per_second))


def _make_inputs(model, s: dict) -> dict:
    """Seeded latents (fp32, as the pipeline keeps them), text embeddings, mask and RoPE coordinates."""
    cfg, device, dtype = model.config, s["device"], s["dtype"]
    frames, height, width = s["frames"], s["height"], s["width"]
    pt, ps = cfg.patch_size_t, cfg.patch_size
    video_tokens = math.ceil(frames / pt) * math.ceil(height / ps) * math.ceil(width / ps)
    audio_frames = _audio_frames(cfg, frames)
    audio_tokens = math.ceil(audio_frames / cfg.audio_patch_size_t)
    batch = 2 if s["cfg"] else 1
    gen = torch.Generator().manual_seed(s["seed"] + 1)  # CPU generator: same draws on every device
    video = torch.randn(1, video_tokens, cfg.in_channels, generator=gen)
    audio = torch.randn(1, audio_tokens, cfg.audio_in_channels, generator=gen)
    if cfg.use_prompt_embeddings:  # LTX-2.0: the model projects caption_channels itself
        text_dim = audio_text_dim = cfg.caption_channels
    else:  # LTX-2.3: the connectors (not run here) hand over per-modality widths
        text_dim = cfg.num_attention_heads * cfg.attention_head_dim
        audio_text_dim = cfg.audio_num_attention_heads * cfg.audio_attention_head_dim
    text = torch.randn(2, s["text_tokens"], text_dim, generator=gen)  # (uncond, cond)
    audio_text = torch.randn(2, s["text_tokens"], audio_text_dim, generator=gen)
    if not s["cfg"]:
        text, audio_text = text[1:], audio_text[1:]
    return dict(
        video=video.to(device),
        audio=audio.to(device),
        text=text.to(device, dtype),
        audio_text=audio_text.to(device, dtype),
        mask=torch.ones(batch, s["text_tokens"], device=device),
        video_coords=model.rope.prepare_video_coords(batch, frames, height, width, device, fps=FPS),
        audio_coords=model.audio_rope.prepare_audio_coords(batch, audio_frames, device),
        audio_frames=audio_frames,
        video_tokens=video_tokens,
        audio_tokens=audio_tokens,
        batch=batch,
        use_cross_timestep=_is_ltx23(cfg),  # LTX2Pipeline: True for 2.3, False is the legacy 2.0 behaviour
    )


def _calculate_shift(seq_len, base_seq_len, max_seq_len, base_shift, max_shift):
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return seq_len * m + (base_shift - m * base_seq_len)


def _schedulers(s: dict, video_tokens: int):
    """A fresh (video, audio) scheduler pair set for `steps` steps, as LTX2Pipeline sets them."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    c = sched.config
    mu = _calculate_shift(video_tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sigmas = np.linspace(1.0, 1 / s["steps"], s["steps"])
    audio_sched = copy.deepcopy(sched)
    for sc in (sched, audio_sched):
        sc.set_timesteps(sigmas=sigmas, mu=mu, device=s["device"])
        sc.set_begin_index(0)
    return sched, audio_sched


class _Loop:
    """The denoising loop of one mode: `step()` advances the latents by one scheduler step."""

    def __init__(self, model, inputs: dict, s: dict):
        self.model, self.x, self.s = model, inputs, s
        self.sched, self.audio_sched = _schedulers(s, inputs["video_tokens"])
        self.latents = inputs["video"].clone()
        self.audio_latents = inputs["audio"].clone()
        self.i = 0
        self.first_output = None  # the model's raw output at step 0 (model dtype)

    def step(self) -> None:
        x, s, i = self.x, self.s, self.i
        t = self.sched.timesteps[i]
        cfg = s["cfg"]
        dtype = s["dtype"]
        latents, audio_latents = self.latents, self.audio_latents
        video_in = (torch.cat([latents] * 2) if cfg else latents).to(dtype)
        audio_in = (torch.cat([audio_latents] * 2) if cfg else audio_latents).to(dtype)
        timestep = t.expand(video_in.shape[0])
        video_pred, audio_pred = self.model(
            hidden_states=video_in,
            audio_hidden_states=audio_in,
            encoder_hidden_states=x["text"],
            audio_encoder_hidden_states=x["audio_text"],
            timestep=timestep,
            sigma=timestep,
            encoder_attention_mask=x["mask"],
            audio_encoder_attention_mask=x["mask"],
            num_frames=s["frames"],
            height=s["height"],
            width=s["width"],
            fps=FPS,
            audio_num_frames=x["audio_frames"],
            video_coords=x["video_coords"],
            audio_coords=x["audio_coords"],
            use_cross_timestep=x["use_cross_timestep"],
            return_dict=False,
        )
        if i == 0:
            self.first_output = (video_pred.detach().clone(), audio_pred.detach().clone())
        video_pred, audio_pred = video_pred.float(), audio_pred.float()
        if cfg:
            video_pred = _guide(latents, video_pred, self.sched.sigmas[i], s["guidance_scale"])
            audio_pred = _guide(audio_latents, audio_pred, self.audio_sched.sigmas[i], s["audio_guidance_scale"])
        self.latents = self.sched.step(video_pred, t, latents, return_dict=False)[0]
        self.audio_latents = self.audio_sched.step(audio_pred, t, audio_latents, return_dict=False)[0]
        self.i += 1


def _guide(sample, pred, sigma, scale):
    """LTX2Pipeline's CFG: combine (uncond, cond) velocities in x0 space, back to a velocity."""
    uncond, cond = pred.chunk(2)
    x0_cond = sample - cond * sigma
    x0_uncond = sample - uncond * sigma
    x0 = x0_cond + (scale - 1) * (x0_cond - x0_uncond)
    return (sample - x0) / sigma


# ---------------------------------------------------------------- modes


def _enter_mode(mode: str, model):
    """Set `model` up for `mode`; return a function that undoes it."""
    if mode == "eager":
        return lambda: None
    if mode in ("lossless", "high", "graphs"):
        from . import accelerate

        kwargs = {"quality": "lossless" if mode == "graphs" else mode}
        if mode == "graphs":
            kwargs["cuda_graphs"] = True
        handle = accelerate(model, **kwargs)
        return handle.restore
    if mode == "compile":
        blocks = [m for m in model.modules() if type(m).__name__ in getattr(model, "_repeated_blocks", ())]
        if not blocks:
            raise RuntimeError("no repeated blocks to compile in this model")
        for b in blocks:
            b.compile()

        def restore():
            for b in blocks:
                b._compiled_call_impl = None  # what nn.Module.compile set

        return restore
    raise AssertionError(mode)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_OURS = ("FallbackWarning", "GraphCaptureWarning")  # bitfuse's own: collected into the report


def _run_mode(mode: str, model, inputs: dict, s: dict, progress: bool) -> dict:
    from . import policy

    from tqdm.auto import tqdm

    device = s["device"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = dict(mode=mode, error=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore = _enter_mode(mode, model)
        try:
            with torch.no_grad():
                warm = _Loop(model, inputs, s)
                _sync(device)
                t0 = time.perf_counter()
                warm.step()
                _sync(device)
                result["warmup_ms"] = (time.perf_counter() - t0) * 1e3
                warm_output = warm.first_output
                del warm

                loop = _Loop(model, inputs, s)
                times = []
                bar = tqdm(total=s["steps"], desc=f"{mode:>8}", unit="step", disable=not progress,
                           file=sys.stderr, leave=True, dynamic_ncols=True)
                with bar:
                    for _ in range(s["steps"]):
                        _sync(device)
                        t0 = time.perf_counter()
                        loop.step()
                        _sync(device)
                        times.append((time.perf_counter() - t0) * 1e3)
                        bar.update(1)
        finally:
            restore()
    # the gate's verdicts for this mode's tier ("exact" for lossless and graphs), reached here or by an
    # earlier mode of the same tier (a signature is verified once per process)
    gate_mode = {"lossless": "exact", "graphs": "exact", "high": "high"}.get(mode)
    new = [v for v in policy.verdicts() if v.mode == gate_mode]
    result.update(
        step_ms=times,
        median_step_ms=statistics.median(times),
        total_ms=sum(times),
        repeatable=all(torch.equal(a, b) for a, b in zip(warm_output, loop.first_output)),
        fast_paths=dict(
            verified=sum(v.status == "verified" for v in new),
            mismatch=sum(v.status == "mismatch" for v in new),
            error=sum(v.status == "error" for v in new),
        ),
        verdicts=[dict(op=v.op, mode=v.mode, signature=v.signature, status=v.status, device=v.device,
                       detail=v.detail) for v in new],
        warnings=sorted({str(w.message) for w in caught if w.category.__name__ in _OURS}),
    )
    for w in caught:  # hand every other warning on as it was
        if w.category.__name__ not in _OURS:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    result["_final"] = (loop.latents, loop.audio_latents)
    result["_first"] = loop.first_output
    return result


def _compare(result: dict, ref: dict) -> None:
    from .numerics import max_ulp, same_values

    (v, a), (rv, ra) = result["_final"], ref["_final"]
    result["video_equal"] = same_values(v, rv)
    result["audio_equal"] = same_values(a, ra)
    result["equal"] = result["video_equal"] and result["audio_equal"]
    result["max_ulp"] = max(max_ulp(v, rv), max_ulp(a, ra))  # final latents are fp32
    result["max_abs"] = max(float((v - rv).abs().max()), float((a - ra).abs().max()))
    (fv, fa), (rfv, rfa) = result["_first"], ref["_first"]
    result["step0_equal"] = same_values(fv, rfv) and same_values(fa, rfa)
    result["step0_max_ulp"] = max(max_ulp(fv, rfv), max_ulp(fa, rfa))  # model dtype
    result["speedup"] = ref["median_step_ms"] / result["median_step_ms"]


# ---------------------------------------------------------------- report


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "diffusers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    from . import __version__

    out["bitfuse"] = __version__
    return out


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _verdict_text(r: dict) -> str:
    if r.get("error"):
        return "failed: " + r["error"].splitlines()[0][:70]
    if r["mode"] == "eager":
        return "reference"
    if r["equal"]:
        return "bit-identical"
    return f"differs: max abs {r['max_abs']:.3g}, {r['max_ulp']} fp32 ULP; step 0 output {r['step0_max_ulp']} ULP"


def _fast_text(r: dict, cuda: bool) -> str:
    if r["mode"] in ("eager", "compile") or r.get("error"):
        return "-"
    f = r["fast_paths"]
    if not cuda:
        return "fallback (no GPU)"
    parts = [f"{f['verified']} verified"]
    if f["mismatch"]:
        parts.append(f"{f['mismatch']} mismatch")
    if f["error"]:
        parts.append(f"{f['error']} failed")
    return ", ".join(parts)


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


def format_report(report: dict) -> str:
    c = report["config"]
    cuda = c["device"].startswith("cuda")
    lines = [
        "",
        f"bitfuse run: {c['model']}, {_n(c['layers'], 'layer')}, {c['video_tokens']} video + {c['audio_tokens']} audio + "
        f"{c['text_tokens']} text tokens, batch {c['batch']} ({'CFG' if c['cfg'] else 'no CFG'}), {c['dtype']}, "
        f"{report['device_name']}",
        f"{_n(c['steps'], 'step')} of FlowMatchEulerDiscreteScheduler; each mode ran one untimed warm-up step first; "
        "times are CUDA-synchronized per step" if cuda else
        f"{_n(c['steps'], 'step')} of FlowMatchEulerDiscreteScheduler; each mode ran one untimed warm-up step first",
        "",
    ]
    header = ("mode", "step ms (median)", "total ms", "speedup", "fast paths", "final latents vs eager")
    rows = []
    for r in report["modes"]:
        if r.get("error"):
            rows.append((r["mode"], "-", "-", "-", "-", _verdict_text(r)))
            continue
        rows.append((
            r["mode"],
            f"{r['median_step_ms']:.2f}",
            f"{r['total_ms']:.1f}",
            f"{r.get('speedup', 1.0):.2f}x",
            _fast_text(r, cuda),
            _verdict_text(r),
        ))
    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
    fmt = lambda row: "  ".join(  # noqa: E731
        str(v).rjust(w) if i in (1, 2, 3) else str(v).ljust(w) for i, (v, w) in enumerate(zip(row, widths))
    ).rstrip()
    lines.append(fmt(header))
    lines.append(fmt(["-" * w for w in widths]))
    lines.extend(fmt(row) for row in rows)
    lines.append("")
    lines.extend(report["notes"])
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["modes"] if not r.get("error")]
    names = [r["mode"] for r in runs]
    values = [r["median_step_ms"] for r in runs]
    colors = ["#888888" if r["mode"] == "eager" else "#2a9d8f" if r.get("equal") else "#e9c46a" for r in runs]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(runs) + 2), 4.5))
    bars = ax.bar(names, values, color=colors)
    top = max(values) if values else 1.0
    for bar, r in zip(bars, runs):
        if r["mode"] == "eager":
            label = "reference"
        elif r.get("equal"):
            label = f"bit-identical\n{r['speedup']:.2f}x"
        else:
            label = f"not identical\nmax abs {r['max_abs']:.2g}\n{r['speedup']:.2f}x"
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01 * top, label,
                ha="center", va="bottom", fontsize=9)
    c = report["config"]
    ax.set_ylabel("ms per denoising step (median)")
    ax.set_ylim(0, top * 1.25)
    ax.set_title(f"{c['model']}, {c['layers']} layers, {c['video_tokens']}+{c['audio_tokens']} tokens, "
                 f"{c['dtype']}, {report['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main(args) -> int:
    try:
        return _main(args)
    except UsageError as exc:
        print(f"bitfuse run: error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"bitfuse run: error: {exc}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "out of memory"
        print(
            f"bitfuse run: error: CUDA out of memory ({first}). Try fewer --layers, or fewer tokens "
            "(smaller --frames/--height/--width or --text-tokens), or --no-cfg.",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("bitfuse run: interrupted", file=sys.stderr)
        return 130


def _main(args) -> int:
    s = _resolve(args)
    try:
        import diffusers
    except ImportError:
        raise RunError("bitfuse run needs diffusers, which is not installed: pip install bitfuse[diffusers]") from None
    if not hasattr(diffusers, "LTX2VideoTransformer3DModel"):
        raise RunError(
            f"bitfuse run needs diffusers with LTX-2 (>= 0.42), found {diffusers.__version__}: "
            "pip install -U bitfuse[diffusers]"
        )

    device = s["device"]
    cuda = device.type == "cuda"
    notes = []
    if not cuda:
        msg = ("no CUDA GPU: bitfuse's fast paths need one, so every mode takes the exact eager fallback here; "
               "the loop still runs in each mode and is checked against eager")
        print(f"bitfuse run: {msg}", file=sys.stderr)
        notes.append("Note: " + msg + ".")
        notes.append("Note: on a CPU every mode runs the same eager code, so time differences between modes are noise.")
    if cuda and device.index is not None:
        torch.cuda.set_device(device)

    model = _build_model(s)
    inputs = _make_inputs(model, s)
    cfg = model.config
    config = dict(
        preset=s["preset"] if s["checkpoint"] is None else None,
        model=("checkpoint " + s["checkpoint"][0]) if s["checkpoint"]
        else f"LTX-{s['variant']} {s['preset']} (random init)",
        variant=("2.3" if _is_ltx23(cfg) else "2.0"),
        checkpoint=s["checkpoint"][0] if s["checkpoint"] else None,
        layers=int(cfg.num_layers),
        video_dim=int(cfg.num_attention_heads * cfg.attention_head_dim),
        audio_dim=int(cfg.audio_num_attention_heads * cfg.audio_attention_head_dim),
        heads=int(cfg.num_attention_heads),
        audio_heads=int(cfg.audio_num_attention_heads),
        parameters=sum(p.numel() for p in model.parameters()),
        frames=s["frames"], height=s["height"], width=s["width"],
        video_tokens=inputs["video_tokens"], audio_tokens=inputs["audio_tokens"], text_tokens=s["text_tokens"],
        batch=inputs["batch"], cfg=s["cfg"], guidance_scale=s["guidance_scale"],
        audio_guidance_scale=s["audio_guidance_scale"], steps=s["steps"], seed=s["seed"],
        dtype=s["dtype_name"], device=str(device), modes=s["modes"],
        scheduler=dict(name="FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG),
        warmup="one untimed step per mode before the timed loop",
    )
    if s["checkpoint"] is not None and (args.layers is not None or args.preset != "tiny"):
        notes.append("Note: --checkpoint given; the model's own config was used (--preset/--layers ignored).")

    results = []
    ref = None
    failed = False
    for mode in s["modes"]:
        try:
            r = _run_mode(mode, model, inputs, s, progress=not args.no_progress)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if mode == "eager":
                raise RunError(f"the eager reference failed: {type(exc).__name__}: {exc}")
            r = dict(mode=mode, error=f"{type(exc).__name__}: {exc}")
            print(f"bitfuse run: mode {mode} failed: {r['error']}", file=sys.stderr)
            failed = True
        if mode == "eager":
            ref = r
            r.update(equal=True, speedup=1.0, max_ulp=0, max_abs=0.0, step0_equal=True, step0_max_ulp=0)
        elif not r.get("error"):
            _compare(r, ref)
        results.append(r)
        if cuda:
            torch.cuda.empty_cache()

    lossless_broken = [r["mode"] for r in results
                       if r["mode"] in ("lossless", "graphs") and not r.get("error") and not r["equal"]]
    if lossless_broken:
        notes.append(f"FAIL: {', '.join(lossless_broken)} did not reproduce eager's latents bit for bit.")
    if not ref["repeatable"]:
        notes.append("Note: eager itself was not repeatable here (its warm-up step and first timed step differ); "
                     "identity against it is not meaningful.")
    for r in results:
        for w in r.get("warnings", []):
            notes.append(f"{r['mode']}: {w}")
    if cuda:
        peaks = ", ".join(f"{r['mode']} {r['peak_memory_gib']:.1f}" for r in results if "peak_memory_gib" in r)
        notes.append(f"Peak GPU memory (GiB): {peaks}.")

    report = dict(
        config=config,
        device_name=_device_name(device),
        versions=_versions(),
        modes=[{k: v for k, v in r.items() if not k.startswith("_")} for r in results],
        notes=notes,
    )
    print(format_report(report))

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 1 if failed or lossless_broken else 0
