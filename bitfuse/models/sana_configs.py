"""Sana model configurations and forward inputs, shared by tests and benchmarks.
Stable API: keep these names and arguments.

    from bitfuse.models.sana_configs import tiny_config, full_config, build_model, make_inputs

    model = build_model(full_config(layers=4), device="cuda", dtype=torch.bfloat16, seed=0)
    kwargs = make_inputs(model, batch=2, height=1024, width=1024, text_tokens=300)
    (noise_pred,) = model(**kwargs)          # return_dict=False is set in kwargs

Configs are plain dicts of `SanaTransformer2DModel` constructor keyword arguments.
Variants (the 1.6B width: 20 layers, 70 heads x 32 = 2240, cross-attention 20 x 112,
mlp_ratio 2.5, 32 latent channels, patch 1, Gemma-2 captions of 2304 channels):

- "1.0": Sana 1.0 1.6B (Sana_1600M_1024px; diffusers' defaults).
- "1.5": SANA 1.5 1.6B: the same width with `qk_norm="rms_norm_across_heads"` (a
  weighted RMSNorm over all heads of the queries and keys of both attentions, as
  diffusers' conversion script sets it for the SANA 1.5 checkpoints).

`build_model` also names `SanaTransformerBlock` in the instance's `_repeated_blocks`
(diffusers' class leaves it empty), so that `compile_repeated_blocks` and the
benchmark's regional-compile mode compile the blocks, as a user regionally compiling
Sana would.

Only diffusers is needed to build a model; this module imports it lazily, so
importing it costs nothing where diffusers is absent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["VAE_SCALE", "VARIANTS", "build_model", "full_config", "image_tokens", "make_inputs", "tiny_config"]

VARIANTS = ("1.0", "1.5")

#: pixels per latent token side: the DC-AE downsamples 32x, the transformer's patches are 1x1
VAE_SCALE = 32


def _variant_flags(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown Sana variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return {"qk_norm": "rms_norm_across_heads"} if variant == "1.5" else {}


def tiny_config(variant: str = "1.0", **overrides) -> dict:
    """A random-init model small enough for CPU tests: 2 layers, 2 heads x 8 (inner 16),
    cross-attention 2 x 8, captions of 24 channels, 8 latent channels; mlp_ratio 2.5
    (the feed-forward's convolutions: 16 -> 80 -> 80 depthwise -> 40 -> 16 channels)."""
    cfg = {
        "in_channels": 8,
        "out_channels": 8,
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "num_layers": 2,
        "num_cross_attention_heads": 2,
        "cross_attention_head_dim": 8,
        "cross_attention_dim": 16,
        "caption_channels": 24,
        "mlp_ratio": 2.5,
        "sample_size": 8,
        "patch_size": 1,
    }
    cfg.update(_variant_flags(variant))
    cfg.update(overrides)
    return cfg


def full_config(layers: int = 20, variant: str = "1.0", **overrides) -> dict:
    """Sana 1.6B's released width (`Sana_1600M_1024px`: 70 heads x 32 = 2240, cross-attention
    20 heads x 112, captions 2304 (Gemma-2 2B), mlp_ratio 2.5, 32 latent channels, patch 1,
    no positional embedding at 1024 px), with `layers` transformer blocks (the released
    model has 20)."""
    cfg = {
        "in_channels": 32,
        "out_channels": 32,
        "num_attention_heads": 70,
        "attention_head_dim": 32,
        "num_layers": layers,
        "num_cross_attention_heads": 20,
        "cross_attention_head_dim": 112,
        "cross_attention_dim": 2240,
        "caption_channels": 2304,
        "mlp_ratio": 2.5,
        "attention_bias": False,
        "sample_size": 32,
        "patch_size": 1,
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
        "interpolation_scale": None,
    }
    cfg.update(_variant_flags(variant))
    cfg.update(overrides)
    return cfg


def build_model(config: dict, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random-init `SanaTransformer2DModel` in eval mode, built directly on `device`,
    its blocks named in `_repeated_blocks` (regional compile)."""
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = SanaTransformer2DModel(**config)
    model._repeated_blocks = ["SanaTransformerBlock"]  # diffusers leaves Sana's empty
    # nn.Module.to, not ModelMixin.to: the latter warns about casting without from_pretrained
    return torch.nn.Module.to(model, dtype=dtype).eval().requires_grad_(False)


def image_tokens(height: int, width: int) -> int:
    """Transformer tokens of a height x width (pixels) image: 1024 at 1024 x 1024."""
    return (height // VAE_SCALE) * (width // VAE_SCALE)


def make_inputs(
    model,
    batch: int = 2,
    height: int = 1024,
    width: int = 1024,
    text_tokens: int = 300,
    *,
    seed: int = 0,
    device=None,
    dtype=None,
    timestep: float | None = None,
    text_lengths: Sequence[int] | None = None,
) -> dict:
    """Keyword arguments for `model(**kwargs)` as diffusers' SanaPipeline passes them
    (`return_dict=False`); with guidance, the pipeline batches the negative and the
    positive prompt: batch 2 per image.

    height, width: the image in pixels; the latent is [B, in_channels, height // 32,
        width // 32] (`hidden_states`), one token per latent pixel.
    text_tokens: the prompt length after the pipeline's padding to `max_sequence_length`
        (300): `encoder_hidden_states` [B, text_tokens, caption_channels] (Gemma-2's last
        hidden states).
    text_lengths: per-sample prompt lengths: the tokenizer's 0/1 attention mask
        `encoder_attention_mask` [B, text_tokens] (int64; the pipeline always passes one),
        embeddings kept past the length as the pipeline keeps them (Gemma's states of the
        padding tokens); None: every token valid.
    timestep: the scheduler's t (default: drawn from `seed`), passed as the pipeline
        passes it: `t.expand(B) * timestep_scale`, fp32.
    device/dtype: default to the model's; the latents and embeddings take dtype.
    """
    p = next(model.parameters())
    device = p.device if device is None else torch.device(device)
    dtype = p.dtype if dtype is None else dtype
    cfg = model.config
    gen = torch.Generator("cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    h, w = height // VAE_SCALE, width // VAE_SCALE
    if h == 0 or w == 0:
        raise ValueError(f"images of at least {VAE_SCALE} x {VAE_SCALE} pixels, got {height} x {width}")
    lengths = [text_tokens] * batch if text_lengths is None else list(text_lengths)
    if len(lengths) != batch or not all(1 <= n <= text_tokens for n in lengths):
        raise ValueError(f"text_lengths: {batch} lengths in [1, {text_tokens}], got {lengths}")
    mask = (torch.arange(text_tokens)[None, :] < torch.tensor(lengths)[:, None]).to(device=device, dtype=torch.long)

    if timestep is None:
        timestep = float(torch.rand((), generator=gen)) * 900 + 50
    t = torch.full((batch,), float(timestep), device=device) * cfg.timestep_scale

    return {
        "hidden_states": randn(batch, cfg.in_channels, h, w),
        "encoder_hidden_states": randn(batch, text_tokens, cfg.caption_channels),
        "encoder_attention_mask": mask,
        "timestep": t,
        "attention_kwargs": None,
        "return_dict": False,
    }
