"""FLUX.1 model configurations and forward inputs, shared by tests and benchmarks.
Stable API: keep these names and arguments (`flux2_configs` mirrors them).

    from bitfuse.models.flux_configs import tiny_config, full_config, build_model, make_inputs

    model = build_model(full_config(2, 2), device="cuda", dtype=torch.bfloat16, seed=0)
    kwargs = make_inputs(model, batch=1, height=1024, width=1024)   # 4,096 image + 512 text tokens
    (sample,) = model(**kwargs)             # return_dict=False is set in kwargs

Configs are plain dicts of `FluxTransformer2DModel` constructor keyword arguments.
Variants: "dev" (guidance-distilled: a guidance embedding, `guidance` passed) and
"schnell" (no guidance embedding). diffusers is imported lazily.
"""

from __future__ import annotations

import torch

__all__ = ["VARIANTS", "tiny_config", "full_config", "build_model", "image_ids", "make_inputs"]

VARIANTS = ("dev", "schnell")

#: the VAE's spatial compression (8) times the 2 x 2 packing of latents into tokens
PIXELS_PER_TOKEN = 16


def _guidance(variant: str) -> bool:
    if variant not in VARIANTS:
        raise ValueError(f"unknown FLUX.1 variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return variant == "dev"


def tiny_config(variant: str = "dev", **overrides) -> dict:
    """A random-init model small enough for CPU tests: 2 double + 2 single blocks,
    2 heads x 16 (inner 32); RoPE axes (4, 6, 6) sum to the head dim."""
    cfg = dict(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        pooled_projection_dim=16,
        guidance_embeds=_guidance(variant),
        axes_dims_rope=(4, 6, 6),
    )
    cfg.update(overrides)
    return cfg


def full_config(double: int = 19, single: int = 38, variant: str = "dev", **overrides) -> dict:
    """Production width (FLUX.1-dev / -schnell: 24 heads x 128 = 3072, T5 4096, CLIP
    pooled 768, 64 latent channels), with `double` dual-stream and `single`
    single-stream blocks (the released models: 19 and 38)."""
    cfg = dict(
        patch_size=1,
        in_channels=64,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=_guidance(variant),
        axes_dims_rope=(16, 56, 56),
    )
    cfg.update(overrides)
    return cfg


def build_model(config: dict, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random-init `FluxTransformer2DModel` in eval mode, built directly on `device`."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = FluxTransformer2DModel(**config)
    # nn.Module.to, not ModelMixin.to: the latter warns about casting without from_pretrained
    return torch.nn.Module.to(model, dtype=dtype).eval().requires_grad_(False)


def image_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """[height * width, 3] RoPE coordinates (0, row, column) of a packed latent grid,
    as `FluxPipeline._prepare_latent_image_ids` builds them."""
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(width)[None, :]
    return ids.reshape(height * width, 3).to(device=device, dtype=dtype)


def make_inputs(
    model,
    batch: int = 1,
    height: int = 1024,
    width: int = 1024,
    text_tokens: int = 512,
    seed: int = 0,
    device=None,
    dtype=None,
    *,
    t: float | None = None,
    per_sample_t: bool = False,
    guidance_scale: float = 3.5,
) -> dict:
    """Keyword arguments for `model(**kwargs)` (with `return_dict=False`), as
    `FluxPipeline.__call__` passes them for an image of `height` x `width` pixels:
    (height / 16) x (width / 16) image tokens (1024 x 1024: 4,096) and `text_tokens`
    T5 tokens (the pipeline's max_sequence_length, 512 by default).

    hidden_states [B, S, in_channels], encoder_hidden_states [B, text, joint_attention_dim],
    pooled_projections [B, pooled_projection_dim], txt_ids [text, 3] (zeros),
    img_ids [S, 3]: all of the model's dtype (`dtype`). timestep [B] of that dtype:
    the scheduler's t in [0, 1000] expanded over the batch, cast, then divided by
    1000 (`t`: None draws one); `per_sample_t` draws one t per sample instead (a
    batch of requests at different steps). guidance [B] fp32, the pipeline's
    expanded view, for a model with a guidance embedding (else None)."""
    p = next(model.parameters())
    device = p.device if device is None else torch.device(device)
    dtype = p.dtype if dtype is None else dtype
    cfg = model.config
    if height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN:
        raise ValueError(f"height and width must be multiples of {PIXELS_PER_TOKEN}, got {height} x {width}")
    rows, cols = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    gen = torch.Generator("cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if per_sample_t:
        timestep = torch.rand(batch, generator=gen) * 1000
    else:
        timestep = torch.tensor(float(torch.rand(1, generator=gen)) * 1000 if t is None else t).expand(batch)
    kwargs = dict(
        hidden_states=randn(batch, rows * cols, cfg.in_channels),
        encoder_hidden_states=randn(batch, text_tokens, cfg.joint_attention_dim),
        pooled_projections=randn(batch, cfg.pooled_projection_dim),
        timestep=timestep.to(device=device, dtype=dtype) / 1000,
        img_ids=image_ids(rows, cols, device, dtype),
        txt_ids=torch.zeros(text_tokens, 3).to(device=device, dtype=dtype),
        guidance=None,
        return_dict=False,
    )
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full([1], guidance_scale, device=device, dtype=torch.float32).expand(batch)
    return kwargs
