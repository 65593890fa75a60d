"""Qwen-Image (diffusers `QwenImageTransformer2DModel`): every adaLN site routed through bitfuse.

diffusers computes Qwen-Image's adaLN in `QwenImageTransformerBlock.forward`, its
`_modulate` helper and the output head `norm_out` (an `AdaLayerNormContinuous`).
This module carries faithful copies of the two forwards, line for line from
diffusers 0.42.1, each replaced line kept above its replacement as a
`# diffusers:` comment (tests/test_copies.py checks the copies):

    norm(x), then self._modulate(it, mod, index)  -> _norm_modulate(self, norm, x, mod, index): the same
                                                     parameters, `norm(x) * (1 + scale) + shift` through
                                                     sites.layer_norm_modulate_site
    x + gate * y                                  -> sites.gated_residual_site(x, y, gate) (products commute bitwise)
    norm_out: norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
                                                  -> sites.layer_norm_modulate_site(norm_out, norm, x, ...)

The four block norms and the head's are `nn.LayerNorm(D, elementwise_affine=False,
eps=1e-6)`, each output modulated once, so each norm and its modulation fuse into
one site (`layer_norm(x) * (1 + scale) + shift`, eager's roundings reproduced).

The parameters, as `_modulate` builds them from a block's `img_mod` / `txt_mod`
output [B, 6D] (`chunk(2)` then `chunk(3)`: views, samples 6D apart):
- without `modulate_index`: shift, scale, gate are [B, 1, D] strided views, read
  in place by the kernels (nothing is copied);
- with `modulate_index` (`zero_cond_t`, Qwen-Image-Edit-2511: the timestep batch is
  [t, 0], so mod rows [:B] modulate the generated image's tokens and rows [B:] the
  condition images'): `torch.where(index == 0, row0, row1)` picks each token's row.
  The sites take no per-token row choice, so the choice is materialised as eager
  materialises it ([B, S, D], the same bits) and read as per-token parameters. No
  copy is added; eager's three `where`s stay (one `index == 0` serves all three;
  a kernel parameter choosing the row per token, like `Folded`, would save them).

The text stream is never index-modulated. The attention processor (q/k RMSNorm,
complex RoPE) and everything else run as diffusers runs them.

The copies are valid only for the diffusers source they were taken from:
`accelerate` checks the diffusers version (0.42.x) and the sha256 of every
copied or reproduced function (`SOURCES`), and refuses otherwise unless `force=True`.
"""

from typing import Any

import torch
from diffusers.models.normalization import AdaLayerNormContinuous
from diffusers.models.transformers.transformer_qwenimage import (
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
)

from .. import sites
from . import _install, adaln

__all__ = ["VERIFIED_SOURCES", "COPIES", "SOURCES", "accelerate", "stock_functions"]

# ---------------------------------------------------------------- what was verified

#: sha256 of `inspect.getsource` of each diffusers function copied (or reproduced) here,
#: as shipped in diffusers 0.42.1. A mismatch means the copy may no longer be faithful.
VERIFIED_SOURCES = {
    "QwenImageTransformerBlock.forward": "89de238db44a7a47fb3977b20366118d2108a36ecde36be2c5d2d2c33658b609",
    # reproduced by _norm_modulate (its parameter selection; the modulation through the site)
    "QwenImageTransformerBlock._modulate": "9ee78b512057d504ae89f8e48b1c8c552aa29a8c0f214b5095766a963c5454d7",
    # the head's norm_out: the generic layer's copy (adaln.FORWARDS)
    "AdaLayerNormContinuous.forward": adaln.VERIFIED_SOURCES["AdaLayerNormContinuous.forward"],
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        "QwenImageTransformerBlock.forward": QwenImageTransformerBlock.forward,
        "QwenImageTransformerBlock._modulate": QwenImageTransformerBlock._modulate,
        "AdaLayerNormContinuous.forward": AdaLayerNormContinuous.forward,
    }


# ---------------------------------------------------------------- the block


def _norm_modulate(block, norm, x, mod_params, index=None):
    """`block._modulate(norm(x), mod_params, index)`, diffusers' `_modulate` with the
    norm fused into its modulation (`sites.layer_norm_modulate_site`).

    x: [B, S, D]. mod_params: [B, 3D] (shift, scale, gate), or [2B, 3D] with `index`.
    index: [B, S] integers or None: tokens where it is 0 take rows [:B], the others
    rows [B:]. Returns (the modulated x [B, S, D], gate [B, 1, D] or [B, S, D]).
    A block whose `_modulate` is not diffusers' (a subclass, an instance attribute)
    runs its own on the norm's output."""
    if getattr(block._modulate, "__func__", None) is not QwenImageTransformerBlock._modulate:
        return block._modulate(norm(x), mod_params, index)
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    if index is not None:
        actual_batch = shift.size(0) // 2
        first = index.unsqueeze(-1) == 0  # [B, S, 1]
        shift, scale, gate = (
            torch.where(first, p[:actual_batch].unsqueeze(1), p[actual_batch:].unsqueeze(1))
            for p in (shift, scale, gate)
        )
    else:
        shift, scale, gate = shift.unsqueeze(1), scale.unsqueeze(1), gate.unsqueeze(1)
    return sites.layer_norm_modulate_site(block, norm, x, scale, shift), gate


def _block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1 `QwenImageTransformerBlock.forward`, adaLN sites routed through bitfuse."""
    # Get modulation parameters for both streams
    img_mod_params = self.img_mod(temb)  # [B, 6*dim]

    if self.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_mod_params = self.txt_mod(temb)  # [B, 6*dim]

    # Split modulation parameters for norm1 and norm2
    img_mod1, img_mod2 = img_mod_params.chunk(2, dim=-1)  # Each [B, 3*dim]
    txt_mod1, txt_mod2 = txt_mod_params.chunk(2, dim=-1)  # Each [B, 3*dim]

    # Process image stream - norm1 + modulation
    # diffusers: img_normed = self.img_norm1(hidden_states)
    # diffusers: img_modulated, img_gate1 = self._modulate(img_normed, img_mod1, modulate_index)
    img_modulated, img_gate1 = _norm_modulate(self, self.img_norm1, hidden_states, img_mod1, modulate_index)

    # Process text stream - norm1 + modulation
    # diffusers: txt_normed = self.txt_norm1(encoder_hidden_states)
    # diffusers: txt_modulated, txt_gate1 = self._modulate(txt_normed, txt_mod1)
    txt_modulated, txt_gate1 = _norm_modulate(self, self.txt_norm1, encoder_hidden_states, txt_mod1)

    # Use QwenAttnProcessor2_0 for joint attention computation
    # This directly implements the DoubleStreamLayerMegatron logic:
    # 1. Computes QKV for both streams
    # 2. Applies QK normalization and RoPE
    # 3. Concatenates and runs joint attention
    # 4. Splits results back to separate streams
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=img_modulated,  # Image stream (will be processed as "sample")
        encoder_hidden_states=txt_modulated,  # Text stream (will be processed as "context")
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    # QwenAttnProcessor2_0 returns (img_output, txt_output) when encoder_hidden_states is provided
    img_attn_output, txt_attn_output = attn_output

    # Apply attention gates and add residual (like in Megatron)
    # diffusers: hidden_states = hidden_states + img_gate1 * img_attn_output
    # diffusers: encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn_output
    hidden_states = sites.gated_residual_site(hidden_states, img_attn_output, img_gate1)
    encoder_hidden_states = sites.gated_residual_site(encoder_hidden_states, txt_attn_output, txt_gate1)

    # Process image stream - norm2 + MLP
    # diffusers: img_normed2 = self.img_norm2(hidden_states)
    # diffusers: img_modulated2, img_gate2 = self._modulate(img_normed2, img_mod2, modulate_index)
    img_modulated2, img_gate2 = _norm_modulate(self, self.img_norm2, hidden_states, img_mod2, modulate_index)
    img_mlp_output = self.img_mlp(img_modulated2)
    # diffusers: hidden_states = hidden_states + img_gate2 * img_mlp_output
    hidden_states = sites.gated_residual_site(hidden_states, img_mlp_output, img_gate2)

    # Process text stream - norm2 + MLP
    # diffusers: txt_normed2 = self.txt_norm2(encoder_hidden_states)
    # diffusers: txt_modulated2, txt_gate2 = self._modulate(txt_normed2, txt_mod2)
    txt_modulated2, txt_gate2 = _norm_modulate(self, self.txt_norm2, encoder_hidden_states, txt_mod2)
    txt_mlp_output = self.txt_mlp(txt_modulated2)
    # diffusers: encoder_hidden_states = encoder_hidden_states + txt_gate2 * txt_mlp_output
    encoder_hidden_states = sites.gated_residual_site(encoder_hidden_states, txt_mlp_output, txt_gate2)

    # Clip to prevent overflow for fp16
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    return encoder_hidden_states, hidden_states


#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    "QwenImageTransformerBlock.forward": _block_forward,
}

SOURCES = _install.CopiedSources(
    "Qwen-Image", release="0.42", copied_from="0.42.1", sha256=VERIFIED_SOURCES, stock=stock_functions,
    copies=lambda: COPIES,
)


# ---------------------------------------------------------------- accelerate


def _sites(model) -> list:
    blocks = [
        (f"transformer_blocks.{i}", b, (b.img_norm1, b.txt_norm1, b.img_norm2, b.txt_norm2))
        for i, b in enumerate(model.transformer_blocks)
    ]
    return blocks + [("norm_out", model.norm_out, (model.norm_out.norm,))]


def accelerate(model, *, quality: str = "lossless", force: bool = False) -> _install.Handle:
    """Install bitfuse's faithful forwards on `model` (a `QwenImageTransformer2DModel`):
    its blocks and its `norm_out`; mark them as sites and mount `quality` (all or
    nothing). Returns the handle; called again with the same quality, the existing
    one. See `_install.accelerate` for the errors."""
    return _install.accelerate(
        model,
        _install.Handle,
        quality=quality,
        force=force,
        sources=SOURCES,
        model_class=QwenImageTransformer2DModel,
        forwards={QwenImageTransformerBlock: _block_forward,
                  AdaLayerNormContinuous: adaln.FORWARDS[AdaLayerNormContinuous]},
        sites=_sites,
    )
