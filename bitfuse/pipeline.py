"""diffusers' LTX-2 pipeline for `bitfuse run` and the tests: built from random
components in code (no download), or loaded from a local checkpoint.

    pipe = random_pipeline("tiny")                     # LTX2Pipeline, random weights, no text encoder
    video, audio = pipe(**random_prompt(pipe, 8), height=128, width=128, num_frames=9,
                        output_type="pt", return_dict=False)
    write_mp4("out.mp4", pipe, video, audio, fps=24)

Without a text encoder, the prompt goes in through the pipeline's own
`prompt_embeds` path: seeded random embeddings of the width the text
connectors expect. Every component is diffusers' own class; only the sizes
are small. The presets:

- tiny: the transformer of `bitfuse.models.ltx2_configs.tiny_config`, and
  narrow VAEs, vocoder and connectors; a CPU runs the pipeline in well under
  a second.
- ltx2: the full-width transformer (`full_config`: video 4096, audio 2048
  wide) with LTX-2's latent geometry (32x spatial, 8x temporal compression,
  128 video and 8x16 audio latent channels), so 121 frames at 512x768 are
  6144 video tokens as in LTX-2; the VAEs, vocoder and connectors stay narrow.
"""

from __future__ import annotations

import json
import math
import os

import torch

__all__ = [
    "PRESETS",
    "random_pipeline",
    "random_prompt",
    "check_checkpoint",
    "load_pipeline",
    "token_counts",
    "is_ltx23",
    "write_mp4",
]

# sizes of the random components, and the pipeline call's defaults (pixels, as LTX2Pipeline takes them)
PRESETS = {
    "tiny": dict(transformer="tiny", layers=2, vae_width=8, audio_channels=2, audio_mel_bins=16, vocoder_width=16,
                 connector_head_dim=8, height=128, width=128, frames=9, text_tokens=8),
    "ltx2": dict(transformer="full", layers=8, vae_width=32, audio_channels=8, audio_mel_bins=64, vocoder_width=64,
                 connector_head_dim=128, height=512, width=768, frames=121, text_tokens=256),
}

# FlowMatchEulerDiscreteScheduler with the resolution-dependent shift LTX2Pipeline reads
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                        base_image_seq_len=1024, max_image_seq_len=4096)

AUDIO_SAMPLE_RATE, MEL_HOP = 16000, 160
TEXT_LAYERS = 2  # hidden states the (absent) text encoder would stack: the connectors' text_proj_in_factor


def transformer_config(preset: str, variant: str = "2.0", layers: int | None = None) -> dict:
    from .models.ltx2_configs import full_config, tiny_config

    p = PRESETS[preset]
    layers = p["layers"] if layers is None else layers
    if p["transformer"] == "tiny":
        return tiny_config(variant, num_layers=layers)
    return full_config(layers, variant)


def random_pipeline(preset: str = "tiny", variant: str = "2.0", layers: int | None = None, *,
                    image: bool = False, device="cpu", dtype=torch.float32, seed: int = 0):
    """An `LTX2Pipeline` (`LTX2ImageToVideoPipeline` with `image=True`) of seeded random
    components, built on `device` in `dtype`."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2ImageToVideoPipeline,
        LTX2Pipeline,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from .models.ltx2_configs import build_model

    p = PRESETS[preset]
    t = transformer_config(preset, variant, layers)
    transformer = build_model(t, device=device, dtype=dtype, seed=seed)  # the big one: straight on the device
    with torch.device(device):
        torch.manual_seed(seed + 1)
        w = p["vae_width"]
        vae = AutoencoderKLLTX2Video(  # patch 4, then three 2x2x2 downsamples: 32x spatial, 8x temporal
            latent_channels=t["in_channels"], patch_size=4, block_out_channels=(w,) * 3,
            down_block_types=("LTX2VideoDownBlock3D",) * 3, downsample_type=("spatiotemporal",) * 3,
            layers_per_block=(1,) * 4, spatio_temporal_scaling=(True,) * 3, decoder_block_out_channels=(w,) * 3,
            decoder_layers_per_block=(1,) * 4, decoder_spatio_temporal_scaling=(True,) * 3,
            decoder_inject_noise=(False,) * 4, upsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3,
            upsample_factor=(1,) * 3, decoder_causal=False,
        )
        torch.manual_seed(seed + 2)
        mel_bins = p["audio_mel_bins"]  # compressed 4x: the transformer takes audio_channels * mel_bins / 4
        audio_vae = AutoencoderKLLTX2Audio(  # base_channels: the width of its latent statistics
            base_channels=t["audio_in_channels"], ch_mult=(1,), num_res_blocks=1, latent_channels=p["audio_channels"],
            mel_bins=mel_bins, sample_rate=AUDIO_SAMPLE_RATE, mel_hop_length=MEL_HOP,
        )
        torch.manual_seed(seed + 3)
        vocoder = LTX2Vocoder(  # upsamples 4 * 4 * 10 = MEL_HOP: one mel frame to one hop of samples
            in_channels=audio_vae.config.output_channels * mel_bins, hidden_channels=p["vocoder_width"],
            upsample_factors=[4, 4, 10], upsample_kernel_sizes=[8, 8, 20], resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]], output_sampling_rate=AUDIO_SAMPLE_RATE,
        )
        torch.manual_seed(seed + 4)
        connectors = LTX2TextConnectors(**_connector_config(t, p["connector_head_dim"]))
    for m in (vae, audio_vae, vocoder, connectors):
        torch.nn.Module.to(m, dtype=dtype).eval().requires_grad_(False)
    cls = LTX2ImageToVideoPipeline if image else LTX2Pipeline
    return cls(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae, audio_vae=audio_vae,
               text_encoder=None, tokenizer=None, connectors=connectors, transformer=transformer, vocoder=vocoder)


def _connector_config(t: dict, head_dim: int) -> dict:
    """LTX2TextConnectors whose outputs fit the transformer `t`: for LTX-2.0 one projection
    to caption_channels (the model projects again); for LTX-2.3 one per modality, to the
    transformer's own widths."""
    if t.get("use_prompt_embeddings", True):
        video = audio = t["caption_channels"]
        per_modality = {}
    else:
        video = t["num_attention_heads"] * t["attention_head_dim"]
        audio = t["audio_num_attention_heads"] * t["audio_attention_head_dim"]
        per_modality = dict(per_modality_projections=True, video_hidden_dim=video, audio_hidden_dim=audio)
    return dict(caption_channels=t["caption_channels"], text_proj_in_factor=TEXT_LAYERS,
                rope_type=t.get("rope_type", "interleaved"), **per_modality,
                video_connector_num_layers=1, video_connector_num_learnable_registers=None,
                video_connector_num_attention_heads=video // head_dim, video_connector_attention_head_dim=head_dim,
                audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
                audio_connector_num_attention_heads=audio // head_dim, audio_connector_attention_head_dim=head_dim)


def random_prompt(pipe, text_tokens: int, seed: int = 0) -> dict:
    """Seeded random prompt and negative-prompt embeddings (all tokens valid) for a
    pipeline without a text encoder: the `prompt_embeds` keyword arguments."""
    c = pipe.connectors.config
    gen = torch.Generator().manual_seed(seed)
    device, dtype = pipe.connectors.device, pipe.connectors.dtype
    embeds = torch.randn(2, text_tokens, c.caption_channels * c.text_proj_in_factor, generator=gen)
    embeds = embeds.to(device, dtype)
    mask = torch.ones(1, text_tokens, device=device, dtype=torch.long)
    return dict(prompt_embeds=embeds[1:], prompt_attention_mask=mask,
                negative_prompt_embeds=embeds[:1], negative_prompt_attention_mask=mask)


# ---------------------------------------------------------------- checkpoints


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, partial or not LTX-2."""


_MODEL_COMPONENTS = ("transformer", "vae", "audio_vae", "connectors", "vocoder", "text_encoder")
_WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def check_checkpoint(path: str) -> dict:
    """The folder's model_index.json, after checking that every component it names is
    there (a config, and weights for the models); CheckpointError naming what is not."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: {'not a directory' if os.path.exists(path) else 'no such directory'}")
    index_path = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_path):
        raise CheckpointError(f"{path}: no model_index.json (expected a diffusers-format LTX-2 pipeline folder)")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index_path}: cannot read it: {exc}") from None
    cls = index.get("_class_name", "")
    if not cls.startswith("LTX2"):
        raise CheckpointError(f"{path}: not an LTX-2 pipeline (model_index.json names {cls!r})")
    missing = []
    for name in ("scheduler", "connectors", "transformer", "vae", "audio_vae", "vocoder", "text_encoder", "tokenizer"):
        entry = index.get(name)
        if entry is None or entry == [None, None]:
            if name != "text_encoder" and name != "tokenizer":
                missing.append(f"{name} (model_index.json)")
            continue
        folder = os.path.join(path, name)
        if not os.path.isdir(folder):
            missing.append(f"{name}/")
            continue
        files = os.listdir(folder)
        if name in _MODEL_COMPONENTS:
            if "config.json" not in files:
                missing.append(f"{name}/config.json")
            if not any(f.endswith(_WEIGHTS) for f in files):
                missing.append(f"{name}/ weights (*.safetensors)")
        elif not files:
            missing.append(f"{name}/ files")
    if missing:
        raise CheckpointError(f"{path} is incomplete: missing {', '.join(missing)}")
    return index


def load_pipeline(path: str, *, image: bool = False, device="cpu", dtype=torch.float32):
    """A local LTX-2 pipeline folder (check it first with `check_checkpoint`), loaded with
    `local_files_only=True`; one saved without a text encoder loads without one."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
    from diffusers.utils import logging as dlogging

    with open(os.path.join(path, "model_index.json")) as f:
        absent = {name: None for name, entry in json.load(f).items() if entry == [None, None]}
    cls = LTX2ImageToVideoPipeline if image else LTX2Pipeline
    dlogging.disable_progress_bar()  # "Loading pipeline components": bitfuse run draws its own bars
    try:
        pipe = cls.from_pretrained(path, local_files_only=True, dtype=dtype, **absent)
    finally:
        dlogging.enable_progress_bar()
    return pipe.to(device)


# ---------------------------------------------------------------- shapes and output


def is_ltx23(transformer) -> bool:
    c = transformer.config
    return bool(c.cross_attn_mod or c.audio_cross_attn_mod or not c.use_prompt_embeddings)


def token_counts(pipe, frames: int, height: int, width: int, fps: float) -> tuple[int, int]:
    """(video tokens, audio tokens) of one sample, as LTX2Pipeline computes its latents."""
    c = pipe.transformer.config
    latent_frames = (frames - 1) // pipe.vae_temporal_compression_ratio + 1
    video = (math.ceil(latent_frames / c.patch_size_t) * (height // pipe.vae_spatial_compression_ratio // c.patch_size)
             * (width // pipe.vae_spatial_compression_ratio // c.patch_size))
    per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / pipe.audio_vae_temporal_compression_ratio
    audio = round(frames / fps * per_second)
    return video, math.ceil(audio / c.audio_patch_size_t)


def write_mp4(path: str, pipe, video: torch.Tensor, audio: torch.Tensor, fps: float) -> None:
    """The first sample of an `output_type="pt"` result as H.264 + AAC (diffusers' encode_video)."""
    import contextlib
    import io

    from diffusers.utils import encode_video

    frames = (video[0].permute(0, 2, 3, 1).float() * 255).round().clamp(0, 255).to(torch.uint8).cpu()
    with contextlib.redirect_stderr(io.StringIO()):  # encode_video draws a progress bar of its own
        encode_video(frames, fps=fps, output_path=path, audio=audio[0].float().cpu(),
                     audio_sample_rate=pipe.vocoder.config.output_sampling_rate)
