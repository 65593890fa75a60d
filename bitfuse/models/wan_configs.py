"""Wan model configurations and forward inputs, shared by tests and benchmarks.
Stable API: keep these names and arguments.

    from bitfuse.models.wan_configs import tiny_config, full_config, build_model, make_inputs

    model = build_model(full_config("2.1-14b", layers=4), device="cuda", dtype=torch.bfloat16)
    kwargs = make_inputs(model, batch=1, height=480, width=832, frames=81)
    (noise_pred,) = model(**kwargs)          # return_dict=False is set in kwargs

Configs are plain dicts of `WanTransformer3DModel` constructor keyword arguments.
Variants:

- "2.1-14b": Wan 2.1 T2V 14B (also the geometry of each of Wan 2.2 A14B's two
  experts): 40 heads x 128 = 5120, ffn 13824, 40 layers, text 4096, 16 latent
  channels; the VAE downsamples 8x spatially, 4x in time.
- "2.2-5b": Wan 2.2 TI2V 5B: 24 heads x 128 = 3072, ffn 14336, 30 layers, 48
  latent channels; its VAE downsamples 16x spatially. Its pipeline runs with
  `expand_timesteps`: a per-token timestep [B, S], so the blocks' `temb` is
  [B, S, 6, D] (per-token modulation).

`build_model` gives the dtypes `from_pretrained(torch_dtype=...)` gives: the
modules in `_keep_in_fp32_modules` (time_embedder, scale_shift_table, norm1/2/3)
stay fp32 and the RoPE tables (non-persistent buffers, fp32) stay fp32, so the
blocks compute their adaLN and RoPE in fp32 on bf16 activations, as deployed.

Only diffusers is needed to build a model; it is imported lazily.
"""

from __future__ import annotations

import torch

__all__ = ["VARIANTS", "tiny_config", "full_config", "build_model", "video_tokens", "latent_shape", "make_inputs"]

VARIANTS = ("2.1-14b", "2.2-5b")

#: (spatial, temporal) downsampling of each variant's VAE
VAE_SCALE = {"2.1-14b": (8, 4), "2.2-5b": (16, 4)}


def _check(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown Wan variant {variant!r}; choose one of {', '.join(VARIANTS)}")


def tiny_config(variant: str = "2.1-14b", **overrides) -> dict:
    """A random-init model small enough for CPU tests: 2 layers, 2 heads x 24 (inner 48:
    RoPE axes 8 + 8 + 8), ffn 96, text width 32; the variant's channel count scaled
    down (16 or 48 -> 4 or 12)."""
    _check(variant)
    cfg = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=24,
        in_channels=4 if variant == "2.1-14b" else 12,
        out_channels=4 if variant == "2.1-14b" else 12,
        text_dim=32,
        freq_dim=32,
        ffn_dim=96,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=64,
    )
    cfg.update(overrides)
    return cfg


def full_config(variant: str = "2.1-14b", layers: int | None = None, **overrides) -> dict:
    """The released width of `variant` with `layers` blocks (default: the released depth)."""
    _check(variant)
    if variant == "2.1-14b":
        cfg = dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16, out_channels=16)
    else:
        cfg = dict(num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48)
    cfg.update(
        patch_size=(1, 2, 2),
        attention_head_dim=128,
        text_dim=4096,
        freq_dim=256,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    if layers is not None:
        cfg["num_layers"] = layers
    cfg.update(overrides)
    return cfg


def build_model(config: dict, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random-init `WanTransformer3DModel` in eval mode, built on `device`, with the
    dtypes `from_pretrained(torch_dtype=dtype)` gives: every parameter in `dtype`
    except those of `_keep_in_fp32_modules` (matched on the parameter name's parts, as
    diffusers' loader matches them), which stay fp32; buffers (the fp32 RoPE tables)
    as built."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    keep = tuple(model._keep_in_fp32_modules or ())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not any(k in name.split(".") for k in keep):
                p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def latent_shape(variant: str, height: int, width: int, frames: int) -> tuple[int, int, int]:
    """(latent frames, latent height, latent width) of a height x width x frames video."""
    _check(variant)
    spatial, temporal = VAE_SCALE[variant]
    return (frames - 1) // temporal + 1, height // spatial, width // spatial


def video_tokens(variant: str, height: int, width: int, frames: int) -> int:
    """Transformer tokens of a video (patches of 1 x 2 x 2 latents): 32,760 for Wan 2.1
    at 832 x 480, 81 frames; 27,280 for Wan 2.2 5B at 1280 x 704, 121 frames."""
    f, h, w = latent_shape(variant, height, width, frames)
    return f * (h // 2) * (w // 2)


def make_inputs(
    model,
    batch: int = 1,
    height: int = 480,
    width: int = 832,
    frames: int = 81,
    *,
    variant: str | None = None,
    text_tokens: int = 512,
    per_token_timestep: bool | None = None,
    timestep: float | None = None,
    seed: int = 0,
    device=None,
    dtype=None,
) -> dict:
    """Keyword arguments for `model(**kwargs)` as diffusers' WanPipeline passes them
    (`return_dict=False`; the conditional and unconditional passes are separate calls).

    height, width, frames: the video in pixels and frames; `hidden_states` is the
        latent [B, in_channels, latent frames, latent height, latent width] in `dtype`.
    variant: picks the VAE's downsampling (default: "2.2-5b" for 48 input channels,
        else "2.1-14b").
    text_tokens: the padded prompt length (WanPipeline pads to max_sequence_length,
        512): `encoder_hidden_states` [B, text_tokens, text_dim] in `dtype`.
    per_token_timestep: the pipeline's `expand_timesteps` (Wan 2.2 TI2V): `timestep`
        [B, S] fp32, the scheduler's t on every token (`mask[0][0][:, ::2, ::2] * t`,
        flattened, expanded); else `t.expand(B)`. Default: True for "2.2-5b".
    timestep: the scheduler's t (default: drawn from `seed` in [50, 950]).
    device/dtype: default to the model's (its first bf16/fp16 parameter's dtype).
    """
    params = list(model.parameters())
    device = params[0].device if device is None else torch.device(device)
    if dtype is None:
        dtype = next((p.dtype for p in params if p.dtype in (torch.bfloat16, torch.float16)), params[0].dtype)
    cfg = model.config
    if variant is None:
        variant = "2.2-5b" if cfg.in_channels == 48 else "2.1-14b"
    if per_token_timestep is None:
        per_token_timestep = variant == "2.2-5b"
    f, h, w = latent_shape(variant, height, width, frames)
    if f < 1 or h < 2 or w < 2:
        raise ValueError(f"video too small for {variant}: {height} x {width} x {frames}")
    gen = torch.Generator("cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    latents = randn(batch, cfg.in_channels, f, h, w)
    prompt = randn(batch, text_tokens, cfg.text_dim)
    if timestep is None:
        timestep = float(torch.rand((), generator=gen)) * 900 + 50
    t = torch.tensor(float(timestep), dtype=torch.float32, device=device)
    if per_token_timestep:
        mask = torch.ones(latents.shape, dtype=torch.float32, device=device)
        temp_ts = (mask[0][0][:, ::2, ::2] * t).flatten()
        ts = temp_ts.unsqueeze(0).expand(batch, -1)
    else:
        ts = t.expand(batch)
    return dict(hidden_states=latents, timestep=ts, encoder_hidden_states=prompt, attention_kwargs=None,
                return_dict=False)
