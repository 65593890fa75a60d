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
    Flux2SwiGLU (silu(m[..., :h]) * m[..., h:]), then torch.cat([attn, that], dim=-1)
        -> sites.cat_act_site(attn, m, "swiglu"): in one kernel (single blocks); the
           feed-forwards' Flux2SwiGLU alone -> sites.cat_act_site(None, m, "swiglu")

The output norm is diffusers' AdaLayerNormContinuous (LayerNorm without affine or
bias), replaced as `adaln` replaces it. The default attention processors
(`Flux2AttnProcessor`, `Flux2ParallelSelfAttnProcessor`) are copied with their q/k
norms and RoPE through `flux.qk_norm_rope` (see `flux`), the parallel one's SwiGLU
and concatenation through `sites.cat_act_site`; the KV-cache processors and any
other are left alone. `Flux2FeedForward.forward` is copied for its SwiGLU.

`accelerate` checks the diffusers version (0.42.x) and the sha256 of every copied
function (`SOURCES`), and refuses otherwise unless `force=True`.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers import transformer_flux2 as _flux2_module
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2FeedForward,
    Flux2Modulation,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2SingleTransformerBlock,
    Flux2SwiGLU,
    Flux2Transformer2DModel,
    Flux2TransformerBlock,
)

from .. import sites
from . import _install, adaln, flux
from .flux import qk_norm_rope

__all__ = ["VERIFIED_SOURCES", "COPIES", "SOURCES", "PROCESSORS", "Flux2Handle", "accelerate", "stock_functions"]

#: sha256 of `inspect.getsource` of each diffusers function copied here (and by `adaln`),
#: as shipped in diffusers 0.42.1
VERIFIED_SOURCES = {
    **adaln.VERIFIED_SOURCES,
    "Flux2TransformerBlock.forward": "b5d26783a67cbd6d1aa653a079628c39992dc713d5606a8f6cc1f93fe00d352c",
    "Flux2SingleTransformerBlock.forward": "e1baa440356a9b3ac7a541298b9b1adcc95e41ea988d18d8c211c40b396085be",
    "Flux2AttnProcessor.__call__": "2106c36979e28f30596b36f591819420bfd2f67f346a8a038cbd355f0cf5737d",
    "Flux2ParallelSelfAttnProcessor.__call__": "18a20dca474518356a19cfa834bd9ad201f5daa9836973fcffd795e1b4b0a280",
    "Flux2FeedForward.forward": "af59d2fda364f00c83f4fac82f7d5c6413d56e9b7f6954eec190e17be2a1e69b",
    # flux.qk_norm_rope reproduces it
    "apply_rotary_emb": flux.VERIFIED_SOURCES["apply_rotary_emb"],
    # ops.act_cat's SwiGLU reproduces it (sites.cat_act_site)
    "Flux2SwiGLU.forward": "0caf2addea5d5fceeb98fd4c12e5195815fb81d7495562c45a624a27ca9b0c12",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        **adaln.stock_functions(),
        "Flux2TransformerBlock.forward": Flux2TransformerBlock.forward,
        "Flux2SingleTransformerBlock.forward": Flux2SingleTransformerBlock.forward,
        "Flux2AttnProcessor.__call__": Flux2AttnProcessor.__call__,
        "Flux2ParallelSelfAttnProcessor.__call__": Flux2ParallelSelfAttnProcessor.__call__,
        "Flux2FeedForward.forward": Flux2FeedForward.forward,
        "apply_rotary_emb": _flux2_module.apply_rotary_emb,
        "Flux2SwiGLU.forward": Flux2SwiGLU.forward,
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
    # bitfuse: the site's x + y * gate: the product (commuted: the same IEEE product), then the sum, one rounding each
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
    # bitfuse: the site's x + y * gate: the product (commuted: the same IEEE product), then the sum, one rounding each
    hidden_states = sites.gated_residual_site(hidden_states, attn_output, mod_gate)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    if split_hidden_states:
        encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return encoder_hidden_states, hidden_states
    else:
        return hidden_states


# ---------------------------------------------------------------- attention


class _AttnProcessor(Flux2AttnProcessor):
    """diffusers 0.42.1 `Flux2AttnProcessor.__call__` (double-stream blocks), the q/k norms
    and RoPE through `flux.qk_norm_rope` (installed as flux._AttnProcessor is)."""

    def __call__(
        self,
        attn: "Flux2Attention",
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # diffusers: query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
        query, key, value, encoder_query, encoder_key, encoder_value = _flux2_module._get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )

        # Reshape by a fixed `head_dim` and let `-1` absorb the head count. Under tensor parallelism each rank
        # holds a column-sharded slice (`attn.heads // tp_degree` heads); this keeps the processor TP-agnostic.
        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))

        # diffusers: query = attn.norm_q(query)
        # diffusers: key = attn.norm_k(key)
        # bitfuse: the norms, the text-first concatenation of query and key and RoPE run in qk_norm_rope,
        # bitfuse: after the value's concatenation (independent of them: the same values)
        encoder_qk = (None, None)

        if attn.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))

            # diffusers: encoder_query = attn.norm_added_q(encoder_query)
            # diffusers: encoder_key = attn.norm_added_k(encoder_key)
            # diffusers: query = torch.cat([encoder_query, query], dim=1)
            # diffusers: key = torch.cat([encoder_key, key], dim=1)
            encoder_qk = (encoder_query, encoder_key)
            value = torch.cat([encoder_value, value], dim=1)

        # diffusers: if image_rotary_emb is not None:
        # diffusers:     query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        # diffusers:     key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        query, key = qk_norm_rope(attn, query, key, *encoder_qk, image_rotary_emb)

        # diffusers: hidden_states = dispatch_attention_fn(
        hidden_states = _flux2_module.dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
            )
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)

        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        else:
            return hidden_states


class _ParallelSelfAttnProcessor(Flux2ParallelSelfAttnProcessor):
    """diffusers 0.42.1 `Flux2ParallelSelfAttnProcessor.__call__` (single-stream blocks),
    the q/k norms and RoPE through `flux.qk_norm_rope`."""

    def __call__(
        self,
        attn: "Flux2ParallelSelfAttention",
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Parallel in (QKV + MLP in) projection
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)

        # Split the fused output into its QKV and MLP halves by their global ratio, so the same code path works
        # whether or not `to_qkv_mlp_proj` is column-sharded (PackedColwiseParallel shards each block, so every
        # rank's contiguous slice keeps the QKV and MLP chunks proportional). No tensor-parallel state is read here.
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)

        # Handle the attention logic
        query, key, value = qkv.chunk(3, dim=-1)

        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))

        # diffusers: query = attn.norm_q(query)
        # diffusers: key = attn.norm_k(key)
        # diffusers: if image_rotary_emb is not None:
        # diffusers:     query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        # diffusers:     key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        query, key = qk_norm_rope(attn, query, key, None, None, image_rotary_emb)

        # diffusers: hidden_states = dispatch_attention_fn(
        hidden_states = _flux2_module.dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # Handle the feedforward (FF) logic
        # diffusers: mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        # bitfuse: a stock Flux2SwiGLU runs in the concatenation below (sites.cat_act_site); any other here
        act = "swiglu" if _plain_swiglu(attn.mlp_act_fn) else None
        if act is None:
            mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)

        # Concatenate and parallel output projection
        # diffusers: hidden_states = torch.cat([hidden_states, mlp_hidden_states], dim=-1)
        # bitfuse: the SwiGLU and the concatenation in one kernel: the same values, eager's contiguous layout
        hidden_states = sites.cat_act_site(hidden_states, mlp_hidden_states, act)
        hidden_states = attn.to_out(hidden_states)

        return hidden_states


def _plain_swiglu(module) -> bool:
    """Whether calling `module` is diffusers' `Flux2SwiGLU.forward` with an `nn.SiLU` gate
    and nothing else (no hooks, no instance forward): what `sites.cat_act_site`'s
    "swiglu" computes."""
    return (type(module) is Flux2SwiGLU and "forward" not in module.__dict__ and sites.unhooked(module)
            and sites.plain_silu(module.gate_fn))


def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 `Flux2FeedForward.forward`, a stock `Flux2SwiGLU` through
    `sites.cat_act_site` (the SiLU and the product in one kernel)."""
    x = self.linear_in(x)
    # diffusers: x = self.act_fn(x)
    x = sites.cat_act_site(None, x, "swiglu") if _plain_swiglu(self.act_fn) else self.act_fn(x)
    x = self.linear_out(x)
    return x


#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    "Flux2TransformerBlock.forward": _block_forward,
    "Flux2SingleTransformerBlock.forward": _single_block_forward,
    "Flux2AttnProcessor.__call__": _AttnProcessor.__call__,
    "Flux2ParallelSelfAttnProcessor.__call__": _ParallelSelfAttnProcessor.__call__,
    "Flux2FeedForward.forward": _feed_forward,
}

#: stock attention processor class -> ours; any other processor (the KV-cache ones of the
#: Klein KV pipeline, a user's) is left alone
PROCESSORS = {Flux2AttnProcessor: _AttnProcessor, Flux2ParallelSelfAttnProcessor: _ParallelSelfAttnProcessor}

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
                  Flux2FeedForward: _feed_forward, **adaln.FORWARDS},
        processors=PROCESSORS,
        sites=_sites,
    )
