"""Sana (diffusers `SanaTransformer2DModel`): adaLN sites and the GLUMBConv epilogues routed through bitfuse.

diffusers computes Sana's adaLN in `SanaTransformerBlock.forward` (adaLN-single: one
timestep embedding [B, 6D] for all blocks, added to each block's `scale_shift_table`)
and in the head `SanaModulatedNorm.forward`; the feed-forward is `GLUMBConv`
(1x1 convolution, SiLU, 3x3 depthwise convolution, gated SiLU, 1x1 convolution). This
module carries faithful copies of the three forwards, line for line from diffusers
0.42.1, each replaced line kept above its replacement as a `# diffusers:` comment
(tests/test_copies.py checks the copies):

    norm1(x) * (1 + scale_msa) + shift_msa        -> sites.layer_norm_modulate_site(block, norm1, x, ...)
    norm2(x) * (1 + scale_mlp) + shift_mlp        -> sites.layer_norm_modulate_site(block, norm2, x, ...)
    x + gate_msa * attn_output                    -> sites.gated_residual_site(x, attn_output, gate_msa)
    x + gate_mlp * ff_output                      -> sites.gated_residual_site(x, ff_output, gate_mlp)
                                                     (products commute bitwise)
    norm_out: norm(x) * (1 + scale) + shift       -> sites.layer_norm_modulate_site(norm_out, norm, x, ...)
    GLUMBConv: nonlinearity(conv_inverted(x))     -> sites.conv_bias_silu_site(conv_inverted, nonlinearity, x)
               conv_depth, chunk(2), h * silu(g)  -> sites.conv_bias_glu_site(conv_depth, nonlinearity, x)

The norms are `nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)` (norm2 takes the
config's `norm_elementwise_affine`, False in every released Sana), each output
modulated once, so each norm and its modulation fuse into one site. The block's
`.to(hidden_states.dtype)` after the first modulation stays as diffusers wrote it (a
no-op when the parameters share x's dtype; with other dtypes the sites run eager's
promotion and the cast follows).

The parameters: `scale_shift_table[None] + timestep.reshape(B, 6, D)` is not
materialised in the blocks: each of its six [B, 1, D] chunks goes to the sites as
`Folded(table row, timestep view)`, the sum made in the kernels with eager's rounding
(`_modulation`; the timestep views once a forward, shared by all blocks). The head's
is materialised as diffusers does ([B, 2, D], chunked into views read in place).

The feed-forward's activations are the modulated tokens [B, H*W, D] viewed as NCHW
(`unflatten(1, (H, W)).permute(0, 3, 1, 2)`, no copy): a channels-last layout that
every convolution of GLUMBConv keeps, and that the epilogue kernels keep too (their
outputs take eager's strides), so `ff_output.flatten(2, 3).permute(0, 2, 1)` is again a
[B, H*W, D] view and the patch-token layout is materialised once, as in eager. cuDNN
runs every convolution (channels-last input), and eager adds both biases as separate
ops after it; the sites run the convolutions without their bias and the bias add, the
SiLU (and the gate's product) in one kernel each (`ops.conv_epilogue`, where the
backend question is written up), every choice verified at first sight against the
stock expression.

Layouts are part of exactness here. A first version of this routing differed from
stock on the H200 (44,572 of 65,536 output elements, every verdict "verified"): the
gate's first sight handed on its row-major check buffer where eager's result is
channels-last (the next depthwise convolution then took another aten backend, with
other bits), and the first block's gated residual wrote row-major where eager's result
keeps the patch embedding's transposed layout. The gate now hands on eager's own result
wherever the layouts differ and the pointwise planners send a permuted x to eager;
with both, the full Sana 1.6B (20 layers, B=2, 1024 x 1024) is bitwise stock in every
call (tests/gpu/test_sana_gpu.py, bench/results/sana-*.json).

Attention. `SanaLinearAttnProcessor2_0` (the self-attention) is copied too: between
the projections (and SANA 1.5's query/key RMSNorms, which run as diffusers runs them)
and `to_out`, its relus, fp32 casts, padded value, two matmuls and guarded division go
through `sites.linear_attention_site` (`ops.linear_attention`: the matmuls as eager runs
them, on the very operands eager's `torch.matmul` builds, the elementwise work around
them in two kernels). `SanaAttnProcessor2_0` (the cross-attention) is copied with
host-side changes that keep every bit: the caption mask is prepared once a forward for
all blocks (`_prepared_mask`: the same ops on the same tensor), the head views of q, k,
v and of the output are one `as_strided` call each (`_heads_view`, `_merged_heads`: the
stock views' shapes, strides and offsets), and the output is not divided by a
`rescale_output_factor` of 1.0 (x / 1.0 is x). Both processors
make their projections of one input as one GEMM (`sites.linear_projections_site`: the
self-attention's q, k, v; the caption's k, v), the weights packed end to end when
`accelerate` installs (the same Parameters and values; unpacked on restore), each
problem verified at first sight against the separate calls. Every block projects the
same caption tensor, so the caption's k and v of all blocks are one packed group: the
first block of a forward makes them in one GEMM and the later blocks take theirs from
the forward's memo (`_caption_projections`, `_install.forward_memo`: nothing is kept
past the forward). `Attention.forward` is
copied with the processor's parameter names cached (diffusers runs `inspect.signature`
on every call), and calls the processor directly when it has no keyword arguments to
filter (every call from Sana's blocks). Everything else runs as diffusers runs it:
Sana without CUDA graphs is host-bound (bench/NOTES.md), which is what these
host-side cuts are for.

A bias added apart. Eager adds the self-attention's `to_out` bias as an op of its own
(aten's `linear` on the linear attention's transposed output is a matmul, then `add_`).
The block gets that output as `Folded(bias, product)` (`sites.linear_bias_split`,
checked at first sight per geometry against the layer's own call; `_self_attention`
asks the processor copy for it), and the gated residual's kernel adds the bias with
eager's rounding: one elementwise op a block fewer. (`conv_point` has no bias.) The
depthwise convolution itself runs in the GLU epilogue's kernel, which sums its taps in
cuDNN's order (`ops.conv_epilogue.depthwise_glu`, verified per geometry by the gate).

The copies are valid only for the diffusers source they were taken from:
`accelerate` checks the diffusers version (0.42.x) and the sha256 of every copied
function (`SOURCES`), and refuses otherwise unless `force=True`.
"""

import weakref

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from diffusers.models import attention_processor as _attention_module
from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0
from diffusers.models.transformers.sana_transformer import (
    GLUMBConv,
    SanaAttnProcessor2_0,
    SanaModulatedNorm,
    SanaTransformer2DModel,
    SanaTransformerBlock,
)

from .. import sites
from . import _direct, _install

__all__ = ["COPIES", "SOURCES", "VERIFIED_SOURCES", "accelerate", "stock_functions"]

# ---------------------------------------------------------------- what was verified

#: sha256 of `inspect.getsource` of each diffusers function copied here, as shipped in 0.42.1
VERIFIED_SOURCES = {
    "SanaTransformerBlock.forward": "9a3e8db8963efea2640f6c87b42e718021238fb37c0eb128c3198fca2c150923",
    "GLUMBConv.forward": "841b583fd67676d3c6b992c4402a0a7d4c0e4245e4ae4d1766f0d029c2ef65aa",
    "SanaModulatedNorm.forward": "94f79629b4f9f9f33c9dd24ff2758a3ba2300668880b0a109f79f48c6aae7c80",
    "Attention.forward": "e6822ac3500626c7318b56f135752693a1222976154cbcc8c2e6b5f840d82b6b",
    "SanaLinearAttnProcessor2_0.__call__": "e75ae1143d56a89dbbf2e49e5d8ab48938680b93c146ac8a3f536b547cfb3106",
    "SanaAttnProcessor2_0.__call__": "01f4c3d5e7e6912bacb6179aaaaa9df2afbff7993d50fa13e8433c6bc4c8793c",
    "Attention.prepare_attention_mask": "350c128ad2f921c5252b4b075f69af1aec85c3b030f4f508fb5a73c1bc58d93a",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        "SanaTransformerBlock.forward": SanaTransformerBlock.forward,
        "GLUMBConv.forward": GLUMBConv.forward,
        "SanaModulatedNorm.forward": SanaModulatedNorm.forward,
        "Attention.forward": Attention.forward,
        "SanaLinearAttnProcessor2_0.__call__": SanaLinearAttnProcessor2_0.__call__,
        "SanaAttnProcessor2_0.__call__": SanaAttnProcessor2_0.__call__,
        "Attention.prepare_attention_mask": Attention.prepare_attention_mask,
    }


# ---------------------------------------------------------------- the copies


def _block_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    timestep: torch.LongTensor | None = None,
    height: int = None,
    width: int = None,
) -> torch.Tensor:
    """diffusers 0.42.1 `SanaTransformerBlock.forward`, adaLN sites routed through bitfuse."""
    batch_size = hidden_states.shape[0]

    # 1. Modulation
    # diffusers: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
    # diffusers:     self.scale_shift_table[None] + timestep.reshape(batch_size, 6, -1)
    # diffusers: ).chunk(6, dim=1)
    # bitfuse: the six as Folded(table row, timestep view), added in the sites' kernels (`_modulation`)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _modulation(
        self.scale_shift_table, timestep, batch_size
    )

    # 2. Self Attention
    # diffusers: norm_hidden_states = self.norm1(hidden_states)
    # diffusers: norm_hidden_states = norm_hidden_states * (1 + scale_msa) + shift_msa
    norm_hidden_states = sites.layer_norm_modulate_site(self, self.norm1, hidden_states, scale_msa, shift_msa)
    # diffusers: norm_hidden_states = norm_hidden_states.to(hidden_states.dtype)
    # bitfuse: .to of its own dtype returns the tensor itself: called to change it (and traced as stock)
    if norm_hidden_states.dtype != hidden_states.dtype or torch.compiler.is_compiling():
        norm_hidden_states = norm_hidden_states.to(hidden_states.dtype)

    # diffusers: attn_output = self.attn1(norm_hidden_states)
    # bitfuse: to_out's bias may come back not added (a Folded), for the gated residual's kernel (`_self_attention`)
    attn_output = _self_attention(self.attn1, norm_hidden_states)
    # diffusers: hidden_states = hidden_states + gate_msa * attn_output
    hidden_states = sites.gated_residual_site(hidden_states, attn_output, gate_msa)

    # 3. Cross Attention
    if self.attn2 is not None:
        # diffusers: attn_output = self.attn2(
        attn_output = _direct.call(
            self.attn2,
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=encoder_attention_mask,
        )
        hidden_states = attn_output + hidden_states

    # 4. Feed-forward
    # diffusers: norm_hidden_states = self.norm2(hidden_states)
    # diffusers: norm_hidden_states = norm_hidden_states * (1 + scale_mlp) + shift_mlp
    norm_hidden_states = sites.layer_norm_modulate_site(self, self.norm2, hidden_states, scale_mlp, shift_mlp)

    # diffusers: norm_hidden_states = norm_hidden_states.unflatten(1, (height, width)).permute(0, 3, 1, 2)
    norm_hidden_states = _tokens_as_nchw(norm_hidden_states, height, width)
    # diffusers: ff_output = self.ff(norm_hidden_states)
    ff_output = _direct.call(self.ff, norm_hidden_states)
    # diffusers: ff_output = ff_output.flatten(2, 3).permute(0, 2, 1)
    ff_output = _nchw_as_tokens(ff_output)
    # diffusers: hidden_states = hidden_states + gate_mlp * ff_output
    hidden_states = sites.gated_residual_site(hidden_states, ff_output, gate_mlp)

    return hidden_states


#: a block's scale_shift_table -> (its storage's address, its six rows as views)
_table_rows = WeakIdKeyDictionary()


def _modulation(table, timestep, batch_size):
    """`(table[None] + timestep.reshape(batch_size, 6, -1)).chunk(6, dim=1)`: six
    [B, 1, D] parameters, as `sites.Folded(table[i], timestep view i)` (each one's
    `value()` is that chunk, bit for bit: the same elementwise sum, the same type
    promotion), which the sites' kernels add on the fly with eager's rounding, so
    no block runs the add and the chunk. The timestep views are made once a forward
    for all blocks (the forward's memo: the same tensor, not modified since), the
    table rows once per table (while its data stays where and as it was: address,
    shape, strides, dtype, device), each with its call-key metadata (`sites.folded_with_meta`). Under tracing,
    with autograd recording (the cached rows are no-grad views), or for a table that is
    not [6, D] of the timestep's width, as stock computes it."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or table.dim() != 2 or table.shape[0] != 6 \
            or timestep.dim() != 2 or timestep.shape[0] != batch_size or timestep.shape[1] != 6 * table.shape[1]:
        return (table[None] + timestep.reshape(batch_size, 6, -1)).chunk(6, dim=1)
    memo = _install.forward_memo()
    views = None
    if memo is not None:
        hit = memo.get("sana modulation")
        if hit is not None and hit[0] is timestep and hit[1] == _install.version_of(timestep):
            views = hit[2]
    if views is None:
        views = timestep.reshape(batch_size, 6, -1).chunk(6, dim=1)
        views = tuple((v, sites.tensor_meta(v)) for v in views)
        if memo is not None:
            memo["sana modulation"] = (timestep, _install.version_of(timestep), views)
    rows = _table_rows.get(table)
    where = (table.data_ptr(), *sites.tensor_meta(table))  # (a narrower slice at the same address: new rows)
    if rows is None or rows[0] != where:
        # (rows of a detached alias: views of the Parameter itself would keep it, the key, alive)
        rows = _table_rows[table] = (where, tuple((r, sites.tensor_meta(r)) for r in table.detach().unbind(0)))
    # (our own views, held by no one else: their call-key metadata made once, `sites.folded_with_meta`)
    return tuple(sites.folded_with_meta(r, v, rm, vm) for (r, rm), (v, vm) in zip(rows[1], views))


def _tokens_as_nchw(x, height, width):
    """`x.unflatten(1, (height, width)).permute(0, 3, 1, 2)` for x [B, H*W, D]: the same
    view in one call (`as_strided` with the strides those two views give) outside
    tracing."""
    if torch.compiler.is_compiling() or x.dim() != 3 or x.shape[1] != height * width:
        return x.unflatten(1, (height, width)).permute(0, 3, 1, 2)
    sb, sn, sd = x.stride()
    return x.as_strided((x.shape[0], x.shape[2], height, width), (sb, sd, width * sn, sn), x.storage_offset())


def _self_attention(attn, x):
    """`attn(x)`, a block's self-attention. Where nothing steps into the call and it runs
    our forward and processor, the processor is called as that forward calls it, with
    `defer_bias`: to_out's output may come back as `Folded(bias, product)` (where eager
    adds the bias as an op of its own: `sites.linear_bias_split`), whose `value()` is
    the tensor `attn(x)` returns; else `attn(x)`."""
    forward = attn.__dict__.get("forward")
    if getattr(forward, "__func__", None) is _attention_forward and type(attn.processor) is _LinearAttnProcessor \
            and _direct.plain(attn):
        return attn.processor(attn, x, encoder_hidden_states=None, attention_mask=None, defer_bias=True)
    return _direct.call(attn, x)


def _nchw_as_tokens(y):
    """`y.flatten(2, 3).permute(0, 2, 1)` for y [B, C, H, W]: the same view in one call
    where the flatten is a view (W's stride times W is H's, as in the channels-last
    output of GLUMBConv), outside tracing; else those two calls (a flatten that copies)."""
    if torch.compiler.is_compiling() or y.dim() != 4:
        return y.flatten(2, 3).permute(0, 2, 1)
    sb, sc, sh, sw = y.stride()
    if sh != sw * y.shape[3]:
        return y.flatten(2, 3).permute(0, 2, 1)
    return y.as_strided((y.shape[0], y.shape[2] * y.shape[3], y.shape[1]), (sb, sw, sc), y.storage_offset())


def _heads_view(t, batch_size, heads, head_dim):
    """`t.view(batch_size, -1, heads, head_dim).transpose(1, 2)` for t [B, N, heads *
    head_dim]: the same view (shape, strides, offset) in one `as_strided` call outside
    tracing; the two calls where a size of 1 (whose stride `view` may pick otherwise)
    or another shape is involved."""
    if torch.compiler.is_compiling() or t.dim() != 3 or t.shape[0] != batch_size or batch_size < 2 \
            or t.shape[1] < 2 or heads < 2 or head_dim < 2 or t.shape[2] != heads * head_dim:
        return t.view(batch_size, -1, heads, head_dim).transpose(1, 2)
    sb, sn, sd = t.stride()
    return t.as_strided((batch_size, heads, t.shape[1], head_dim), (sb, head_dim * sd, sn, sd), t.storage_offset())


def _merged_heads(o, batch_size, inner_dim):
    """`o.transpose(1, 2).reshape(batch_size, -1, inner_dim)` for the attention output o
    [B, heads, N, head_dim]: one `as_strided` call where that reshape is a view (heads
    and head_dim adjacent in memory, as SDPA's backends lay them out), outside tracing;
    else the two calls (a reshape that copies)."""
    if torch.compiler.is_compiling() or o.dim() != 4 or o.shape[0] != batch_size or batch_size < 2:
        return o.transpose(1, 2).reshape(batch_size, -1, inner_dim)
    b, h, n, d = o.shape
    sb, sh, sn, sd = o.stride()
    if h < 2 or n < 2 or d < 2 or h * d != inner_dim or sh != d * sd:
        return o.transpose(1, 2).reshape(batch_size, -1, inner_dim)
    return o.as_strided((b, n, inner_dim), (sb, sn, sd), o.storage_offset())


def _glumbconv_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 `GLUMBConv.forward`, the two convolution epilogues through bitfuse."""
    if self.residual_connection:
        residual = hidden_states

    # diffusers: hidden_states = self.conv_inverted(hidden_states)
    # diffusers: hidden_states = self.nonlinearity(hidden_states)
    hidden_states = sites.conv_bias_silu_site(self.conv_inverted, self.nonlinearity, hidden_states)

    # diffusers: hidden_states = self.conv_depth(hidden_states)
    # diffusers: hidden_states, gate = torch.chunk(hidden_states, 2, dim=1)
    # diffusers: hidden_states = hidden_states * self.nonlinearity(gate)
    hidden_states = sites.conv_bias_glu_site(self.conv_depth, self.nonlinearity, hidden_states)

    # diffusers: hidden_states = self.conv_point(hidden_states)
    hidden_states = _direct.call(self.conv_point, hidden_states)

    if self.norm_type == "rms_norm":
        # move channel to the last dimension so we apply RMSnorm across channel dimension
        hidden_states = self.norm(hidden_states.movedim(1, -1)).movedim(-1, 1)

    if self.residual_connection:
        hidden_states = hidden_states + residual

    return hidden_states


def _modulated_norm_forward(
    self, hidden_states: torch.Tensor, temb: torch.Tensor, scale_shift_table: torch.Tensor
) -> torch.Tensor:
    """diffusers 0.42.1 `SanaModulatedNorm.forward`, the norm and its modulation through bitfuse."""
    # diffusers: hidden_states = self.norm(hidden_states)
    # bitfuse: the norm moves into the site below (a pure function of hidden_states: the same bits)
    shift, scale = (scale_shift_table[None] + temb[:, None].to(scale_shift_table.device)).chunk(2, dim=1)
    # diffusers: hidden_states = hidden_states * (1 + scale) + shift
    hidden_states = sites.layer_norm_modulate_site(self, self.norm, hidden_states, scale, shift)
    return hidden_states


class _LinearAttnProcessor(SanaLinearAttnProcessor2_0):
    """diffusers 0.42.1 `SanaLinearAttnProcessor2_0.__call__`, the work around its two
    matmuls through bitfuse (`sites.linear_attention_site`)."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        # bitfuse: for the block's gated residual (`_self_attention`): to_out's bias may be left to its kernel
        defer_bias: bool = False,
    ) -> torch.Tensor:
        original_dtype = hidden_states.dtype

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        # diffusers: query = attn.to_q(hidden_states)
        # diffusers: key = attn.to_k(encoder_hidden_states)
        # diffusers: value = attn.to_v(encoder_hidden_states)
        # bitfuse: the three as one GEMM where they read the same tokens (weights packed at install)
        if encoder_hidden_states is hidden_states:
            query, key, value = sites.linear_projections_site(hidden_states, attn.to_q, attn.to_k, attn.to_v,
                                                              call=_direct.call)
        else:
            query = _direct.call(attn.to_q, hidden_states)
            key, value = sites.linear_projections_site(encoder_hidden_states, attn.to_k, attn.to_v,
                                                       call=_direct.call)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # diffusers: query = query.transpose(1, 2).unflatten(1, (attn.heads, -1))
        # diffusers: key = key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)
        # diffusers: value = value.transpose(1, 2).unflatten(1, (attn.heads, -1))
        # diffusers: query = F.relu(query)
        # diffusers: key = F.relu(key)
        # diffusers: query, key, value = query.float(), key.float(), value.float()
        # diffusers: value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)
        # diffusers: scores = torch.matmul(value, key)
        # diffusers: hidden_states = torch.matmul(scores, query)
        # diffusers: hidden_states = hidden_states[:, :, :-1] / (hidden_states[:, :, -1:] + 1e-15)
        # diffusers: hidden_states = hidden_states.flatten(1, 2).transpose(1, 2)
        # diffusers: hidden_states = hidden_states.to(original_dtype)
        hidden_states = sites.linear_attention_site(query, key, value, attn.heads, original_dtype)

        # diffusers: hidden_states = attn.to_out[0](hidden_states)
        # diffusers: hidden_states = attn.to_out[1](hidden_states)
        # bitfuse: with `defer_bias`, where to_out[1] is the identity and no fp16 clip follows, to_out[0]'s
        # bitfuse: bias is left to the caller's kernel where eager adds it as an op of its own
        dropout = _direct.item(attn.to_out, 1)
        if defer_bias and original_dtype != torch.float16 and _direct.identity(dropout):
            return sites.linear_bias_split(_direct.item(attn.to_out, 0), hidden_states)
        hidden_states = _direct.call(_direct.item(attn.to_out, 0), hidden_states)
        hidden_states = _direct.call(dropout, hidden_states)

        if original_dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)

        return hidden_states


class _CrossAttnProcessor(SanaAttnProcessor2_0):
    """diffusers 0.42.1 `SanaAttnProcessor2_0.__call__`: the caption mask prepared once
    for all blocks (`_prepared_mask`), every block's caption k, v made at the first
    (`_caption_projections`), the head views as one call each, and no division by a
    `rescale_output_factor` of 1."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            # diffusers: attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # diffusers: # scaled_dot_product_attention expects attention_mask shape to be
            # diffusers: # (batch, heads, source_length, target_length)
            # diffusers: attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
            attention_mask = _prepared_mask(attn, attention_mask, sequence_length, batch_size)

        # diffusers: query = attn.to_q(hidden_states)
        query = _direct.call(attn.to_q, hidden_states)

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        # diffusers: key = attn.to_k(encoder_hidden_states)
        # diffusers: value = attn.to_v(encoder_hidden_states)
        # bitfuse: every block's caption k and v as one GEMM, at the first block of a forward (weights packed
        # bitfuse: at install), else this block's two as one
        key, value = _caption_projections(attn, encoder_hidden_states)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        # diffusers: query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        query = _heads_view(query, batch_size, attn.heads, head_dim)

        # diffusers: key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        # diffusers: value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = _heads_view(key, batch_size, attn.heads, head_dim)
        value = _heads_view(value, batch_size, attn.heads, head_dim)

        # the output of sdp = (batch, num_heads, seq_len, head_dim)
        # TODO: add support for attn.scale when we move to Torch 2.1
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )

        # diffusers: hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = _merged_heads(hidden_states, batch_size, attn.heads * head_dim)
        # diffusers: hidden_states = hidden_states.to(query.dtype)
        # bitfuse: .to of its own dtype returns the tensor itself: called to change it (and traced as stock)
        if hidden_states.dtype != query.dtype or torch.compiler.is_compiling():
            hidden_states = hidden_states.to(query.dtype)

        # linear proj
        # diffusers: hidden_states = attn.to_out[0](hidden_states)
        hidden_states = _direct.call(_direct.item(attn.to_out, 0), hidden_states)
        # dropout
        # diffusers: hidden_states = attn.to_out[1](hidden_states)
        hidden_states = _direct.call(_direct.item(attn.to_out, 1), hidden_states)

        # diffusers: hidden_states = hidden_states / attn.rescale_output_factor
        # bitfuse: x / 1.0 is x, bit for bit (NaN stays NaN): divided only by another factor (or traced as stock)
        if attn.rescale_output_factor != 1.0 or torch.compiler.is_compiling():
            hidden_states = hidden_states / attn.rescale_output_factor

        return hidden_states


#: a cross-attention (`attn2`) -> (every block's caption linears: to_k, to_v, block by block; its to_k's index)
_captions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _caption_projections(attn, encoder_hidden_states):
    """`(attn.to_k(c), attn.to_v(c))` for the caption c. Every block of a forward projects
    the same caption tensor, so where the model's caption linears lie packed (one group
    at install: `_caption_linears`) the first block makes all of them in one GEMM
    (`sites.linear_projections_site`, verified against the separate calls) and the
    forward's memo (`_install.forward_memo`) hands each later block its two: the same
    values, computed earlier. Kept for the caption tensor it was made from (`is`, not
    modified since: its version), and handed to a block only while its own weights and
    biases are the ones they were (the same storage, not modified since: something run
    between the blocks, such as a hook, may change them); a second miss in one forward
    (blocks given other captions) stops it for that forward. Elsewhere (not packed, as
    after `.to()`; no accelerated forward around the call; tracing) this block's two as
    one GEMM."""
    entry = memo = None
    if not torch.compiler.is_compiling():  # (traced: the plain calls, as the site makes them there)
        entry, memo = _captions.get(attn), _install.forward_memo()
    if entry is not None and memo is not None and not encoder_hidden_states.is_inference():
        # (an inference tensor has no version to key on: each block its own two, as below)
        linears, i = entry
        to_k, to_v = attn.to_k, attn.to_v
        if linears[i] is to_k and linears[i + 1] is to_v:
            key = ("sana caption projections", id(linears))
            hit = memo.get(key)
            c = encoder_hidden_states
            if hit is None or (hit is not False and (hit[0] is not c or hit[1] != c._version)):
                if hit is None and sites.linears_packed(*linears):
                    params = _parameters_state(linears)
                    memo[key] = hit = (c, c._version, sites.linear_projections_site(c, *linears, call=_direct.call),
                                       params)
                else:
                    memo[key] = hit = False
            if hit is not False and hit[3][i] == _parameter_state(to_k) and hit[3][i + 1] == _parameter_state(to_v):
                return hit[2][i], hit[2][i + 1]
    return sites.linear_projections_site(encoder_hidden_states, attn.to_k, attn.to_v, call=_direct.call)


def _parameter_state(linear):
    """Where a linear's weight and bias lie and their versions (in-place changes)."""
    p = linear._parameters
    w, b = p["weight"], p["bias"]
    v = _install.version_of
    return (w.data_ptr(), v(w)) if b is None else (w.data_ptr(), v(w), b.data_ptr(), v(b))


def _parameters_state(linears):
    return [_parameter_state(m) for m in linears]


def _caption_linears(model):
    """Every block's cross-attention to_k and to_v, block by block, where every block has
    a cross-attention running our processor; else None."""
    attns = [getattr(block, "attn2", None) for block in model.transformer_blocks]
    if not attns or any(not isinstance(a, Attention) or type(a.processor) is not _CrossAttnProcessor for a in attns):
        return None
    return tuple(m for a in attns for m in (a.to_k, a.to_v))


_masks: dict = {}  # (heads, target length, batch size) -> (the mask, its version, the prepared mask)


def _prepared_mask(attn, attention_mask, sequence_length, batch_size):
    """`attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)` viewed
    as [B, heads, -1, L], as every block's cross-attention prepares the model's caption
    mask. Kept for the last mask seen: a later call with the same tensor (`is`, not
    modified since: its version), heads, length and batch size gets the same prepared
    tensor, so a forward's blocks prepare it once (eager: one repeat_interleave a block,
    the same values). Not kept under tracing, or where `prepare_attention_mask` is not
    diffusers' own."""
    key = (attn.heads, sequence_length, batch_size)
    cached = not torch.compiler.is_compiling() and type(attn).prepare_attention_mask is _STOCK_PREPARE and \
        "prepare_attention_mask" not in attn.__dict__
    if cached:
        hit = _masks.get(key)
        if hit is not None and hit[0] is attention_mask and hit[1] == _install.version_of(attention_mask):
            return hit[2]
    prepared = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
    prepared = prepared.view(batch_size, attn.heads, -1, prepared.shape[-1])
    if cached:
        if len(_masks) > 8:
            _masks.clear()
        _masks[key] = (attention_mask, _install.version_of(attention_mask), prepared)
    return prepared


_STOCK_PREPARE = Attention.prepare_attention_mask


def _attention_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **cross_attention_kwargs,
) -> torch.Tensor:
    """diffusers 0.42.1 `Attention.forward`, with the processor's parameter names cached
    for bitfuse's processor classes: diffusers runs `inspect.signature` on every call
    (the same names, the same filtering and warning), and not looked up at all for a
    call without keyword arguments (nothing to filter)."""
    # The `Attention` class can call different attention processors / attention functions
    # here we simply pass along all tensors to the selected processor class
    # For standard processors that are defined here, `**cross_attention_kwargs` is empty

    # bitfuse: no keyword arguments (every call Sana's blocks make): nothing to filter or warn
    # bitfuse: about, the processor's call below as it would be made with an empty dict
    if not cross_attention_kwargs:
        return self.processor(self, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=attention_mask)
    # diffusers: attn_parameters = set(inspect.signature(self.processor.__call__).parameters.keys())
    # bitfuse: cached for the processor classes whose __call__ is a plain method (no instance override)
    attn_parameters = _install.processor_parameters(self.processor, _CACHEABLE)
    quiet_attn_parameters = {"ip_adapter_masks", "ip_hidden_states"}
    unused_kwargs = [
        k for k, _ in cross_attention_kwargs.items() if k not in attn_parameters and k not in quiet_attn_parameters
    ]
    if len(unused_kwargs) > 0:
        # diffusers: logger.warning(
        _attention_module.logger.warning(
            f"cross_attention_kwargs {unused_kwargs} are not expected by {self.processor.__class__.__name__} and will be ignored."
        )
    cross_attention_kwargs = {k: w for k, w in cross_attention_kwargs.items() if k in attn_parameters}

    return self.processor(
        self,
        hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        attention_mask=attention_mask,
        **cross_attention_kwargs,
    )


#: stock processor class -> ours; a processor of any other class (a user's) is left alone
_PROCESSORS = {SanaLinearAttnProcessor2_0: _LinearAttnProcessor, SanaAttnProcessor2_0: _CrossAttnProcessor}
_CACHEABLE = frozenset(_PROCESSORS) | frozenset(_PROCESSORS.values())  # __call__ signatures known not to change

#: stock class -> our copy of its forward
FORWARDS = {
    SanaTransformerBlock: _block_forward,
    GLUMBConv: _glumbconv_forward,
    SanaModulatedNorm: _modulated_norm_forward,
    Attention: _attention_forward,
}

#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {
    **{f"{cls.__name__}.forward": fn for cls, fn in FORWARDS.items()},
    "SanaLinearAttnProcessor2_0.__call__": _LinearAttnProcessor.__call__,
    "SanaAttnProcessor2_0.__call__": _CrossAttnProcessor.__call__,
}

SOURCES = _install.CopiedSources(
    "Sana", release="0.42", copied_from="0.42.1", sha256=VERIFIED_SOURCES, stock=stock_functions,
    copies=lambda: COPIES,
)


# ---------------------------------------------------------------- accelerate


def _projections(model) -> list:
    """The linears the attention copies hand `sites.linear_projections_site` together:
    each self-attention's q, k, v (one input), and every block's caption k, v (the same
    caption tensor in every block: `_caption_projections`)."""
    groups = [(b.attn1.to_q, b.attn1.to_k, b.attn1.to_v) for b in model.transformer_blocks
              if isinstance(b.attn1, Attention) and type(b.attn1.processor) is _LinearAttnProcessor]
    caption = _caption_linears(model)
    return groups + ([caption] if caption else [])


def _sites(model) -> list:
    blocks = [(f"transformer_blocks.{i}", b, (b.norm1, b.norm2)) for i, b in enumerate(model.transformer_blocks)]
    return blocks + [("norm_out", model.norm_out, (model.norm_out.norm,))]


def accelerate(model, *, quality: str = "lossless", force: bool = False) -> _install.Handle:
    """Install bitfuse's faithful forwards on `model` (a `SanaTransformer2DModel`): its
    blocks, their attentions (forward and processors) and GLUMBConv feed-forwards, and
    its `norm_out`; mark the blocks and the
    head as sites and mount `quality` (all or nothing; the convolution epilogues are
    exact in every tier). Returns the handle; called again with the same quality, the
    existing one. See `_install.accelerate` for the errors."""
    handle = _install.accelerate(
        model,
        _install.Handle,
        quality=quality,
        force=force,
        sources=SOURCES,
        model_class=SanaTransformer2DModel,
        forwards=FORWARDS,
        processors=_PROCESSORS,
        sites=_sites,
        projections=_projections,
    )
    handle.on_restore(_masks.clear)  # the prepared caption mask, and the tensors it holds
    caption = _caption_linears(model)
    if caption is not None and model.transformer_blocks[0].attn2 not in _captions:
        attns = [block.attn2 for block in model.transformer_blocks]
        for i, attn in enumerate(attns):
            _captions[attn] = (caption, 2 * i)

        def forget():
            for attn in attns:
                _captions.pop(attn, None)

        handle.on_restore(forget)
    return handle
