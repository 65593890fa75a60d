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

The text stream is never index-modulated.

The attention processor (`QwenDoubleStreamAttnProcessor2_0.__call__`) is copied too,
with one change: its four q/k RMSNorms (diffusers' `RMSNorm(128, eps=1e-6)` with a
weight, per head), the complex RoPE of each stream (`apply_rotary_emb_qwen(x, f,
use_real=False)`) and the text-first concatenation of query and key run in one
function, `qk_norm_rope`: one fused launch through `sites.joint_qk_norm_rope_site`,
which takes the modules' own calls, diffusers' rotation and `torch.cat` wherever its
guard refuses (and under torch.compile). A processor instance of exactly that class
switches `__class__` to the copy (keeping its attention backend and parallel config);
any other processor (a user's, a subclass) is left alone. Everything else (the
projections, the joint mask, the value concatenation, attention, the split and the
output projections) runs as diffusers runs it. Routed, the processor's only work
outside its GEMMs and attention is the value's `torch.cat` (one copy; at batch 1
`.to(dtype)` and the output slices' `.contiguous()` copy nothing): removing it would
mean writing both value projections into one buffer, which `nn.Linear` can't do
without another GEMM call than eager's.

The copies are valid only for the diffusers source they were taken from:
`accelerate` checks the diffusers version (0.42.x) and the sha256 of every
copied or reproduced function (`SOURCES`), and refuses otherwise unless `force=True`.
"""

from typing import Any

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm
from diffusers.models.transformers import transformer_qwenimage as _qwen_module
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
    apply_rotary_emb_qwen,
)

from .. import sites
from . import _install, adaln

__all__ = ["COPIES", "PROCESSORS", "SOURCES", "VERIFIED_SOURCES", "accelerate", "qk_norm_rope", "stock_functions"]

# ---------------------------------------------------------------- what was verified

#: sha256 of `inspect.getsource` of each diffusers function copied (or reproduced) here,
#: as shipped in diffusers 0.42.1. A mismatch means the copy may no longer be faithful.
VERIFIED_SOURCES = {
    "QwenImageTransformerBlock.forward": "89de238db44a7a47fb3977b20366118d2108a36ecde36be2c5d2d2c33658b609",
    # reproduced by _norm_modulate (its parameter selection; the modulation through the site)
    "QwenImageTransformerBlock._modulate": "9ee78b512057d504ae89f8e48b1c8c552aa29a8c0f214b5095766a963c5454d7",
    # the head's norm_out: the generic layer's copy (adaln.FORWARDS)
    "AdaLayerNormContinuous.forward": adaln.VERIFIED_SOURCES["AdaLayerNormContinuous.forward"],
    "QwenDoubleStreamAttnProcessor2_0.__call__": "e6dfad13458f15b376dfaa641bbd5b41669fc35f87dc030bc7be9737c1b1aed6",
    # reproduced by qk_norm_rope's fused kernel (the q/k norms and the RoPE of every block)
    "RMSNorm.forward": "ab9075d036873ac988795adb9a228b6d64cb0420123253ccb93d1d66bb323fd4",
    "apply_rotary_emb_qwen": "62c3cf93c5e4d4eb7814a163cf8cf1ead83dbc09bf099a0776a0f9ceea8682a4",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        "QwenImageTransformerBlock.forward": QwenImageTransformerBlock.forward,
        "QwenImageTransformerBlock._modulate": QwenImageTransformerBlock._modulate,
        "AdaLayerNormContinuous.forward": AdaLayerNormContinuous.forward,
        "QwenDoubleStreamAttnProcessor2_0.__call__": QwenDoubleStreamAttnProcessor2_0.__call__,
        "RMSNorm.forward": RMSNorm.forward,
        "apply_rotary_emb_qwen": apply_rotary_emb_qwen,
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


# ---------------------------------------------------------------- attention


def qk_norm_rope(attn, img_query, img_key, txt_query, txt_key, image_rotary_emb):
    """The q/k RMSNorms, RoPE and the text-first concatenation of query and key of a
    Qwen-Image joint attention, as diffusers computes them: in one fused launch where
    the kernel reproduces them (`sites.joint_qk_norm_rope_site`).

    attn: the block's `Attention`; its `norm_q` / `norm_k` (image) and `norm_added_q` /
        `norm_added_k` (text) are diffusers' `RMSNorm(head_dim, eps)` with a [head_dim]
        weight of the model's dtype (any of them None: diffusers' lines, unfused).
    img_query, img_key: [B, S_img, H, head_dim]; txt_query, txt_key: [B, S_txt, H, head_dim]
        (unflattened projection outputs), one dtype.
    image_rotary_emb: None, or (img_freqs, txt_freqs), complex64 [S_img, head_dim / 2]
        and [S_txt, head_dim / 2] (QwenEmbedRope / QwenEmbedLayer3DRope).
    Returns (joint_query, joint_key): [B, S_txt + S_img, H, head_dim] of the input dtype,
    `cat([rope(norm_added(txt), txt_freqs), rope(norm(img), img_freqs)], dim=1)` with
    diffusers' `apply_rotary_emb_qwen(x, f, use_real=False)`:
    `view_as_real(view_as_complex(x.float() pairs) * f).type_as(x)`."""
    norms = (attn.norm_added_q, attn.norm_added_k, attn.norm_q, attn.norm_k)
    if any(n is None for n in norms):  # qk_norm=None: nothing to fuse; diffusers' own lines
        if attn.norm_q is not None:
            img_query = attn.norm_q(img_query)
        if attn.norm_k is not None:
            img_key = attn.norm_k(img_key)
        if attn.norm_added_q is not None:
            txt_query = attn.norm_added_q(txt_query)
        if attn.norm_added_k is not None:
            txt_key = attn.norm_added_k(txt_key)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_query = apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)
            img_key = apply_rotary_emb_qwen(img_key, img_freqs, use_real=False)
            txt_query = apply_rotary_emb_qwen(txt_query, txt_freqs, use_real=False)
            txt_key = apply_rotary_emb_qwen(txt_key, txt_freqs, use_real=False)
        return torch.cat([txt_query, img_query], dim=1), torch.cat([txt_key, img_key], dim=1)
    sources = ((norms[0], norms[1], txt_query, txt_key), (norms[2], norms[3], img_query, img_key))
    if image_rotary_emb is None:
        return sites.joint_qk_norm_rope_site(sources, None, None)
    img_freqs, txt_freqs = image_rotary_emb
    # one launch: both streams normed in eager's reduction order, each rotated by its own freqs, written text first
    # (where the guard refuses: the modules' calls, diffusers' rotation and torch.cat, as above)
    return sites.joint_qk_norm_rope_site(sources, (txt_freqs, img_freqs), "complex")


class _AttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """diffusers 0.42.1 `QwenDoubleStreamAttnProcessor2_0.__call__`, the q/k norms, RoPE
    and the query/key concatenation through `qk_norm_rope`. A stock processor instance
    switches `__class__` to this one on accelerate (keeping its attention backend and
    parallel config) and back on restore."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.FloatTensor,  # Image stream
        encoder_hidden_states: torch.FloatTensor = None,  # Text stream
        encoder_hidden_states_mask: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.FloatTensor:
        if encoder_hidden_states is None:
            raise ValueError("QwenDoubleStreamAttnProcessor2_0 requires encoder_hidden_states (text stream)")

        if attention_mask is not None:
            raise ValueError(
                "QwenDoubleStreamAttnProcessor2_0 does not accept an external attention_mask. "
                "Pass encoder_hidden_states_mask to let the processor build the joint mask."
            )

        if encoder_hidden_states_mask is not None:
            seq_img = hidden_states.shape[1]
            image_mask = torch.ones((hidden_states.shape[0], seq_img), dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
            attention_mask = attention_mask[:, None, None, :]

        seq_txt = encoder_hidden_states.shape[1]

        # Compute QKV for image stream (sample projections)
        img_query = attn.to_q(hidden_states)
        img_key = attn.to_k(hidden_states)
        img_value = attn.to_v(hidden_states)

        # Compute QKV for text stream (context projections)
        txt_query = attn.add_q_proj(encoder_hidden_states)
        txt_key = attn.add_k_proj(encoder_hidden_states)
        txt_value = attn.add_v_proj(encoder_hidden_states)

        # Reshape by a fixed `head_dim` and let `-1` absorb the head count. Under tensor parallelism each rank
        # holds a column-sharded slice (`attn.heads // tp_degree` heads); this keeps the processor TP-agnostic.
        # The shared Attention has no `head_dim` attribute; derive it from the unsharded `inner_dim`/`heads`.
        head_dim = attn.inner_dim // attn.heads
        img_query = img_query.unflatten(-1, (-1, head_dim))
        img_key = img_key.unflatten(-1, (-1, head_dim))
        img_value = img_value.unflatten(-1, (-1, head_dim))

        txt_query = txt_query.unflatten(-1, (-1, head_dim))
        txt_key = txt_key.unflatten(-1, (-1, head_dim))
        txt_value = txt_value.unflatten(-1, (-1, head_dim))

        # Apply QK normalization
        # diffusers: if attn.norm_q is not None:
        # diffusers:     img_query = attn.norm_q(img_query)
        # diffusers: if attn.norm_k is not None:
        # diffusers:     img_key = attn.norm_k(img_key)
        # diffusers: if attn.norm_added_q is not None:
        # diffusers:     txt_query = attn.norm_added_q(txt_query)
        # diffusers: if attn.norm_added_k is not None:
        # diffusers:     txt_key = attn.norm_added_k(txt_key)
        # bitfuse: the norms, RoPE and the query/key concatenation below run in qk_norm_rope (one launch)

        # Apply RoPE
        # diffusers: if image_rotary_emb is not None:
        # diffusers:     img_freqs, txt_freqs = image_rotary_emb
        # diffusers:     img_query = apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)
        # diffusers:     img_key = apply_rotary_emb_qwen(img_key, img_freqs, use_real=False)
        # diffusers:     txt_query = apply_rotary_emb_qwen(txt_query, txt_freqs, use_real=False)
        # diffusers:     txt_key = apply_rotary_emb_qwen(txt_key, txt_freqs, use_real=False)

        # Concatenate for joint attention
        # Order: [text, image]
        # diffusers: joint_query = torch.cat([txt_query, img_query], dim=1)
        # diffusers: joint_key = torch.cat([txt_key, img_key], dim=1)
        joint_query, joint_key = qk_norm_rope(attn, img_query, img_key, txt_query, txt_key, image_rotary_emb)
        joint_value = torch.cat([txt_value, img_value], dim=1)

        # diffusers: joint_hidden_states = dispatch_attention_fn(
        joint_hidden_states = _qwen_module.dispatch_attention_fn(
            joint_query,
            joint_key,
            joint_value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )

        # Reshape back
        joint_hidden_states = joint_hidden_states.flatten(2, 3)
        joint_hidden_states = joint_hidden_states.to(joint_query.dtype)

        # Split attention outputs back
        txt_attn_output = joint_hidden_states[:, :seq_txt, :]  # Text part
        img_attn_output = joint_hidden_states[:, seq_txt:, :]  # Image part

        # Apply output projections
        img_attn_output = attn.to_out[0](img_attn_output.contiguous())
        if len(attn.to_out) > 1:
            img_attn_output = attn.to_out[1](img_attn_output)  # dropout

        txt_attn_output = attn.to_add_out(txt_attn_output.contiguous())

        return img_attn_output, txt_attn_output


#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    "QwenImageTransformerBlock.forward": _block_forward,
    "QwenDoubleStreamAttnProcessor2_0.__call__": _AttnProcessor.__call__,
}

#: stock attention processor class -> ours; a processor of any other class (a user's,
#: a subclass) is left alone
PROCESSORS = {QwenDoubleStreamAttnProcessor2_0: _AttnProcessor}

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
    its blocks, its `norm_out` and its stock attention processors; mark the blocks and
    `norm_out` as sites and mount `quality` (all or nothing). Returns the handle;
    called again with the same quality, the existing one. See `_install.accelerate` for the errors."""
    return _install.accelerate(
        model,
        _install.Handle,
        quality=quality,
        force=force,
        sources=SOURCES,
        model_class=QwenImageTransformer2DModel,
        forwards={QwenImageTransformerBlock: _block_forward,
                  AdaLayerNormContinuous: adaln.FORWARDS[AdaLayerNormContinuous]},
        processors=PROCESSORS,
        sites=_sites,
    )
