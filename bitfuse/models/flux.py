"""FLUX.1 (diffusers `FluxTransformer2DModel`): every adaLN site routed through bitfuse.

The adaLN modules are diffusers' shared ones, replaced as `adaln` replaces them:
`norm1` / `norm1_context` (AdaLayerNormZero), the single blocks' `norm`
(AdaLayerNormZeroSingle) and the output `norm_out` (AdaLayerNormContinuous):
`LayerNorm(eps=1e-6, elementwise_affine=False)` then `* (1 + scale) + shift`, the
parameters `emb.chunk(n, dim=1)` views read in place. The blocks write the rest
inline, so their forwards are faithful copies from diffusers 0.42.1, each replaced
line kept above its replacement as a `# diffusers:` comment:

    norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
                                   -> sites.layer_norm_modulate_site(block, norm2, x, scale, shift)
    y = gate.unsqueeze(1) * y; x = x + y
    x + gate.unsqueeze(1) * y      -> sites.gated_residual_site(x, y, gate.unsqueeze(1))
    x = gate * proj_out(h); x = residual + x       (single block)
                                   -> sites.gated_residual_site(residual, proj_out(h), gate)

The gated residuals are eager's two roundings (the product, then the sum); the
product commutes bitwise, so `gate * y` is the site's `y * gate`.

Attention (`FluxAttnProcessor`: q/k RMSNorm with weight, then RoPE) is diffusers'
own, untouched: see `PROCESSORS` for where a processor copy joins.

`accelerate` checks the diffusers version (0.42.x) and the sha256 of every copied
function (`SOURCES`, the adaLN copies included), and refuses otherwise unless `force=True`.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_flux import (
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)

from .. import sites
from . import _install, adaln

__all__ = ["VERIFIED_SOURCES", "COPIES", "SOURCES", "PROCESSORS", "FluxHandle", "accelerate", "stock_functions"]

#: sha256 of `inspect.getsource` of each diffusers function copied here (and by `adaln`),
#: as shipped in diffusers 0.42.1
VERIFIED_SOURCES = {
    **adaln.VERIFIED_SOURCES,
    "FluxTransformerBlock.forward": "0b184cbe172708b6f072a779e13866a44ef5a8ee706fcd3e6887923b11c00785",
    "FluxSingleTransformerBlock.forward": "57350a6dab842b40e0d677b9c42794c17e45907ad45991d36dba69d89096a37b",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        **adaln.stock_functions(),
        "FluxTransformerBlock.forward": FluxTransformerBlock.forward,
        "FluxSingleTransformerBlock.forward": FluxSingleTransformerBlock.forward,
    }


# ---------------------------------------------------------------- the blocks


def _block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1 `FluxTransformerBlock.forward`, adaLN sites routed through bitfuse
    (norm1 and norm1_context are adaLN modules: see `adaln`)."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)

    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb
    )
    joint_attention_kwargs = joint_attention_kwargs or {}

    # Attention.
    attention_outputs = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    if len(attention_outputs) == 2:
        attn_output, context_attn_output = attention_outputs
    elif len(attention_outputs) == 3:
        attn_output, context_attn_output, ip_attn_output = attention_outputs

    # Process attention outputs for the `hidden_states`.
    # diffusers: attn_output = gate_msa.unsqueeze(1) * attn_output
    # diffusers: hidden_states = hidden_states + attn_output
    hidden_states = sites.gated_residual_site(hidden_states, attn_output, gate_msa.unsqueeze(1))

    # diffusers: norm_hidden_states = self.norm2(hidden_states)
    # diffusers: norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    norm_hidden_states = sites.layer_norm_modulate_site(
        self, self.norm2, hidden_states, scale_mlp[:, None], shift_mlp[:, None]
    )

    ff_output = self.ff(norm_hidden_states)
    # diffusers: ff_output = gate_mlp.unsqueeze(1) * ff_output
    # diffusers: hidden_states = hidden_states + ff_output
    hidden_states = sites.gated_residual_site(hidden_states, ff_output, gate_mlp.unsqueeze(1))
    if len(attention_outputs) == 3:
        hidden_states = hidden_states + ip_attn_output

    # Process attention outputs for the `encoder_hidden_states`.
    # diffusers: context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
    # diffusers: encoder_hidden_states = encoder_hidden_states + context_attn_output
    encoder_hidden_states = sites.gated_residual_site(
        encoder_hidden_states, context_attn_output, c_gate_msa.unsqueeze(1)
    )

    # diffusers: norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
    # diffusers: norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    norm_encoder_hidden_states = sites.layer_norm_modulate_site(
        self, self.norm2_context, encoder_hidden_states, c_scale_mlp[:, None], c_shift_mlp[:, None]
    )

    context_ff_output = self.ff_context(norm_encoder_hidden_states)
    # diffusers: encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
    encoder_hidden_states = sites.gated_residual_site(
        encoder_hidden_states, context_ff_output, c_gate_mlp.unsqueeze(1)
    )
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

    return encoder_hidden_states, hidden_states


def _single_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1 `FluxSingleTransformerBlock.forward`, the gated residual through
    bitfuse (norm is an adaLN module: see `adaln`)."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
    gate = gate.unsqueeze(1)
    # diffusers: hidden_states = gate * self.proj_out(hidden_states)
    # diffusers: hidden_states = residual + hidden_states
    hidden_states = sites.gated_residual_site(residual, self.proj_out(hidden_states), gate)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    "FluxTransformerBlock.forward": _block_forward,
    "FluxSingleTransformerBlock.forward": _single_block_forward,
}

#: stock attention processor class -> ours. Empty: FluxAttnProcessor stays diffusers'.
#: A copy routing the q/k RMSNorm + RoPE through a site joins here (and its __call__ in
#: VERIFIED_SOURCES / COPIES); `_install.accelerate` switches each processor instance's class.
PROCESSORS: dict[type, type] = {}

SOURCES = _install.CopiedSources(
    "FLUX.1", release="0.42", copied_from="0.42.1", sha256=VERIFIED_SOURCES, stock=stock_functions,
    copies=lambda: COPIES,
)


# ---------------------------------------------------------------- accelerate


class FluxHandle(adaln.AdaLNHandle):
    """What `accelerate` installed on one FLUX.1 transformer (see `_install.Handle`);
    `routed` counts the marked modules by class."""


def _sites(model) -> list:
    blocks = [(f"transformer_blocks.{i}", b, (b.norm2, b.norm2_context)) for i, b in enumerate(model.transformer_blocks)]
    return adaln.adaln_sites(model) + blocks


def accelerate(model, *, quality: str = "lossless", force: bool = False) -> FluxHandle:
    """Install bitfuse's faithful forwards on `model` (a `FluxTransformer2DModel`): its
    double and single blocks and its adaLN modules; mark the adaLN modules and the
    double blocks as sites and mount `quality` (all or nothing). Returns the handle;
    called again with the same quality, the existing one. See `_install.accelerate`
    for the errors."""
    return _install.accelerate(
        model,
        FluxHandle,
        quality=quality,
        force=force,
        sources=SOURCES,
        model_class=FluxTransformer2DModel,
        forwards={FluxTransformerBlock: _block_forward, FluxSingleTransformerBlock: _single_block_forward,
                  **adaln.FORWARDS},
        processors=PROCESSORS,
        sites=_sites,
    )
