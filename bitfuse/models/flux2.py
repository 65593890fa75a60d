"""FLUX.2 (diffusers `Flux2Transformer2DModel`): every adaLN site routed through bitfuse.

FLUX.2 computes every block's modulation once per forward, in three shared
`Flux2Modulation` modules (double-stream image, double-stream text, single
stream): `mod = linear(silu(temb))`, [B, 6D] or [B, 3D] ([B, S, nD] per token
when KV-extract mode blends reference-token rows in). Each block splits it with
`Flux2Modulation.split`: `unsqueeze(1)` then `chunk(n, dim=-1)`, so shift, scale
and gate are [B, 1, D] (or [B, S, D]) strided views, read in place by the kernels.

The blocks write the modulation inline, so their forwards are faithful copies from
diffusers 0.42.1, each replaced line kept above its replacement as a `# diffusers:`
comment. Each replacement is the same sequence of roundings as the site's:

    n = norm(x); (1 + scale) * n + shift
        -> sites.layer_norm_modulate_site(block, norm, x, scale, shift): `1 + scale`,
           then the product (it commutes: `t * n` and `n * t` are one IEEE product),
           then `+ shift`, one rounding each
    n = norm(x); n * (1 + scale) + shift  -> the same
    y = gate * y; x = x + y
    x + gate * y                          -> sites.gated_residual_site(x, y, gate):
           the product, then the sum, one rounding each

The output norm is diffusers' AdaLayerNormContinuous (LayerNorm without affine or
bias), replaced as `adaln` replaces it. Attention (`Flux2AttnProcessor`,
`Flux2ParallelSelfAttnProcessor` and their KV-cache variants) is diffusers' own,
untouched: see `PROCESSORS`.

`accelerate` checks the diffusers version (0.42.x) and the sha256 of every copied
function (`SOURCES`), and refuses otherwise unless `force=True`.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Modulation,
    Flux2SingleTransformerBlock,
    Flux2Transformer2DModel,
    Flux2TransformerBlock,
)

from .. import sites
from . import _install, adaln

__all__ = ["VERIFIED_SOURCES", "COPIES", "SOURCES", "PROCESSORS", "Flux2Handle", "accelerate", "stock_functions"]

#: sha256 of `inspect.getsource` of each diffusers function copied here (and by `adaln`),
#: as shipped in diffusers 0.42.1
VERIFIED_SOURCES = {
    **adaln.VERIFIED_SOURCES,
    "Flux2TransformerBlock.forward": "b5d26783a67cbd6d1aa653a079628c39992dc713d5606a8f6cc1f93fe00d352c",
    "Flux2SingleTransformerBlock.forward": "e1baa440356a9b3ac7a541298b9b1adcc95e41ea988d18d8c211c40b396085be",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        **adaln.stock_functions(),
        "Flux2TransformerBlock.forward": Flux2TransformerBlock.forward,
        "Flux2SingleTransformerBlock.forward": Flux2SingleTransformerBlock.forward,
    }


# ---------------------------------------------------------------- the blocks


def _block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1 `Flux2TransformerBlock.forward`, adaLN sites routed through bitfuse."""
    joint_attention_kwargs = joint_attention_kwargs or {}

    # Modulation parameters shape: [1, 1, self.dim]
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = Flux2Modulation.split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = Flux2Modulation.split(
        temb_mod_txt, 2
    )

    # Img stream
    # diffusers: norm_hidden_states = self.norm1(hidden_states)
    # diffusers: norm_hidden_states = (1 + scale_msa) * norm_hidden_states + shift_msa
    # bitfuse: the product commutes bitwise: the site's n * (1 + scale) + shift, the same three roundings
    norm_hidden_states = sites.layer_norm_modulate_site(self, self.norm1, hidden_states, scale_msa, shift_msa)

    # Conditioning txt stream
    # diffusers: norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states)
    # diffusers: norm_encoder_hidden_states = (1 + c_scale_msa) * norm_encoder_hidden_states + c_shift_msa
    norm_encoder_hidden_states = sites.layer_norm_modulate_site(
        self, self.norm1_context, encoder_hidden_states, c_scale_msa, c_shift_msa
    )

    # Attention on concatenated img + txt stream
    attention_outputs = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    attn_output, context_attn_output = attention_outputs

    # Process attention outputs for the image stream (`hidden_states`).
    # diffusers: attn_output = gate_msa * attn_output
    # diffusers: hidden_states = hidden_states + attn_output
    hidden_states = sites.gated_residual_site(hidden_states, attn_output, gate_msa)

    # diffusers: norm_hidden_states = self.norm2(hidden_states)
    # diffusers: norm_hidden_states = norm_hidden_states * (1 + scale_mlp) + shift_mlp
    norm_hidden_states = sites.layer_norm_modulate_site(self, self.norm2, hidden_states, scale_mlp, shift_mlp)

    ff_output = self.ff(norm_hidden_states)
    # diffusers: hidden_states = hidden_states + gate_mlp * ff_output
    hidden_states = sites.gated_residual_site(hidden_states, ff_output, gate_mlp)

    # Process attention outputs for the text stream (`encoder_hidden_states`).
    # diffusers: context_attn_output = c_gate_msa * context_attn_output
    # diffusers: encoder_hidden_states = encoder_hidden_states + context_attn_output
    encoder_hidden_states = sites.gated_residual_site(encoder_hidden_states, context_attn_output, c_gate_msa)

    # diffusers: norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
    # diffusers: norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp) + c_shift_mlp
    norm_encoder_hidden_states = sites.layer_norm_modulate_site(
        self, self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp
    )

    context_ff_output = self.ff_context(norm_encoder_hidden_states)
    # diffusers: encoder_hidden_states = encoder_hidden_states + c_gate_mlp * context_ff_output
    encoder_hidden_states = sites.gated_residual_site(encoder_hidden_states, context_ff_output, c_gate_mlp)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

    return encoder_hidden_states, hidden_states


def _single_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    split_hidden_states: bool = False,
    text_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1 `Flux2SingleTransformerBlock.forward`, adaLN sites routed through bitfuse."""
    # If encoder_hidden_states is None, hidden_states is assumed to have encoder_hidden_states already
    # concatenated
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    mod_shift, mod_scale, mod_gate = Flux2Modulation.split(temb_mod, 1)[0]

    # diffusers: norm_hidden_states = self.norm(hidden_states)
    # diffusers: norm_hidden_states = (1 + mod_scale) * norm_hidden_states + mod_shift
    # bitfuse: the product commutes bitwise: the site's n * (1 + scale) + shift, the same three roundings
    norm_hidden_states = sites.layer_norm_modulate_site(self, self.norm, hidden_states, mod_scale, mod_shift)

    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    # diffusers: hidden_states = hidden_states + mod_gate * attn_output
    hidden_states = sites.gated_residual_site(hidden_states, attn_output, mod_gate)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    if split_hidden_states:
        encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return encoder_hidden_states, hidden_states
    else:
        return hidden_states


#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    "Flux2TransformerBlock.forward": _block_forward,
    "Flux2SingleTransformerBlock.forward": _single_block_forward,
}

#: stock attention processor class -> ours. Empty: diffusers' processors stay; a copy
#: routing the q/k RMSNorm + RoPE through a site joins here (see flux.PROCESSORS).
PROCESSORS: dict[type, type] = {}

SOURCES = _install.CopiedSources(
    "FLUX.2", release="0.42", copied_from="0.42.1", sha256=VERIFIED_SOURCES, stock=stock_functions,
    copies=lambda: COPIES,
)


# ---------------------------------------------------------------- accelerate


class Flux2Handle(adaln.AdaLNHandle):
    """What `accelerate` installed on one FLUX.2 transformer (see `_install.Handle`);
    `routed` counts the marked modules by class."""


def _sites(model) -> list:
    double = [(f"transformer_blocks.{i}", b, (b.norm1, b.norm1_context, b.norm2, b.norm2_context))
              for i, b in enumerate(model.transformer_blocks)]
    single = [(f"single_transformer_blocks.{i}", b, (b.norm,)) for i, b in enumerate(model.single_transformer_blocks)]
    return double + single + adaln.adaln_sites(model)


def accelerate(model, *, quality: str = "lossless", force: bool = False) -> Flux2Handle:
    """Install bitfuse's faithful forwards on `model` (a `Flux2Transformer2DModel`): its
    double and single blocks and its output norm; mark them as sites and mount
    `quality` (all or nothing). Returns the handle; called again with the same
    quality, the existing one. See `_install.accelerate` for the errors."""
    return _install.accelerate(
        model,
        Flux2Handle,
        quality=quality,
        force=force,
        sources=SOURCES,
        model_class=Flux2Transformer2DModel,
        forwards={Flux2TransformerBlock: _block_forward, Flux2SingleTransformerBlock: _single_block_forward,
                  **adaln.FORWARDS},
        processors=PROCESSORS,
        sites=_sites,
    )
