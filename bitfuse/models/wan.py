"""Wan (diffusers `WanTransformer3DModel`: Wan 2.1, Wan 2.2 A14B and TI2V 5B): every
fp32 adaLN site, the cross-attention norm and the attention prologue through bitfuse.

Wan computes its adaLN in fp32 on bf16 activations: the parameters are
`scale_shift_table + temb.float()` (fp32; `from_pretrained` keeps the table in
fp32), the norms are FP32LayerNorm on `x.float()`, and one `.type_as(x)` rounds
to bf16 at the end of each expression. Faithful copies of diffusers 0.42.1's
forwards, each replaced line kept above its replacement as a `# diffusers:`
comment (tests/test_copies.py checks the copies):

    (norm1(x.float()) * (1 + scale) + shift).type_as(x)   -> sites.layer_norm_modulate_f32_site (norm1, norm3,
                                                             and the model's norm_out)
    (x.float() + y * gate).type_as(x)                     -> sites.gated_residual_f32_site (attention and
                                                             feed-forward, `ff_output.float() * c_gate` the same)
    norm2(x.float()).type_as(x)  (FP32LayerNorm, affine)  -> sites.layer_norm_f32_site
    norm_q(query), norm_k(key), apply_rotary_emb(...)     -> sites.qk_norm_rope_site(..., "wan"): the RMSNorms
                                                             (weight, over all heads) and the RoPE in one launch

Each site reproduces eager's rounding bit for bit (fp32 throughout, one cast at
the end; aten's Welford for the LayerNorms and aten's order for the RMSNorms; the
RoPE's products and sums in the tables' dtype: fp32 as WanRotaryPosEmbed builds
them, float64 where a user made them so) and is exact in every tier. With Wan 2.2 TI2V's per-token timestep the
block's parameters come from a [B, S, 6, D] fp32 sum; here each is passed as
`Folded(table row, temb view)`, added on the fly with the same rounding, so
that sum is never written. The attention processor (`WanAttnProcessor`) is
copied for its prologue; a processor instance switches `__class__` to the copy,
keeping its backend settings; any other processor is left alone. Everything else
(projections, attention, the feed-forward, the I2V image branch) runs as
diffusers runs it.

The copies are valid only for the diffusers source they were taken from:
`accelerate` checks the diffusers version (0.42.x) and the sha256 of every
copied or reproduced function (`SOURCES`), and refuses otherwise unless `force=True`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    WanRotaryPosEmbed,
    WanTransformer3DModel,
    WanTransformerBlock,
    _get_added_kv_projections,
    _get_qkv_projections,
    dispatch_attention_fn,
)
from diffusers.utils import apply_lora_scale

from .. import sites
from ..ops._params import Folded
from . import _install

__all__ = ["VERIFIED_SOURCES", "COPIES", "SOURCES", "accelerate", "stock_functions"]

# ---------------------------------------------------------------- what was verified

#: sha256 of `inspect.getsource` of each diffusers function copied (or reproduced) here,
#: as shipped in diffusers 0.42.1. A mismatch means the copy may no longer be faithful.
VERIFIED_SOURCES = {
    "WanTransformerBlock.forward": "21c15441b009932c886757e6fee7875fa866ce1bc2746743cadec3f6c1ad865d",
    "WanTransformer3DModel.forward": "9f81a7225288656f1fa424fbd502206d5d242bad2bda9e11e2571eb5bf25ed30",
    "WanAttnProcessor.__call__": "13c09feedcfe814ab506ebde0fec952f7afddd08e3260f73872b8d237cb0f612",
    # reproduced by the fp32-compute kernels (FP32LayerNorm on an fp32 input: F.layer_norm, then .to(fp32))
    "FP32LayerNorm.forward": "fb3a8812f75a9d8325df97c1e39495d4952622c76c846870a1aa2fba7855f869",
    # the RoPE tables the "wan" RoPE reads: fp32 [1, S, 1, Dh], cos/sin repeat-interleaved
    "WanRotaryPosEmbed.forward": "863fb1c601f5756a890344c77a159a1531067dd876aa905cc7d0cbe1a5127c01",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        "WanTransformerBlock.forward": WanTransformerBlock.forward,
        "WanTransformer3DModel.forward": inspect.unwrap(WanTransformer3DModel.forward),
        "WanAttnProcessor.__call__": WanAttnProcessor.__call__,
        "FP32LayerNorm.forward": FP32LayerNorm.forward,
        "WanRotaryPosEmbed.forward": WanRotaryPosEmbed.forward,
    }


# ---------------------------------------------------------------- the block


def _per_token_params(table, temb):
    """Wan 2.2 TI2V's six per-token parameters, `(table.unsqueeze(0) + temb.float()).chunk(6,
    dim=2)`, each as `Folded(table row [D], temb view [B, S, D])` (the sites sum them in fp32
    as eager does: `value32`). table: [1, 6, D]; temb: [B, S, 6, D]. Anything else (other
    shapes; D = 1, where `squeeze(2)` would not be a no-op) is computed as diffusers computes it."""
    if table.dim() != 3 or temb.dim() != 4 or table.shape[1] != 6 or temb.shape[2] != 6 or temb.shape[3] < 2 \
            or table.shape[2] != temb.shape[3]:
        return (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
    return tuple(Folded(table[0, i], temb[:, :, i]) for i in range(6))


def _block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    """diffusers 0.42.1 `WanTransformerBlock.forward`, the adaLN, norm2 and gated residuals through bitfuse."""
    if temb.ndim == 4:
        # temb: batch_size, seq_len, 6, inner_dim (wan2.2 ti2v)
        # diffusers: shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
        # diffusers:     self.scale_shift_table.unsqueeze(0) + temb.float()
        # diffusers: ).chunk(6, dim=2)
        # bitfuse: Folded(table row, temb view) each: the sites add `table + temb.float()` (fp32) on the fly, so
        # bitfuse: the [B, S, 6, D] fp32 sum is never written; squeeze(2) below keeps them (a no-op at size D)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = _per_token_params(
            self.scale_shift_table, temb
        )
        # batch_size, seq_len, 1, inner_dim
        shift_msa = shift_msa.squeeze(2)
        scale_msa = scale_msa.squeeze(2)
        gate_msa = gate_msa.squeeze(2)
        c_shift_msa = c_shift_msa.squeeze(2)
        c_scale_msa = c_scale_msa.squeeze(2)
        c_gate_msa = c_gate_msa.squeeze(2)
    else:
        # temb: batch_size, 6, inner_dim (wan2.1/wan2.2 14B)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()
        ).chunk(6, dim=1)

    # 1. Self-attention
    # diffusers: norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
    norm_hidden_states = sites.layer_norm_modulate_f32_site(self.norm1, hidden_states, scale_msa, shift_msa)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    # diffusers: hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
    hidden_states = sites.gated_residual_f32_site(hidden_states, attn_output, gate_msa)

    # 2. Cross-attention
    # diffusers: norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
    norm_hidden_states = sites.layer_norm_f32_site(self.norm2, hidden_states)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output

    # 3. Feed-forward
    # diffusers: norm_hidden_states = (self.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(
    # diffusers:     hidden_states
    # diffusers: )
    norm_hidden_states = sites.layer_norm_modulate_f32_site(self.norm3, hidden_states, c_scale_msa, c_shift_msa)
    ff_output = self.ffn(norm_hidden_states)
    # diffusers: hidden_states = (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)
    # bitfuse: `ff_output * c_gate_msa` promotes ff_output to fp32 exactly: the same product
    hidden_states = sites.gated_residual_f32_site(hidden_states, ff_output, c_gate_msa)

    return hidden_states


# ---------------------------------------------------------------- the model


@apply_lora_scale("attention_kwargs")
def _model_forward(
    self,
    hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: torch.Tensor | None = None,
    return_dict: bool = True,
    attention_kwargs: dict[str, Any] | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """diffusers 0.42.1 `WanTransformer3DModel.forward`, the output norm's modulate through bitfuse.

    
    The [`WanTransformer3DModel`] forward method.

    Args:
        hidden_states (`torch.Tensor` of shape `(batch_size, num_channels, num_frames, height, width)`):
            Input `hidden_states`.
        timestep (`torch.LongTensor`):
            Used to indicate denoising step.
        encoder_hidden_states (`torch.Tensor` of shape `(batch_size, sequence_len, embed_dims)`):
            Conditional embeddings (embeddings computed from the input conditions such as prompts) to use.
        encoder_hidden_states_image (`torch.Tensor`, *optional*):
            Conditional image embeddings for image-conditioned generation.
        return_dict (`bool`, *optional*, defaults to `True`):
            Whether or not to return a [`~models.transformer_2d.Transformer2DModelOutput`] instead of a plain
            tuple.
        attention_kwargs (`dict`, *optional*):
            A kwargs dictionary that if specified is passed along to the `AttentionProcessor` as defined under
            `self.processor` in
            [diffusers.models.attention_processor](https://github.com/huggingface/diffusers/blob/main/src/diffusers/models/attention_processor.py).

    Returns:
        If `return_dict` is True, an [`~models.transformer_2d.Transformer2DModelOutput`] is returned, otherwise a
        `tuple` where the first element is the sample tensor.
    """
    batch_size, num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size
    post_patch_num_frames = num_frames // p_t
    post_patch_height = height // p_h
    post_patch_width = width // p_w

    rotary_emb = self.rope(hidden_states)

    hidden_states = self.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2)

    # flatten+transpose produces a non-contiguous tensor; make it contiguous before the block loop.
    hidden_states = hidden_states.contiguous()

    # timestep shape: batch_size, or batch_size, seq_len (wan 2.2 ti2v)
    if timestep.ndim == 2:
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()  # batch_size * seq_len
    else:
        ts_seq_len = None

    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = self.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len
    )
    if ts_seq_len is not None:
        # batch_size, seq_len, 6, inner_dim
        timestep_proj = timestep_proj.unflatten(2, (6, -1))
    else:
        # batch_size, 6, inner_dim
        timestep_proj = timestep_proj.unflatten(1, (6, -1))

    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    # 4. Transformer blocks
    if torch.is_grad_enabled() and self.gradient_checkpointing:
        for block in self.blocks:
            hidden_states = self._gradient_checkpointing_func(
                block, hidden_states, encoder_hidden_states, timestep_proj, rotary_emb
            )
    else:
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)

    # 5. Output norm, projection & unpatchify
    if temb.ndim == 3:
        # batch_size, seq_len, inner_dim (wan 2.2 ti2v)
        shift, scale = (self.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift = shift.squeeze(2)
        scale = scale.squeeze(2)
    else:
        # batch_size, inner_dim
        shift, scale = (self.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)

    # Move the shift and scale tensors to the same device as hidden_states.
    # When using multi-GPU inference via accelerate these will be on the
    # first device rather than the last device, which hidden_states ends up
    # on.
    shift = shift.to(hidden_states.device)
    scale = scale.to(hidden_states.device)

    # diffusers: hidden_states = (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
    hidden_states = sites.layer_norm_modulate_f32_site(self.norm_out, hidden_states, scale, shift)
    hidden_states = self.proj_out(hidden_states)

    hidden_states = hidden_states.reshape(
        batch_size, post_patch_num_frames, post_patch_height, post_patch_width, p_t, p_h, p_w, -1
    )
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    if not return_dict:
        return (output,)

    return Transformer2DModelOutput(sample=output)

# ---------------------------------------------------------------- attention


class _AttnProcessor(WanAttnProcessor):
    """diffusers' `WanAttnProcessor` with the query/key norms and the RoPE through
    `sites.qk_norm_rope_site` (one launch; the cross-attention's norms likewise, without RoPE)."""

    def __call__(
        self,
        attn: "WanAttention",
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """diffusers 0.42.1 `WanAttnProcessor.__call__`, the q/k norms and RoPE fused."""
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # 512 is the context length of the text encoder, hardcoded for now
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)

        # diffusers: query = attn.norm_q(query)
        # diffusers: key = attn.norm_k(key)
        # bitfuse: the norms and the RoPE below in one launch (the RoPE on the [B, S, H * Dh] rows: the same bits)
        query, key = sites.qk_norm_rope_site(
            attn.norm_q, attn.norm_k, query, key, rotary_emb, None, None if rotary_emb is None else "wan"
        )

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        # diffusers: if rotary_emb is not None:
        # diffusers:
        # diffusers:     def apply_rotary_emb(
        # diffusers:         hidden_states: torch.Tensor,
        # diffusers:         freqs_cos: torch.Tensor,
        # diffusers:         freqs_sin: torch.Tensor,
        # diffusers:     ):
        # diffusers:         x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
        # diffusers:         cos = freqs_cos[..., 0::2]
        # diffusers:         sin = freqs_sin[..., 1::2]
        # diffusers:         out = torch.empty_like(hidden_states)
        # diffusers:         out[..., 0::2] = x1 * cos - x2 * sin
        # diffusers:         out[..., 1::2] = x1 * sin + x2 * cos
        # diffusers:         return out.type_as(hidden_states)
        # diffusers:
        # diffusers:     query = apply_rotary_emb(query, *rotary_emb)
        # diffusers:     key = apply_rotary_emb(key, *rotary_emb)
        # bitfuse: rotated above, by qk_norm_rope_site

        # I2V task
        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img)

            key_img = key_img.unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))

            hidden_states_img = dispatch_attention_fn(
                query,
                key_img,
                value_img,
                attn_mask=None,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                # Reference: https://github.com/huggingface/diffusers/pull/12909
                parallel_config=None,
            )
            hidden_states_img = hidden_states_img.flatten(2, 3)
            hidden_states_img = hidden_states_img.type_as(query)

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            # Reference: https://github.com/huggingface/diffusers/pull/12909
            parallel_config=(self._parallel_config if encoder_hidden_states is None else None),
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)

        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


#: stock processor class -> ours; a processor of any other class (a user's) is left alone
_PROCESSORS = {WanAttnProcessor: _AttnProcessor}

#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    "WanTransformerBlock.forward": _block_forward,
    "WanTransformer3DModel.forward": inspect.unwrap(_model_forward),
    "WanAttnProcessor.__call__": _AttnProcessor.__call__,
}

SOURCES = _install.CopiedSources(
    "Wan", release="0.42", copied_from="0.42.1", sha256=VERIFIED_SOURCES, stock=stock_functions,
    copies=lambda: COPIES,
)


# ---------------------------------------------------------------- accelerate


def _sites(model) -> list:
    # no norms listed: every Wan site is exact in every tier (fp32 compute, one rounding)
    blocks = [(f"blocks.{i}", b, ()) for i, b in enumerate(model.blocks)]
    return blocks + [("head", model, ())]


def accelerate(model, *, quality: str = "lossless", force: bool = False) -> _install.Handle:
    """Install bitfuse's faithful forwards on `model` (a `WanTransformer3DModel`): the
    model's forward (its output norm), its blocks and their attention processors;
    mark the blocks and the head as sites and mount `quality` (all or nothing; every
    site is exact in both tiers). Returns the handle; called again with the same
    quality, the existing one. See `_install.accelerate` for the errors."""
    return _install.accelerate(
        model,
        _install.Handle,
        quality=quality,
        force=force,
        sources=SOURCES,
        model_class=WanTransformer3DModel,
        forwards={WanTransformer3DModel: _model_forward, WanTransformerBlock: _block_forward},
        processors=_PROCESSORS,
        sites=_sites,
    )
