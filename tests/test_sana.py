"""Sana (diffusers SanaTransformer2DModel): bitfuse's forwards are faithful.

On CPU every site falls back to its eager expression, so bitwise equality between
the accelerated and the stock model (built from the same seed) checks that
bitfuse's copies of the block forward, GLUMBConv and the head compute exactly what
diffusers computes, with every adaLN site and both convolution epilogues of GLUMBConv
(conv_bias_silu_site, conv_bias_glu_site) routed through bitfuse (counted below). One
test runs the real kernels through the gate in Triton's interpreter."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import re
import threading
import types
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse
from diffusers.models.attention_processor import Attention
from bitfuse import policy, sites
from bitfuse.models import UnsupportedVersionError, sana
from bitfuse.models.sana_configs import (
    VARIANTS,
    build_model,
    full_config,
    image_tokens,
    make_inputs,
    tiny_config,
)
from bitfuse.numerics import same_bits
from bitfuse.ops import _params
from bitfuse.ops._launch import HAS_TRITON
from model_checks import assert_same, check_high_mount, check_identity, is_stock, run

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
H, W = 96, 64  # 3 x 2 latent tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one intra-op thread (and CI cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(variant="1.0", dtype=torch.float32, seed=0, **overrides):
    return build_model(tiny_config(variant, **overrides), dtype=dtype, seed=seed)


def _inputs(model, batch=2, text=7, **options):
    return make_inputs(model, batch, options.pop("height", H), options.pop("width", W), text, **options)


def _cases(model) -> list[dict]:
    """The pipeline's calls: CFG's batch of a short negative and a longer positive prompt,
    one without guidance (batch 1), a wider image, and a full mask."""
    return [
        _inputs(model, 2, 9, text_lengths=[2, 9], seed=1),
        _inputs(model, 1, 5, seed=2),
        _inputs(model, 2, 4, height=128, width=160, text_lengths=[4, 3], seed=3),
    ]


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_identity(variant, dtype):
    model = _model(variant, DTYPES[dtype])
    check_identity(model, _cases(model))


def test_identity_high_tier_and_return_dict():
    """On CPU the high tier's kernels fall back too: the same bits as stock."""
    model = _model("1.5", torch.bfloat16)
    check_identity(model, _cases(model), quality="high")
    kw = dict(_inputs(model, 2, text_lengths=[3, 7]), return_dict=True)
    ref = run(model, kw)
    with bitfuse.accelerate(model):
        out = run(model, kw)
    assert_same((out.sample,), (ref.sample,))


def test_identity_with_affine_norm2_and_mixed_dtype_parameters():
    """`norm_elementwise_affine=True` (norm2 with a weight: the site calls the norm, then the
    exact modulate) and an fp32 scale_shift_table in a bf16 model (eager's promotion,
    then the block's `.to(dtype)`; the gated residuals promote as eager does)."""
    model = _model("1.0", torch.bfloat16, norm_elementwise_affine=True)
    with torch.no_grad():
        for block in model.transformer_blocks:
            block.norm2.weight.normal_()
            block.norm2.bias.normal_()
    check_identity(model, _cases(model)[:1])
    model = _model("1.0", torch.bfloat16)
    model.transformer_blocks[0].scale_shift_table.data = model.transformer_blocks[0].scale_shift_table.data.float()
    kw = _cases(model)[0]
    try:
        ref = run(model, kw)
    except RuntimeError:  # the stock model may refuse the promoted stream; then so must ours
        with bitfuse.accelerate(model), pytest.raises(RuntimeError):
            run(model, kw)
        return
    with bitfuse.accelerate(model):
        assert_same(run(model, kw), ref)


def test_configs_and_inputs_as_the_pipeline_passes_them():
    """1024 x 1024: 32 x 32 = 1024 tokens; the caption mask is always passed (int64);
    the timestep is fp32, as the scheduler's t."""
    assert image_tokens(1024, 1024) == 1024 and image_tokens(768, 1344) == 24 * 42
    cfg = full_config()
    assert (cfg["num_layers"], cfg["num_attention_heads"] * cfg["attention_head_dim"]) == (20, 2240)
    assert (cfg["num_cross_attention_heads"], cfg["cross_attention_head_dim"], cfg["caption_channels"]) == (20, 112,
                                                                                                          2304)
    assert "qk_norm" not in cfg and full_config(variant="1.5")["qk_norm"] == "rms_norm_across_heads"
    model = _model("1.0", torch.bfloat16)
    assert model._repeated_blocks == ["SanaTransformerBlock"]
    kw = make_inputs(model, 2, 1024, 1024, 300, text_lengths=[3, 300], timestep=937.5)
    assert kw["hidden_states"].shape == (2, 8, 32, 32) and kw["hidden_states"].dtype is torch.bfloat16
    assert kw["encoder_hidden_states"].shape == (2, 300, 24)
    mask = kw["encoder_attention_mask"]
    assert mask.dtype is torch.long and mask.sum(1).tolist() == [3, 300]
    assert kw["timestep"].dtype is torch.float32 and kw["timestep"].tolist() == [937.5, 937.5]
    assert kw["return_dict"] is False
    with pytest.raises(ValueError, match="text_lengths"):
        make_inputs(model, 2, 64, 64, 10, text_lengths=[10])
    with pytest.raises(ValueError, match="unknown Sana variant"):
        tiny_config("2.0")


# ---------------------------------------------------------------- every site goes through bitfuse

_SITE_FUNCS = ("layer_norm_modulate_site", "gated_residual_site", "modulate_site", "rms_norm_modulate_site",
               "conv_bias_silu_site", "conv_bias_glu_site", "linear_attention_site")


def _param_record(p):
    """(shape, view or not, contiguous or not) of a tensor parameter; (shape, "folded",
    the table row's shape, whether the timestep part is a view) of a Folded one."""
    if p.__class__ is _params.Folded:
        return tuple(p.shape), "folded", tuple(p.table.shape), p.temb._base is not None
    return tuple(p.shape), p._base is not None, p.is_contiguous()


@contextlib.contextmanager
def _recording_sites(monkeypatch):
    """Replace the site functions by recorders of their outermost calls: (site function,
    the tier a norm site resolves, the marked module's site name, x's shape and strides,
    the parameters' shapes and whether each is a view)."""
    records = []
    depth = threading.local()

    def wrap(name, real):
        @functools.wraps(real)
        def recorder(*args, **kwargs):
            if getattr(depth, "n", 0) == 0:
                norm_site = name.endswith("norm_modulate_site")
                conv_site = name.startswith("conv_")
                attention_site = name == "linear_attention_site"
                block = args[0] if norm_site else None
                site = getattr(block, "_bitfuse_site", None)
                x = args[2] if norm_site or conv_site else args[0]
                params = args[3:5] if norm_site else ([] if conv_site or attention_site else args[2:3])
                records.append({
                    "site": name, "tier": sites._tier(block) if site else None, "name": site.name if site else None,
                    "x": tuple(x.shape), "x_stride": x.stride(), "modules": args[:2] if conv_site else None,
                    "params": [_param_record(p) for p in params],
                })
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return real(*args, **kwargs)
            finally:
                depth.n -= 1

        return recorder

    for name in _SITE_FUNCS:
        monkeypatch.setattr(sites, name, wrap(name, getattr(sites, name)))
    yield records


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_site_is_routed(monkeypatch, variant):
    """Per block: 2 norm + modulate sites (before self-attention and the FF), 2 gated
    residuals, the two convolution epilogues of GLUMBConv (with its own modules), the
    linear self-attention; the head: 1 norm + modulate site. Nothing else."""
    model = _model(variant)
    kw = _inputs(model, 2, text_lengths=[7, 5])
    ref = run(model, kw)
    with _recording_sites(monkeypatch) as records:
        assert run(model, kw) is not None and records == []  # stock: no site calls
        with bitfuse.accelerate(model):
            out = run(model, kw)
    n = len(model.transformer_blocks)
    counts = {}
    for r in records:
        counts[r["site"]] = counts.get(r["site"], 0) + 1
    assert counts == {"layer_norm_modulate_site": 2 * n + 1, "gated_residual_site": 2 * n,
                      "conv_bias_silu_site": n, "conv_bias_glu_site": n, "linear_attention_site": n}
    D = model.config.num_attention_heads * model.config.attention_head_dim
    assert {r["x"] for r in records if r["site"] == "linear_attention_site"} == {(2, kw["hidden_states"].shape[2] *
                                                                                  kw["hidden_states"].shape[3], D)}
    names = {r["name"] for r in records if r["site"] == "layer_norm_modulate_site"}
    assert names == {"norm_out"} | {f"transformer_blocks.{i}" for i in range(n)}
    ffs = [b.ff for b in model.transformer_blocks]
    assert [r["modules"] for r in records if r["site"] == "conv_bias_silu_site"] == [
        (ff.conv_inverted, ff.nonlinearity) for ff in ffs]
    assert [r["modules"] for r in records if r["site"] == "conv_bias_glu_site"] == [
        (ff.conv_depth, ff.nonlinearity) for ff in ffs]
    assert_same(out, ref)


def _ff_layouts(model, kw) -> list:
    """(shape, strides) of the input of each GLUMBConv, of its depthwise convolution (the
    SiLU epilogue's output) and of its pointwise convolution (the GLU epilogue's output),
    in call order, over one forward."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((tuple(args[0].shape), args[0].stride())))
             for b in model.transformer_blocks for m in (b.ff, b.ff.conv_depth, b.ff.conv_point)]
    try:
        run(model, kw)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_parameters_and_the_ff_layout_reach_the_sites_as_eager_builds_them(monkeypatch):
    """Every block's scale/shift/gate is Folded([D] table row, [B, 1, D] view of the
    timestep embedding), the head's a [B, 2, D] view of its sum, read in place; the FF's
    input, which the SiLU epilogue site receives, is the norm2 site's modulated tokens
    viewed as channels-last NCHW (no copy), as in eager; the GLU epilogue site's input (the
    depthwise convolution's) keeps that layout, and so does its output (the pointwise
    convolution's input): every convolution sees the layout it sees in eager (cuDNN's
    backend choice depends on it)."""
    model = _model("1.0")
    B, D = 2, model.config.num_attention_heads * model.config.attention_head_dim
    kw = _inputs(model, B)
    h, w = kw["hidden_states"].shape[2:]
    stock_layouts = _ff_layouts(model, kw)
    with _recording_sites(monkeypatch) as records, bitfuse.accelerate(model):
        layouts = _ff_layouts(model, kw)
    view, folded = ((B, 1, D), True, False), ((B, 1, D), "folded", (D,), True)
    assert {p for r in records if r["name"] == "norm_out" for p in r["params"]} == {view}
    assert {p for r in records if r["site"] == "layer_norm_modulate_site" and r["name"] != "norm_out"
            for p in r["params"]} == {folded}
    assert {p for r in records if r["site"] == "gated_residual_site" for p in r["params"]} == {folded}
    n = len(model.transformer_blocks)
    C = model.transformer_blocks[0].ff.conv_depth.in_channels
    silu_in, glu_in = ((B, D, h, w), (h * w * D, 1, w * D, D)), ((B, C, h, w), (h * w * C, 1, w * C, C))
    assert [(r["x"], r["x_stride"]) for r in records if r["site"] == "conv_bias_silu_site"] == [silu_in] * n
    assert [(r["x"], r["x_stride"]) for r in records if r["site"] == "conv_bias_glu_site"] == [glu_in] * n
    glu_out = ((B, C // 2, h, w), (h * w * C // 2, 1, w * C // 2, C // 2))
    assert layouts == stock_layouts == [silu_in, glu_in, glu_out] * n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modulation_parameters_are_the_stock_chunks(dtype):
    """`sana._modulation`: six Folded parameters whose values are stock's chunks of
    `table[None] + timestep.reshape(B, 6, -1)` bit for bit (shape, dtype, values, a
    bf16 table with an fp32 timestep promoting as eager does), each carrying the
    call-key metadata the sites would read of it; inside a forward the
    timestep views are made once and reused while the tensor is unmodified; the table
    rows follow the table's storage (`.data` replaced) and do not keep a dropped table
    alive; stock's own tensors with autograd recording and for a table of another shape."""
    from bitfuse.models import _install

    g = torch.Generator().manual_seed(0)
    B, D = 2, 12
    table = torch.nn.Parameter(torch.randn(6, D, generator=g).to(dtype))
    stock = lambda t: (table[None] + t.reshape(B, 6, -1)).chunk(6, dim=1)  # noqa: E731
    for t_dtype in (dtype, torch.float32):
        timestep = torch.randn(B, 6 * D, generator=g).to(t_dtype)
        with torch.no_grad():
            params = sana._modulation(table, timestep, B)
            assert all(p.__class__ is _params.Folded for p in params)
            for p, e in zip(params, stock(timestep)):
                assert p.shape == e.shape and same_bits(p.value(), e)
                # the metadata they carry is what a call key would read of them
                assert p.meta is not None and sites._meta(p) == sites._meta(_params.Folded(p.table, p.temb))
    timestep = torch.randn(B, 6 * D, generator=g).to(dtype)
    token = _install._memo.set({})
    try:
        with torch.no_grad():
            first = sana._modulation(table, timestep, B)
            assert all(a.temb is b.temb for a, b in zip(first, sana._modulation(table, timestep, B)))
            timestep.mul_(2)  # modified: new views, the new values
            again = sana._modulation(table, timestep, B)
            assert all(a.temb is not b.temb for a, b in zip(first, again))
            assert all(same_bits(p.value(), e) for p, e in zip(again, stock(timestep)))
            table.data = torch.randn(6, D, generator=g).to(dtype)
            assert all(same_bits(p.value(), e) for p, e in zip(sana._modulation(table, timestep, B), stock(timestep)))
            table.data = torch.randn(6, 2 * D, generator=g).to(dtype)[:, ::2]  # strided rows: their own metadata
            params = sana._modulation(table, timestep, B)
            assert all(p.meta == sites._meta(_params.Folded(p.table, p.temb)) and p.meta[2] == (2,) for p in params)
            assert all(same_bits(p.value(), e) for p, e in zip(params, stock(timestep)))
            wide = table.data
            table.data = wide[:, : D // 2]  # the same address and strides, a narrower row: new rows
            half = timestep[:, : 3 * D]
            params = sana._modulation(table, half, B)
            assert all(p.table.shape == (D // 2,) for p in params)
            assert all(same_bits(p.value(), e) for p, e in zip(params, (table[None] + half.reshape(B, 6, -1)).chunk(6, 1)))
            table.data = wide
            params = sana._modulation(table, timestep, B)
            if dtype is torch.bfloat16:  # the same address and strides, another dtype: new rows
                table.data = table.data.view(torch.float16)
                params = sana._modulation(table, timestep, B)
                assert all(p.table.dtype is torch.float16 for p in params)
                assert all(same_bits(p.value(), e) for p, e in zip(params, stock(timestep)))
    finally:
        _install._memo.reset(token)
    assert all(p.__class__ is torch.Tensor for p in sana._modulation(table, timestep, B))  # autograd on
    entries = len(sana._table_rows)
    del table, first, again  # the cached rows do not keep the table alive
    gc.collect()
    assert len(sana._table_rows) == entries - 1
    with torch.no_grad():
        column = torch.randn(6, 1, generator=g).to(dtype)  # [6, 1]: broadcasts over the timestep's width
        params = sana._modulation(column, timestep, B)
        expected = (column[None] + timestep.reshape(B, 6, -1)).chunk(6, dim=1)
        assert all(p.__class__ is torch.Tensor and same_bits(p, e) for p, e in zip(params, expected))


def test_accelerate_installs_the_glumbconv_copy_and_an_override_keeps_its_forward():
    """accelerate installs bitfuse's GLUMBConv copy (`sana._glumbconv_forward`, pinned by
    its diffusers source) on every block's FF; a GLUMBConv subclass overriding forward
    keeps its own (nothing installed on it), stock's bits."""
    from diffusers.models.transformers.sana_transformer import GLUMBConv

    assert sana.FORWARDS[GLUMBConv] is sana._glumbconv_forward
    assert sana.COPIES["GLUMBConv.forward"] is sana._glumbconv_forward
    assert "GLUMBConv.forward" in sana.VERIFIED_SOURCES
    assert sana.stock_functions()["GLUMBConv.forward"] is GLUMBConv.forward
    model = _model("1.0")
    kw = _inputs(model, 2)
    ref = run(model, kw)
    ffs = [b.ff for b in model.transformer_blocks]
    with bitfuse.accelerate(model):
        assert all(ff.forward.__func__ is sana._glumbconv_forward for ff in ffs)
        assert_same(run(model, kw), ref)
    assert not any("forward" in ff.__dict__ for ff in ffs)

    class Scaled(GLUMBConv):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 0.5

    model.transformer_blocks[1].ff.__class__ = Scaled
    assert not same_bits(run(model, kw)[0], ref[0])  # the override matters
    with bitfuse.accelerate(model):
        assert "forward" not in model.transformer_blocks[1].ff.__dict__
        assert model.transformer_blocks[1].ff.forward.__func__ is Scaled.forward
        assert model.transformer_blocks[0].ff.forward.__func__ is sana._glumbconv_forward
    check_identity(model, [kw])


@pytest.mark.parametrize("name", ["conv_bias_silu_site", "conv_bias_glu_site", "gated_residual_site",
                                  "linear_attention_site"])
def test_sites_change_the_output_when_they_change(monkeypatch, name):
    """A control for the identity tests: perturb one routed site (either convolution
    epilogue of GLUMBConv, the gated residual, the linear attention) and the output,
    stock's bits before, moves."""
    model = _model("1.0")
    kw = _inputs(model, 2)
    ref = run(model, kw)
    real = getattr(sites, name)
    with bitfuse.accelerate(model):
        assert_same(run(model, kw), ref)
        monkeypatch.setattr(sites, name, lambda *a, **k: real(*a, **k) * 1.5)
        out = run(model, kw)
    assert not same_bits(out[0], ref[0])


# ---------------------------------------------------------------- the attention processors


def test_the_caption_mask_is_prepared_once_a_forward(monkeypatch):
    """Stock prepares the cross-attention mask in every block; accelerated, the blocks of
    one forward share one preparation (the same tensor, unmodified), a new forward or a
    mask modified in place prepares it again, and the output stays stock's."""
    model = _model("1.0")
    kw = _inputs(model, 2, text_lengths=[3, 7])
    calls = []
    real = Attention.prepare_attention_mask

    def counting(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    ref = run(model, kw)
    handle = bitfuse.accelerate(model)  # (checks the pinned sources: before the counting stand-in)
    monkeypatch.setattr(Attention, "prepare_attention_mask", counting)
    monkeypatch.setattr(sana, "_STOCK_PREPARE", counting)
    with handle:
        assert_same(run(model, kw), ref)
        assert len(calls) == 1
        assert_same(run(model, kw), ref)
        assert len(calls) == 2  # the model builds a new bias tensor from the mask every forward
        block = model.transformer_blocks[0]
        mask = torch.zeros(2, 1, kw["encoder_hidden_states"].shape[1])
        first = sana._prepared_mask(block.attn2, mask, mask.shape[-1], 2)
        assert sana._prepared_mask(block.attn2, mask, mask.shape[-1], 2) is first
        mask.add_(1.0)  # modified in place: prepared again, with the new values
        again = sana._prepared_mask(block.attn2, mask, mask.shape[-1], 2)
        assert again is not first and bool((again == 1.0).all())
    calls.clear()
    assert_same(run(model, kw), ref)
    assert len(calls) == len(model.transformer_blocks)  # stock: every block prepares it
    assert not sana._masks


def test_a_processor_override_is_left_alone():
    """A user's processor on one block stays in place (and is called through the
    Attention forward copy with its own signature); the others switch to bitfuse's."""
    model = _model("1.0")
    kw = _inputs(model, 2)
    ref = run(model, kw)
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

    class Mine(SanaLinearAttnProcessor2_0):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, extra=None):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask)

    model.transformer_blocks[0].attn1.set_processor(Mine())
    with bitfuse.accelerate(model):
        assert type(model.transformer_blocks[0].attn1.processor) is Mine
        assert type(model.transformer_blocks[1].attn1.processor) is sana._LinearAttnProcessor
        assert type(model.transformer_blocks[0].attn2.processor) is sana._CrossAttnProcessor
        assert_same(run(model, kw), ref)
    assert is_stock(model)


def test_attention_keyword_arguments_are_filtered_and_warned_about_as_in_stock(monkeypatch):
    """The Attention forward copy calls the processor directly only without keyword
    arguments; with them, it filters and warns as diffusers does (the same message)."""
    from diffusers.models import attention_processor

    model = _model("1.0")
    attn = model.transformer_blocks[0].attn1
    x = torch.randn(2, 6, attn.to_q.in_features, generator=torch.Generator().manual_seed(4))
    said = []
    monkeypatch.setattr(attention_processor.logger, "warning", lambda msg, *a: said.append(msg))
    stock = [attn(x), attn(x, ip_adapter_masks=None), attn(x, extra=1.0)]
    with bitfuse.accelerate(model):
        ours = [attn(x), attn(x, ip_adapter_masks=None), attn(x, extra=1.0)]
    for a, b in zip(stock, ours):
        assert same_bits(b, a)
    # the same message, naming the processor in place (bitfuse's copy of the stock class)
    assert len(said) == 2 and "['extra']" in said[0], said
    assert said[1] == said[0].replace("SanaLinearAttnProcessor2_0", "_LinearAttnProcessor"), said


def test_module_hooks_run_as_in_stock():
    """The copies call plain modules directly (`models._direct`) and the sites compute
    norms, convolutions and SiLUs without calling their modules; a hooked module, or
    any module under a global hook, is called as a module: a global hook sees every
    module call stock makes, and a hook's changed output reaches the model."""
    model = _model("1.0")
    kw = _inputs(model, 2)

    def counts():
        seen = collections.Counter()
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: seen.update([type(m).__name__]))
        try:
            out = run(model, kw)
        finally:
            handle.remove()
        return out, seen

    ref, stock_seen = counts()
    with bitfuse.accelerate(model):
        out, seen = counts()
        assert_same(out, ref)
        assert seen == stock_seen
        assert all(stock_seen[name] > 0 for name in ("Linear", "Dropout", "Conv2d", "LayerNorm", "SiLU"))
        block = model.transformer_blocks[1]
        block.attn2.to_out[0].register_forward_hook(lambda m, args, out: out * 0)
        zeroed = run(model, kw)
    block.attn2.to_out[0]._forward_hooks.clear()
    stock_zeroed = model.transformer_blocks[1].attn2.to_out[0].register_forward_hook(lambda m, args, out: out * 0)
    try:
        assert_same(zeroed, run(model, kw))
    finally:
        stock_zeroed.remove()
    assert not torch.equal(zeroed[0], ref[0])


# ---------------------------------------------------------------- tiers


def test_quality_high_mounts_on_every_site_and_a_request_overrides_it(monkeypatch):
    model = _model("1.0", torch.bfloat16)
    check_high_mount(model, _inputs(model, 2), lambda: _recording_sites(monkeypatch))


def test_quality_high_is_all_or_nothing():
    """An affine norm2 has no one-pass kernel: "high" is refused for the whole model and
    nothing is left installed; lossless routes it (the norm, then the exact modulate)."""
    model = _model("1.0", norm_elementwise_affine=True)
    with pytest.raises(bitfuse.MountError, match="transformer_blocks.0"):
        bitfuse.accelerate(model, quality="high")
    assert is_stock(model)
    check_identity(model, [_inputs(model, 2)])


# ---------------------------------------------------------------- torch.compile


def _compiled(model, kw) -> tuple:
    """One forward of torch.compile(model): its output, and the calls (functions, methods,
    modules) of the graphs it traced, counted by target."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = run(torch.compile(model, backend=backend), kw)
    return out, collections.Counter(str(node.target) for gm in graphs for node in gm.graph.nodes
                                    if node.op in ("call_function", "call_method", "call_module"))


def test_compile_traces_the_plain_expressions():
    """Under torch.compile the sites emit diffusers' expressions: the traced graphs hold
    aten's layer_norm, each FF's convolutions with their bias and its SiLUs (the
    convolution epilogue sites' plain `act(conv(x))` and `hidden * act(gate)`), and no
    bitfuse op: the very calls stock's graphs hold; the compiled accelerated model equals
    stock."""
    model = _model("1.0", torch.bfloat16)
    kw = _inputs(model, 2, text_lengths=[3, 7])
    ref = run(model, kw)
    try:
        stock_out, stock = _compiled(model, kw)
        with bitfuse.accelerate(model):
            out, ops = _compiled(model, kw)
        assert_same(stock_out, ref)
        assert_same(out, ref)
        n = len(model.transformer_blocks)
        assert sum(c for t, c in ops.items() if "layer_norm" in t) == 2 * n + 1
        assert sum(c for t, c in ops.items() if "conv2d" in t) == 3 * n + 1  # each FF's three, the patch embedding's
        assert sum(c for t, c in ops.items() if "silu" in t) >= 2 * n  # each FF's two (+ the embeddings')
        assert not any("bitfuse" in t for t in ops)
        assert ops == stock
    finally:
        torch._dynamo.reset()


def test_compile_repeated_blocks_fullgraph_equals_stock():
    """diffusers' regional compile of the accelerated blocks (named in _repeated_blocks by
    the configs) traces whole (fullgraph)."""
    torch._dynamo.reset()
    model = _model("1.5", torch.bfloat16)
    kw = _inputs(model, 2, text_lengths=[2, 7])
    ref = run(model, kw)
    try:
        with bitfuse.accelerate(model):
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
            assert_same(run(model, kw), ref)
            assert all(b._compiled_call_impl is not None for b in model.transformer_blocks)
    finally:
        for b in model.transformer_blocks:
            b._compiled_call_impl = None
        torch._dynamo.reset()


# ---------------------------------------------------------------- pipelines, versions, restore


def test_a_pipeline_is_accelerated_through_its_transformer():
    """A stand-in for SanaPipeline (its denoising loop calls `self.transformer` with the
    negative and the positive prompt batched): accelerate(pipe) accelerates
    pipe.transformer, and restore() gives the stock model back."""
    model = _model("1.0", torch.bfloat16)
    pipe = types.SimpleNamespace(transformer=model)
    kw = _inputs(model, 2, 9, text_lengths=[2, 9], seed=1)
    ref = run(pipe.transformer, kw)
    with bitfuse.accelerate(pipe) as handle:
        assert handle.model is model and handle.pipeline is pipe and len(handle.sites) == 3
        assert_same(run(pipe.transformer, kw), ref)
        assert bitfuse.accelerate(pipe) is handle
    assert is_stock(model)


def test_restore_is_complete_and_idempotent():
    model = _model("1.0")
    handle = bitfuse.accelerate(model)
    assert model.transformer_blocks[0].forward.__func__ is sana._block_forward
    assert model.transformer_blocks[0].ff.forward.__func__ is sana._glumbconv_forward
    assert model.norm_out.forward.__func__ is sana._modulated_norm_forward
    handle.restore()
    assert "forward" not in model.transformer_blocks[0].ff.__dict__
    handle.restore()
    assert is_stock(model) and not handle.active


@pytest.mark.parametrize("name", sorted(sana.VERIFIED_SOURCES))
def test_refuses_a_changed_diffusers_source(monkeypatch, name):
    """Each copied function is pinned (the block's, GLUMBConv's and the head's forward)."""
    model = _model("1.0")
    monkeypatch.setitem(sana.VERIFIED_SOURCES, name, "0" * 64)
    with pytest.raises(UnsupportedVersionError, match=rf"{re.escape(name)} differs"):
        bitfuse.accelerate(model)
    assert is_stock(model)
    with pytest.warns(UserWarning, match="differs"):
        bitfuse.accelerate(model, force=True).restore()
    assert is_stock(model)


# ---------------------------------------------------------------- the real kernels, interpreted


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton's interpreter (CPU runs)")
def test_the_kernels_run_through_the_gate(monkeypatch):
    """fp32 under Triton's interpreter: the gated residual kernel is verified bitwise on
    Sana's Folded gates (a table row + a strided [B, 1, D] timestep view), also with the
    self-attention's to_out bias left to it (a Folded y: `linear_bias_split`, itself
    checked against the layer's call), and the GLU epilogue site plans and is judged at
    first sight; whatever a verdict (the LayerNorm kernel reproduces CUDA's reduction
    order, the interpreter's SiLU is numpy's), the output keeps stock's bits."""
    model = _model("1.0")
    kw = _inputs(model, 2, 3, text_lengths=[2, 3])
    ref = run(model, kw)
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    with bitfuse.accelerate(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)
        assert_same(run(model, kw), ref)
    verdicts = policy.verdicts()
    assert {v.signature.split(" ", 3)[3] for v in verdicts if v.op == "gated_residual" and v.active} == {
        "per-sample/strided+table", "per-sample/strided+table y+bias"}, [v.signature for v in verdicts]
    assert [v.active for v in verdicts if v.op == "linear_bias_split"] == [True], [v.signature for v in verdicts]
    assert any(v.op == "layer_norm_modulate" for v in verdicts), [v.signature for v in verdicts]
    assert any(v.op == "conv_bias_glu" for v in verdicts), [v.signature for v in verdicts]
    assert any(v.op == "linear_attention" and v.active for v in verdicts), [v.signature for v in verdicts]


@pytest.mark.parametrize("layout", ["contiguous", "offset", "transposed", "strided"])
def test_the_layout_views_are_the_stock_views(layout):
    """The block's two view pairs as one `as_strided` each: the stock views' shape,
    strides and storage offset (no copy), for any x; a flatten that would copy (y's W
    and H not mergeable) keeps the stock calls, and so their copy."""
    torch.manual_seed(5)
    x = {"contiguous": torch.randn(2, 12, 5), "offset": torch.randn(3, 12, 5)[1:],
         "transposed": torch.randn(2, 5, 12).transpose(1, 2), "strided": torch.randn(2, 12, 10)[..., ::2]}[layout]
    y = {"contiguous": torch.randn(2, 5, 3, 4).to(memory_format=torch.channels_last),
         "offset": torch.randn(4, 5, 3, 4)[2:].to(memory_format=torch.channels_last),
         "transposed": torch.randn(2, 5, 4, 3).transpose(2, 3), "strided": torch.randn(2, 5, 3, 8)[..., ::2]}[layout]
    pairs = [(x, sana._tokens_as_nchw(x, 3, 4), x.unflatten(1, (3, 4)).permute(0, 3, 1, 2)),
             (y, sana._nchw_as_tokens(y), y.flatten(2, 3).permute(0, 2, 1))]
    for base, ours, stock in pairs:
        assert ours.shape == stock.shape and ours.stride() == stock.stride()
        assert ours.storage_offset() == stock.storage_offset() and torch.equal(ours, stock)
        view = stock.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert (ours.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()) == view
    assert layout != "transposed" or not view  # (that y's flatten copies)


@pytest.mark.parametrize("layout", ["contiguous", "packed", "offset", "transposed", "batch-1", "one-token"])
def test_the_attention_head_views_are_the_stock_views(layout):
    """The cross-attention's `view(B, -1, heads, d).transpose(1, 2)` of q, k, v and
    `transpose(1, 2).reshape(B, -1, heads * d)` of its output, as one `as_strided`
    each: the stock views' shape, strides and storage offset, for every layout of the
    operand (a column slice of a packed projection output among them); sizes of 1 and
    an output whose reshape copies keep the stock calls."""
    B, N, H, d = {"batch-1": (1, 7, 4, 8), "one-token": (2, 1, 4, 8)}.get(layout, (2, 7, 4, 8))
    C = H * d
    t = {"packed": torch.randn(B, N, 3 * C + 16)[..., C + 16:2 * C + 16], "offset": torch.randn(B + 1, N, C)[1:],
         "transposed": torch.randn(B, C, N).transpose(1, 2)}.get(layout, torch.randn(B, N, C))
    o = {"transposed": torch.randn(B, N, H, d).transpose(1, 2)}.get(layout, torch.randn(B, H, N, d))
    pairs = [(t, sana._heads_view(t, B, H, d), t.view(B, -1, H, d).transpose(1, 2)),
             (o, sana._merged_heads(o, B, C), o.transpose(1, 2).reshape(B, -1, C))]
    for base, ours, stock in pairs:
        assert ours.shape == stock.shape and ours.stride() == stock.stride()
        assert ours.storage_offset() == stock.storage_offset() and torch.equal(ours, stock)
        view = stock.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert (ours.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()) == view
    assert layout != "contiguous" or not view  # (that the contiguous [B, H, N, d] output's reshape copies)


def test_projection_weights_are_packed_while_accelerated():
    """accelerate packs each self-attention's q, k, v weights and each cross-attention's
    k, v weights and biases (`sites.linear_projections_site` makes one GEMM of them on
    CUDA; the tiny config's 16-element biases take zero rows between parts), the same
    Parameters and values; restore gives every one its own storage again."""
    from bitfuse.ops import projections

    model = _model("1.0")
    kw = _inputs(model, 2, 5)
    ref = run(model, kw)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    groups = [(b.attn1.to_q, b.attn1.to_k, b.attn1.to_v) for b in model.transformer_blocks] + \
        [(b.attn2.to_k, b.attn2.to_v) for b in model.transformer_blocks]
    with bitfuse.accelerate(model):
        for group in groups:
            assert projections.layout([m.weight for m in group]) is not None
            assert group[0].bias is None or projections.layout([m.bias for m in group]) == \
                projections.layout([m.weight for m in group])
        assert all(p is model.get_parameter(n) and torch.equal(p, v) for n, (p, v) in params.items())
        assert_same(run(model, kw), ref)
    for group in groups:
        assert projections.packed([m.weight for m in group]) is None
    assert all(p is model.get_parameter(n) and torch.equal(p, v) for n, (p, v) in params.items())
    assert is_stock(model)


def _counting_projections(monkeypatch):
    """Record the number of linears of every `sites.linear_projections_site` call."""
    calls = []
    real = sites.linear_projections_site

    def counting(x, *linears, **kw):
        calls.append(len(linears))
        return real(x, *linears, **kw)

    monkeypatch.setattr(sites, "linear_projections_site", counting)
    return calls


@pytest.mark.parametrize("interpreted", [False, True], ids=["cpu-fallback", "fused-path"])
def test_the_caption_is_projected_once_a_forward(monkeypatch, interpreted):
    """Every block projects the same caption: the first block of a forward makes every
    block's k and v (one site call of 2 x layers linears; with the planner taking CPU
    tensors, one GEMM through the gate) and the later blocks take theirs from the
    forward's memo; the output is stock's, and the next forward computes them afresh."""
    from bitfuse.ops import _params

    policy.reset_verdicts()
    model = _model("1.0", num_layers=3)
    kw = _inputs(model, 2, 5)
    ref = run(model, kw)
    if interpreted:
        monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    calls = _counting_projections(monkeypatch)
    with bitfuse.accelerate(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)  # (a CPU GEMM may not be the separate ones' bits)
        for _ in range(2):
            calls.clear()
            assert_same(run(model, kw), ref)
            assert sorted(calls) == [3, 3, 3, 6]
    six = [v for v in policy.verdicts() if v.op == "projections" and "N=(16, 16, 16, 16, 16, 16)" in v.signature]
    assert bool(six) == interpreted, [v.signature for v in policy.verdicts()]  # (one per x alignment on a CPU)
    assert not sana._captions


def test_unpacked_caption_linears_are_projected_block_by_block(monkeypatch):
    """After `.to()` (each parameter copied on its own: nothing packed) every block makes
    its own two projections, as it would with any other caption per block."""
    model = _model("1.0", num_layers=3)
    kw = _inputs(model, 2, 5)
    ref = run(model, kw)
    calls = _counting_projections(monkeypatch)
    with bitfuse.accelerate(model):
        model.to(torch.float64).to(torch.float32)
        assert_same(run(model, kw), ref)
        assert sorted(calls) == [2, 2, 2, 3, 3, 3]


@pytest.mark.parametrize("change", ["in-place", "rebound"])
def test_caption_linears_changed_during_a_forward_are_not_served_from_the_memo(monkeypatch, change):
    """A hook between the blocks that changes a later block's caption weights (in place,
    or `.data` rebound to other storage) after the first block made every block's k, v:
    that block computes its own two with the weights it has then, as stock does; the
    other blocks keep the memo's."""
    model = _model("1.0", num_layers=3)
    kw = _inputs(model, 2, 5)
    attn = model.transformer_blocks[1].attn2
    saved = attn.to_k.weight.detach().clone(), attn.to_v.bias.detach().clone()

    def hook(module, args):
        with torch.no_grad():
            if change == "in-place":
                attn.to_k.weight.mul_(0.5)
                attn.to_v.bias.add_(1.0)
            else:
                attn.to_k.weight.data = attn.to_k.weight.data * 0.5

    def reset():
        with torch.no_grad():
            attn.to_k.weight.copy_(saved[0])
            attn.to_v.bias.copy_(saved[1])

    handle = model.transformer_blocks[1].register_forward_pre_hook(hook)
    ref = run(model, kw)
    reset()
    calls = _counting_projections(monkeypatch)
    with bitfuse.accelerate(model):
        out = run(model, kw)
        reset()
    handle.remove()
    assert_same(out, ref)
    assert sorted(calls) == [2, 3, 3, 3, 6]


def test_the_caption_memo_keeps_to_its_tensor():
    """Inside one forward's memo: a block given another caption than the first block's
    (another tensor, or the same one modified since) gets its own two projections, and
    from that second miss on the memo stops for the forward; each result is the module
    calls' bits."""
    from bitfuse.models import _install

    model = _model("1.0", num_layers=3)
    attns = [b.attn2 for b in model.transformer_blocks]
    torch.manual_seed(3)
    c1, c2 = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    with bitfuse.accelerate(model), torch.no_grad():
        scoped = _install.scoped_forward(lambda self, fn: fn())
        expected = {id(a): (a.to_k(c), a.to_v(c)) for a, c in zip(attns, (c1, c2, c1))}

        def forward():
            memo = _install.forward_memo()
            outs = [sana._caption_projections(a, c) for a, c in zip(attns, (c1, c2, c1))]
            return memo, outs

        memo, outs = scoped(None, forward)
        assert list(memo.values()) == [False] and _install.forward_memo() is None
        for a, (k, v) in zip(attns, outs):
            assert same_bits(k, expected[id(a)][0]) and same_bits(v, expected[id(a)][1])
