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
    h = torch.cat([attn_output, act_mlp(mlp)], dim=2)   (single block, act_mlp a plain
                                      nn.GELU(approximate="tanh"))
                                   -> sites.cat_act_site(attn_output, mlp, "gelu_tanh", dim=2)

The gated residuals are eager's two roundings (the product, then the sum); the
product commutes bitwise, so `gate * y` is the site's `y * gate`.

The attention processor (`FluxAttnProcessor`) is copied too, with one change: its
q/k RMSNorms (weighted), the text-first concatenation of query and key and RoPE
run in one function, `qk_norm_rope`, which today calls diffusers' own modules and
`apply_rotary_emb` (the same bits) and is where a fused q/k-norm + RoPE op joins.
A processor instance switches `__class__` to the copy, keeping its backend
settings; any other processor (IP-Adapter's, a user's) is left alone.

`accelerate` checks the diffusers version (0.42.x) and the sha256 of every copied
function (`SOURCES`, the adaLN copies included), and refuses otherwise unless `force=True`.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux as _flux_module
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)

from .. import sites
from . import _install, adaln

__all__ = [
    "VERIFIED_SOURCES",
    "COPIES",
    "SOURCES",
    "PROCESSORS",
    "FluxHandle",
    "accelerate",
    "qk_norm_rope",
    "stock_functions",
]

#: sha256 of `inspect.getsource` of each diffusers function copied here (and by `adaln`),
#: as shipped in diffusers 0.42.1
VERIFIED_SOURCES = {
    **adaln.VERIFIED_SOURCES,
    "FluxTransformerBlock.forward": "0b184cbe172708b6f072a779e13866a44ef5a8ee706fcd3e6887923b11c00785",
    "FluxSingleTransformerBlock.forward": "57350a6dab842b40e0d677b9c42794c17e45907ad45991d36dba69d89096a37b",
    "FluxAttnProcessor.__call__": "d5b36134887ebe450b6c15f200bf33f781ba8258201d25caceb16bb9bc07d2c9",
    # qk_norm_rope reproduces it (the RoPE of every FLUX.1 and FLUX.2 attention)
    "apply_rotary_emb": "a25267d425f8c5eaa84151b6914e988cdd0ad0b857bb74495477a3644c819164",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        **adaln.stock_functions(),
        "FluxTransformerBlock.forward": FluxTransformerBlock.forward,
        "FluxSingleTransformerBlock.forward": FluxSingleTransformerBlock.forward,
        "FluxAttnProcessor.__call__": FluxAttnProcessor.__call__,
        "apply_rotary_emb": apply_rotary_emb,
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
    # bitfuse: the site's x + y * gate: the product (commuted: the same IEEE product), then the sum, one rounding each
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
    """diffusers 0.42.1 `FluxSingleTransformerBlock.forward`, the MLP's tanh GELU and the
    concatenation through `sites.cat_act_site` and the gated residual through bitfuse
    (norm is an adaLN module: see `adaln`)."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    # diffusers: mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
    # bitfuse: a plain tanh GELU runs in the concatenation below (sites.cat_act_site); any other act_mlp here
    mlp_hidden_states = self.proj_mlp(norm_hidden_states)
    act = "gelu_tanh" if sites.plain_gelu_tanh(self.act_mlp) else None
    if act is None:
        mlp_hidden_states = self.act_mlp(mlp_hidden_states)
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    # diffusers: hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
    # bitfuse: the GELU and the concatenation in one kernel: the same values, eager's contiguous layout
    hidden_states = sites.cat_act_site(attn_output, mlp_hidden_states, act, dim=2)
    gate = gate.unsqueeze(1)
    # diffusers: hidden_states = gate * self.proj_out(hidden_states)
    # diffusers: hidden_states = residual + hidden_states
    # bitfuse: the site's x + y * gate: the product (commuted: the same IEEE product), then the sum, one rounding each
    hidden_states = sites.gated_residual_site(residual, self.proj_out(hidden_states), gate)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


# ---------------------------------------------------------------- attention


def qk_norm_rope(attn, query, key, encoder_query, encoder_key, image_rotary_emb):
    """The q/k RMSNorm and RoPE of a FLUX.1 / FLUX.2 attention, as diffusers computes them:
    in one fused launch where the kernels reproduce them (`sites.joint_qk_norm_rope_site`).

    attn: the attention module; its `norm_q` / `norm_k` (and, with a text stream,
        `norm_added_q` / `norm_added_k`) are `torch.nn.RMSNorm(head_dim, eps=1e-6)` with
        a [head_dim] weight (the model's dtype).
    query, key: [B, S_img, H, head_dim] image-stream projections (unflattened views of the
        projection output, or of its chunks for fused projections).
    encoder_query, encoder_key: [B, S_txt, H, head_dim] text-stream projections, or None
        (single-stream blocks: the text is already part of query/key).
    image_rotary_emb: None, or (cos, sin), each [S_txt + S_img, head_dim] fp32 (FluxPosEmbed
        over `cat(txt_ids, img_ids)`: interleaved pairs, cos/sin repeated per pair), for the
        text-first concatenation.
    Returns (query, key): [B, S_txt + S_img, H, head_dim] of the input dtype, text first:
    `rope(cat(norm_added(enc), norm(x)))` per diffusers' `apply_rotary_emb(x, (cos, sin),
    sequence_dim=1)`: `(x.float() * cos + rotated.float() * sin).to(x.dtype)`, rotated
    pairs `(-x1, x0)`."""
    sources = [(attn.norm_q, attn.norm_k, query, key)]
    if encoder_query is not None:
        sources.insert(0, (attn.norm_added_q, attn.norm_added_k, encoder_query, encoder_key))
    # one launch: both streams normed in aten's order, concatenated and rotated (sites.joint_qk_norm_rope_site;
    # where its planner refuses, the modules' own calls, torch.cat and diffusers' apply_rotary_emb, as above)
    rope = None if image_rotary_emb is None else "interleaved"
    return sites.joint_qk_norm_rope_site(sources, image_rotary_emb, rope)


class _AttnProcessor(FluxAttnProcessor):
    """diffusers 0.42.1 `FluxAttnProcessor.__call__`, the q/k norms and RoPE through
    `qk_norm_rope`. A FluxAttnProcessor instance switches `__class__` to this one on
    accelerate (keeping its attention backend) and back on restore."""

    def __call__(
        self,
        attn: "FluxAttention",
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # diffusers: query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
        query, key, value, encoder_query, encoder_key, encoder_value = _flux_module._get_qkv_projections(
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
        hidden_states = _flux_module.dispatch_attention_fn(
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
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())

            return hidden_states, encoder_hidden_states
        else:
            return hidden_states


#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    "FluxTransformerBlock.forward": _block_forward,
    "FluxSingleTransformerBlock.forward": _single_block_forward,
    "FluxAttnProcessor.__call__": _AttnProcessor.__call__,
}

#: stock attention processor class -> ours; a processor of any other class (IP-Adapter's,
#: a user's) is left alone
PROCESSORS = {FluxAttnProcessor: _AttnProcessor}

SOURCES = _install.CopiedSources(
    "FLUX.1", release="0.42", copied_from="0.42.1", sha256=VERIFIED_SOURCES, stock=stock_functions,
    copies=lambda: COPIES,
)


# ---------------------------------------------------------------- accelerate


class FluxHandle(adaln.AdaLNHandle):
    """What `accelerate` installed on one FLUX.1 transformer (see `_install.Handle`);
    `routed` counts the marked modules by class."""


def _sites(model) -> list:
    blocks = [(f"transformer_blocks.{i}", b, (b.norm2, b.norm2_context))
              for i, b in enumerate(model.transformer_blocks)]
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
