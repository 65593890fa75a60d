"""LTX-2 model configurations and forward inputs, shared by tests, benchmarks
and the `bitfuse run` loop. Stable API: keep these names and arguments.

    from bitfuse.models.ltx2_configs import tiny_config, full_config, build_model, make_inputs

    model = build_model(tiny_config("2.3"), device="cpu", dtype=torch.float32, seed=0)
    kwargs = make_inputs(model, batch=2, per_token=True)
    video, audio = model(**kwargs)          # return_dict=False is set in kwargs

Configs are plain dicts of `LTX2VideoTransformer3DModel` constructor keyword
arguments. Variants:

- "2.0": LTX-2.0 (diffusers' defaults): caption projection in the model,
  interleaved RoPE, no gated attention, no prompt (K/V) modulation.
- "2.3": LTX-2.3 flags: gated attention (video and audio), prompt
  cross-attention modulation (`cross_attn_mod`, `audio_cross_attn_mod`; the
  text K/V modulated by a sigma-dependent `prompt_adaln`), perturbed attention
  (spatio-temporal guidance), split RoPE, no caption projection in the model.

Only diffusers is needed to build a model; this module imports it lazily, so
importing it costs nothing where diffusers is absent.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "VARIANTS",
    "tiny_config",
    "full_config",
    "build_model",
    "make_inputs",
    "video_token_count",
]

VARIANTS = ("2.0", "2.3")

_LTX23_FLAGS = dict(
    gated_attn=True,
    audio_gated_attn=True,
    cross_attn_mod=True,
    audio_cross_attn_mod=True,
    perturbed_attn=True,
    use_prompt_embeddings=False,
    rope_type="split",
)


def _variant_flags(variant: str) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown LTX-2 variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return dict(_LTX23_FLAGS) if variant == "2.3" else {}


def tiny_config(variant: str = "2.0", **overrides) -> dict:
    """A random-init model small enough for CPU tests: 2 layers, video 4 heads x 16
    (inner 64), audio 4 heads x 8 (inner 32). The constraints diffusers relies on
    without checking: `cross_attention_dim` = video inner dim, `audio_cross_attention_dim`
    = audio inner dim (it is also the a2v/v2a RoPE width), and for split RoPE the
    video and audio head counts equal (the cross-attention RoPE reshapes by the
    video head count but is used by audio-headed attention)."""
    cfg = dict(
        in_channels=8,
        out_channels=8,
        num_attention_heads=4,
        attention_head_dim=16,
        cross_attention_dim=64,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=4,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=32,
        caption_channels=24,
        num_layers=2,
    )
    cfg.update(_variant_flags(variant))
    cfg.update(overrides)
    return cfg


def full_config(layers: int = 4, variant: str = "2.0", **overrides) -> dict:
    """Production width (video 32 x 128 = 4096, audio 32 x 64 = 2048, caption 3840),
    with `layers` transformer blocks (the released model has 48)."""
    cfg = dict(
        in_channels=128,
        out_channels=128,
        num_attention_heads=32,
        attention_head_dim=128,
        cross_attention_dim=4096,
        audio_in_channels=128,
        audio_out_channels=128,
        audio_num_attention_heads=32,
        audio_attention_head_dim=64,
        audio_cross_attention_dim=2048,
        caption_channels=3840,
        num_layers=layers,
    )
    cfg.update(_variant_flags(variant))
    cfg.update(overrides)
    return cfg


def build_model(config: dict, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A random-init `LTX2VideoTransformer3DModel` in eval mode, built directly on
    `device` (no CPU round trip for full-width models)."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = LTX2VideoTransformer3DModel(**config)
    # nn.Module.to, not ModelMixin.to: the latter warns about casting without from_pretrained
    return torch.nn.Module.to(model, dtype=dtype).eval().requires_grad_(False)


def video_token_count(video_tokens_shape) -> int:
    return math.prod(video_tokens_shape)


def make_inputs(
    model,
    batch: int = 1,
    video_tokens_shape: tuple[int, int, int] = (2, 4, 4),
    audio_tokens: int = 6,
    text_tokens: int = 5,
    per_token: bool = False,
    seed: int = 0,
    device=None,
    dtype=None,
    *,
    masks: bool = False,
    pass_coords: bool = False,
    sigma: bool | None = None,
    use_cross_timestep: bool = False,
    isolate_modalities: bool = False,
    stg_blocks: list[int] | None = None,
    perturbation_mask: torch.Tensor | None = None,
) -> dict:
    """Keyword arguments for `model(**kwargs)` (with `return_dict=False`).

    model: the transformer (its config picks channel widths and whether sigma is needed).
    video_tokens_shape: latent (frames, height, width); patch size 1, so tokens = F*H*W.
    per_token: timesteps of shape [B, S] (an image-to-video-like pattern: the first
        latent frame at t=0, the rest at the sample's t, plus a small per-token
        jitter) instead of [B]; audio gets [B, S_audio] likewise.
    device/dtype: default to the model's. Timesteps stay fp32 as pipelines pass them.
    masks: a [B, text] text attention mask (0/1, the last tokens of sample 0
        masked) for video and audio, and a [B, S, S] video self-attention mask.
    pass_coords: precompute RoPE coordinates as the pipelines do and pass
        `video_coords`/`audio_coords`; otherwise pass num_frames/height/width/
        audio_num_frames and let the forward compute them.
    sigma: pass `sigma` [B] (needed by LTX-2.3 prompt modulation and by
        use_cross_timestep); None means "when the model needs it".
    use_cross_timestep, isolate_modalities: passed through (LTX-2.3 options).
    stg_blocks / perturbation_mask: spatio-temporal guidance blocks and the [B]
        mask (0 = perturb); passed through.
    """
    p = next(model.parameters())
    device = p.device if device is None else torch.device(device)
    dtype = p.dtype if dtype is None else dtype
    cfg = model.config
    frames, height, width = video_tokens_shape
    s_video = frames * height * width
    gen = torch.Generator("cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    inner = cfg.num_attention_heads * cfg.attention_head_dim
    audio_inner = cfg.audio_num_attention_heads * cfg.audio_attention_head_dim
    if cfg.use_prompt_embeddings:
        text_dim, audio_text_dim = cfg.caption_channels, cfg.caption_channels
    else:
        text_dim, audio_text_dim = inner, audio_inner

    t = torch.rand(batch, generator=gen) * 900 + 50  # already scaled by timestep_scale_multiplier
    if per_token:
        per_frame = height * width
        timestep = t[:, None] + torch.rand(batch, s_video, generator=gen) * 10
        timestep[:, :per_frame] = 0.0
        audio_timestep = t[:, None] + torch.rand(batch, audio_tokens, generator=gen) * 10
    else:
        timestep = t.clone()
        audio_timestep = None

    kwargs = dict(
        hidden_states=randn(batch, s_video, cfg.in_channels),
        audio_hidden_states=randn(batch, audio_tokens, cfg.audio_in_channels),
        encoder_hidden_states=randn(batch, text_tokens, text_dim),
        audio_encoder_hidden_states=randn(batch, text_tokens, audio_text_dim),
        timestep=timestep.to(device),
        return_dict=False,
    )
    if audio_timestep is not None:
        kwargs["audio_timestep"] = audio_timestep.to(device)
    needs_sigma = bool(cfg.cross_attn_mod or cfg.audio_cross_attn_mod) or use_cross_timestep
    if sigma or (sigma is None and needs_sigma):
        kwargs["sigma"] = (t / 1000.0).to(device)
    if masks:
        text_mask = torch.ones(batch, text_tokens)
        text_mask[0, max(1, text_tokens - 2) :] = 0
        kwargs["encoder_attention_mask"] = text_mask.to(device)
        kwargs["audio_encoder_attention_mask"] = text_mask.to(device)
        self_mask = (torch.rand(batch, s_video, s_video, generator=gen) > 0.2).float()
        self_mask[:, torch.arange(s_video), torch.arange(s_video)] = 1.0
        kwargs["video_self_attention_mask"] = self_mask.to(device)
    if pass_coords:
        kwargs["video_coords"] = model.rope.prepare_video_coords(batch, frames, height, width, device)
        kwargs["audio_coords"] = model.audio_rope.prepare_audio_coords(batch, audio_tokens, device)
    else:
        kwargs.update(num_frames=frames, height=height, width=width, audio_num_frames=audio_tokens)
    if use_cross_timestep:
        kwargs["use_cross_timestep"] = True
    if isolate_modalities:
        kwargs["isolate_modalities"] = True
    if stg_blocks is not None:
        kwargs["spatio_temporal_guidance_blocks"] = list(stg_blocks)
    if perturbation_mask is not None:
        kwargs["perturbation_mask"] = perturbation_mask.to(device=device, dtype=dtype)
    return kwargs
