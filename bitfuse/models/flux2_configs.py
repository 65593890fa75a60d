"""FLUX.2 model configurations and forward inputs, shared by tests and benchmarks.
The API of `flux_configs` (keep these names and arguments):

    from bitfuse.models.flux2_configs import tiny_config, full_config, build_model, make_inputs

    model = build_model(full_config(2, 2), device="cuda", dtype=torch.bfloat16, seed=0)
    kwargs = make_inputs(model, batch=1, height=1024, width=1024)   # 4,096 image + 512 text tokens
    (sample,) = model(**kwargs)             # return_dict=False is set in kwargs

Configs are plain dicts of `Flux2Transformer2DModel` constructor keyword arguments;
the full one is FLUX.2-dev (diffusers' defaults). diffusers is imported lazily.
"""

from __future__ import annotations

import torch

__all__ = ["tiny_config", "full_config", "build_model", "use_kv_processors", "make_inputs"]

#: the VAE's spatial compression (8) times the 2 x 2 packing of latents into tokens
PIXELS_PER_TOKEN = 16


def tiny_config(**overrides) -> dict:
    """A random-init model small enough for CPU tests: 2 double + 2 single blocks,
    2 heads x 16 (inner 32); RoPE axes (4, 4, 4, 4) sum to the head dim."""
    cfg = dict(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    )
    cfg.update(overrides)
    return cfg


def full_config(double: int = 8, single: int = 48, **overrides) -> dict:
    """Production width (FLUX.2-dev: 48 heads x 128 = 6144, Mistral text features
    15360, 128 latent channels, guidance embedding), with `double` dual-stream and
    `single` single-stream blocks (the released model: 8 and 48)."""
    cfg = dict(
        patch_size=1,
        in_channels=128,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=128,
        num_attention_heads=48,
        joint_attention_dim=15360,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32),
        rope_theta=2000,
        eps=1e-6,
        guidance_embeds=True,
    )
    cfg.update(overrides)
    return cfg


def build_model(config: dict, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random-init `Flux2Transformer2DModel` in eval mode, built directly on `device`
    in `dtype` (a floating dtype)."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype`: FLUX.2-dev's 32B parameters take 128 GB in fp32
    try:
        with torch.device(device):
            model = Flux2Transformer2DModel(**config)
    finally:
        torch.set_default_dtype(previous)
    # nn.Module.to, not ModelMixin.to: the latter warns about casting without from_pretrained
    return torch.nn.Module.to(model, dtype=dtype).eval().requires_grad_(False)


def use_kv_processors(model) -> None:
    """Give every block the KV-cache attention processors, as `Flux2KleinKVPipeline` does
    (needed for `make_inputs(..., ref_tokens=n)`)."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


def _ids(t: int, height: int, width: int, length: int) -> torch.Tensor:
    """[t * height * width * length, 4] int64 (T, H, W, L) coordinates, as the pipeline's
    `torch.cartesian_prod` of four ranges."""
    return torch.cartesian_prod(torch.arange(t), torch.arange(height), torch.arange(width), torch.arange(length))


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
    guidance_scale: float | None = 4.0,
    ref_tokens: int = 0,
) -> dict:
    """Keyword arguments for `model(**kwargs)` (with `return_dict=False`), as
    `Flux2Pipeline.__call__` passes them for an image of `height` x `width` pixels:
    (height / 16) x (width / 16) image tokens (1024 x 1024: 4,096) and `text_tokens`
    text tokens (the pipeline's max_sequence_length, 512 by default).

    hidden_states [B, S, in_channels] and encoder_hidden_states [B, text,
    joint_attention_dim] of the model's dtype (`dtype`); img_ids [B, S, 4] (the
    pipeline's expanded view) and txt_ids [B, text, 4], int64. timestep [B]: the
    scheduler's t in [0, 1000] expanded over the batch, cast, divided by 1000 (`t`:
    None draws one; `per_sample_t`: one per sample). guidance [B] fp32, the
    pipeline's expanded view (`guidance_scale` None: no guidance, as the Klein
    pipelines pass).

    ref_tokens: prepend that many reference-image tokens and run KV-extract mode as
    `Flux2KleinKVPipeline` does on its first step (`kv_cache_mode="extract"`; the
    model then modulates per token and returns `(sample, kv_cache)`); the model
    needs `use_kv_processors`."""
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
    img_ids = _ids(1, rows, cols, 1).unsqueeze(0).expand(batch, -1, -1)
    hidden_states = randn(batch, rows * cols, cfg.in_channels)
    kwargs = dict(
        hidden_states=hidden_states,
        encoder_hidden_states=randn(batch, text_tokens, cfg.joint_attention_dim),
        timestep=timestep.to(device=device, dtype=dtype) / 1000,
        img_ids=img_ids.to(device),
        txt_ids=_ids(1, 1, 1, text_tokens).unsqueeze(0).repeat(batch, 1, 1).to(device),
        guidance=None,
        return_dict=False,
    )
    if guidance_scale is not None:
        kwargs["guidance"] = torch.full([1], guidance_scale, device=device, dtype=torch.float32).expand(batch)
    if ref_tokens:
        # one reference image of ref_tokens tokens in a row, at time coordinate 10 (the pipeline's
        # `_prepare_image_ids` scale), ahead of the image tokens
        ref_ids = _ids(1, 1, ref_tokens, 1)
        ref_ids[:, 0] = 10
        kwargs["hidden_states"] = torch.cat([randn(batch, ref_tokens, cfg.in_channels), hidden_states], dim=1)
        kwargs["img_ids"] = torch.cat([ref_ids.unsqueeze(0).expand(batch, -1, -1), img_ids], dim=1).to(device)
        kwargs.update(kv_cache_mode="extract", num_ref_tokens=ref_tokens)
    return kwargs
