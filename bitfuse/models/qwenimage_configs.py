"""Qwen-Image model configurations and forward inputs, shared by tests and
benchmarks. Stable API: keep these names and arguments.

    from bitfuse.models.qwenimage_configs import tiny_config, full_config, build_model, make_inputs

    model = build_model(full_config(layers=4), device="cuda", dtype=torch.bfloat16, seed=0)
    kwargs = make_inputs(model, batch=1, height=1328, width=1328, text_tokens=128)
    (noise_pred,) = model(**kwargs)          # return_dict=False is set in kwargs

Configs are plain dicts of `QwenImageTransformer2DModel` constructor keyword
arguments. Variants:

- "image": Qwen-Image as released (diffusers' defaults; the Qwen-Image-Edit and
  Edit-2509 transformers have the same configuration).
- "edit-2511": Qwen-Image-Edit-2511: `zero_cond_t=True`. The forward doubles the
  timestep batch to [t, 0] and passes a per-token `modulate_index` to every block:
  the generated image's tokens are modulated by the rows of t, the condition
  images' tokens by the rows of 0 (a `torch.where` per parameter).

Only diffusers is needed to build a model; this module imports it lazily, so
importing it costs nothing where diffusers is absent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["VARIANTS", "VAE_SCALE", "tiny_config", "full_config", "build_model", "image_tokens", "make_inputs"]

VARIANTS = ("image", "edit-2511")

#: pixels per latent token side: the VAE downsamples 8x, the transformer's 2x2 patches 2x more
VAE_SCALE = 16


def _variant_flags(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen-Image variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return {"zero_cond_t": True} if variant == "edit-2511" else {}


def tiny_config(variant: str = "image", **overrides) -> dict:
    """A random-init model small enough for CPU tests: 2 layers, 4 heads x 16 (inner 64),
    text width 32, RoPE axes (4, 6, 6) (they must sum to the head width)."""
    cfg = dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    cfg.update(_variant_flags(variant))
    cfg.update(overrides)
    return cfg


def full_config(layers: int = 60, variant: str = "image", **overrides) -> dict:
    """Qwen-Image's released width (the 20B model: 24 heads x 128 = 3072, text width
    3584 from Qwen2.5-VL-7B, 64 input channels = 16 latent channels x 2 x 2 patches,
    RoPE axes (16, 56, 56)), with `layers` transformer blocks (the released model has 60)."""
    cfg = dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=layers,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    )
    cfg.update(_variant_flags(variant))
    cfg.update(overrides)
    return cfg


def build_model(config: dict, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random-init `QwenImageTransformer2DModel` in eval mode, built directly on
    `device` (no CPU round trip for full-width models). Its RoPE tables (complex64,
    not buffers) stay complex64, as `from_pretrained` leaves them."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = QwenImageTransformer2DModel(**config)
    # nn.Module.to, not ModelMixin.to: the latter warns about casting without from_pretrained
    return torch.nn.Module.to(model, dtype=dtype).eval().requires_grad_(False)


def image_tokens(height: int, width: int) -> int:
    """Transformer tokens of a height x width (pixels) image: 6889 at 1328 x 1328."""
    return (height // VAE_SCALE) * (width // VAE_SCALE)


def make_inputs(
    model,
    batch: int = 1,
    height: int = 1328,
    width: int = 1328,
    text_tokens: int = 128,
    *,
    seed: int = 0,
    device=None,
    dtype=None,
    timestep: float | None = None,
    text_lengths: Sequence[int] | None = None,
    condition_images: Sequence[tuple[int, int]] = (),
) -> dict:
    """Keyword arguments for `model(**kwargs)` as diffusers' Qwen-Image pipelines pass
    them (`return_dict=False`). The pipelines run the conditional and the
    unconditional (true CFG) passes as separate calls of batch 1.

    height, width: the generated image in pixels; its latent is packed into
        (height // 16) x (width // 16) tokens of `in_channels` (QwenImagePipeline):
        `hidden_states` [B, tokens, in_channels], `img_shapes` [[(1, height // 16, width // 16)]] * B.
    text_tokens: the prompt embedding length (Qwen2.5-VL hidden states after the
        pipeline drops the template's first 34 tokens): `encoder_hidden_states`
        [B, text_tokens, joint_attention_dim].
    text_lengths: per-sample prompt lengths for a batch of prompts of different
        lengths: embeddings zero-padded past each length and an int64 0/1
        `encoder_hidden_states_mask` [B, text_tokens]; the mask is None when every
        length is text_tokens (the pipeline drops an all-ones mask).
    condition_images: (height, width) pixel sizes of the edit pipelines' VAE-encoded
        condition images (QwenImageEditPlusPipeline: about 1024 x 1024 each); their
        tokens follow the generated image's in `hidden_states`, and `img_shapes`
        lists each. With "edit-2511" they take the timestep-0 modulation.
    timestep: the scheduler's t in [0, 1000] (default: drawn from `seed`); passed as
        the pipeline passes it, `t.expand(B).to(dtype) / 1000`, guidance None.
    device/dtype: default to the model's; the latents and embeddings take dtype.
    `additional_t_cond` (zeros, "is RGB") is passed when the model takes it.
    """
    p = next(model.parameters())
    device = p.device if device is None else torch.device(device)
    dtype = p.dtype if dtype is None else dtype
    cfg = model.config
    gen = torch.Generator("cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    shapes = [(1, height // VAE_SCALE, width // VAE_SCALE)]
    shapes += [(1, h // VAE_SCALE, w // VAE_SCALE) for h, w in condition_images]
    if any(n == 0 for shape in shapes for n in shape):
        raise ValueError(f"images of at least {VAE_SCALE} x {VAE_SCALE} pixels, got {height} x {width} "
                         f"and conditions {list(condition_images)}")
    tokens = sum(f * h * w for f, h, w in shapes)

    prompt = randn(batch, text_tokens, cfg.joint_attention_dim)
    mask = None
    if text_lengths is not None:
        lengths = list(text_lengths)
        if len(lengths) != batch or not all(1 <= n <= text_tokens for n in lengths):
            raise ValueError(f"text_lengths: {batch} lengths in [1, {text_tokens}], got {lengths}")
        valid = torch.arange(text_tokens)[None, :] < torch.tensor(lengths)[:, None]  # [B, text_tokens]
        prompt = prompt.masked_fill(~valid[..., None].to(device), 0.0)  # +0.0 padding, as the pipeline pads
        if not valid.all():
            mask = valid.to(device=device, dtype=torch.long)

    if timestep is None:
        timestep = float(torch.rand((), generator=gen)) * 900 + 50
    t = torch.full((batch,), float(timestep), device=device)  # the scheduler's fp32 timestep

    kwargs = dict(
        hidden_states=randn(batch, tokens, cfg.in_channels),
        timestep=t.to(dtype) / 1000,
        guidance=None,
        encoder_hidden_states_mask=mask,
        encoder_hidden_states=prompt,
        img_shapes=[shapes] * batch,
        attention_kwargs={},
        return_dict=False,
    )
    if cfg.use_additional_t_cond:
        kwargs["additional_t_cond"] = torch.zeros(batch, dtype=torch.long, device=device)
    return kwargs
