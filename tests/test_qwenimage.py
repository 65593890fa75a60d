"""Qwen-Image (diffusers QwenImageTransformer2DModel): bitfuse's forwards are faithful.

On CPU every site falls back to its eager expression, so bitwise equality between
the accelerated and the stock model (built from the same seed) checks that
bitfuse's copies of the block forward, `_modulate` and the head compute exactly
what diffusers computes, with every adaLN site routed through bitfuse (counted
below). One test runs the real kernels through the gate in Triton's interpreter."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import types
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)

import bitfuse  # noqa: E402
from bitfuse import policy, sites  # noqa: E402
from bitfuse.models import UnsupportedVersionError, adaln, qwenimage  # noqa: E402
from bitfuse.models.qwenimage_configs import (  # noqa: E402
    VARIANTS,
    build_model,
    image_tokens,
    make_inputs,
    tiny_config,
)
from bitfuse.numerics import same_bits  # noqa: E402
from bitfuse.ops import _params  # noqa: E402
from bitfuse.ops._launch import HAS_TRITON  # noqa: E402
from model_checks import assert_same, check_high_mount, check_identity, is_stock, run  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
H, W = 64, 48  # 4 x 3 image tokens
CONDITION = [(32, 48)]  # one condition image, 2 x 3 tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one intra-op thread (and CI cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(variant="image", dtype=torch.float32, seed=0, **overrides):
    return build_model(tiny_config(variant, **overrides), dtype=dtype, seed=seed)


def _inputs(model, batch=1, text=7, **options):
    return make_inputs(model, batch, H, W, text, **options)


def _cases(model) -> list[dict]:
    """The calls the pipelines make: the conditional and the unconditional pass (batch 1,
    prompts of different lengths, no mask), a batch of prompts of different lengths
    (a mask), and the edit pipelines' condition image tokens (batch 1 and 2)."""
    return [
        _inputs(model, 1, 9, seed=1),
        _inputs(model, 1, 3, seed=2),
        _inputs(model, 2, 7, text_lengths=[7, 4], seed=3),
        _inputs(model, 1, 5, condition_images=CONDITION, seed=4),
        _inputs(model, 2, 6, condition_images=CONDITION, text_lengths=[2, 6], seed=5),
    ]


def _processors(model) -> list:
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_identity(variant, dtype):
    model = _model(variant, DTYPES[dtype])
    check_identity(model, _cases(model))


def test_identity_high_tier_and_return_dict():
    """On CPU the high tier's kernels fall back too: the same bits as stock."""
    model = _model("edit-2511", torch.bfloat16)
    check_identity(model, _cases(model), quality="high")
    kw = dict(_inputs(model, condition_images=CONDITION), return_dict=True)
    ref = run(model, kw)
    with bitfuse.accelerate(model):
        out = run(model, kw)
    assert_same((out.sample,), (ref.sample,))


def test_identity_layered_flags():
    """Qwen-Image-Layered's flags: the additional (RGB) timestep condition and the
    layer-3D RoPE, whose img_shapes list the layers and then the condition image."""
    model = _model("image", torch.bfloat16, use_additional_t_cond=True, use_layer3d_rope=True)
    kw = _inputs(model, 1, condition_images=[(H, W), (H, W), (32, 32)], seed=6)
    assert "additional_t_cond" in kw
    check_identity(model, [kw])


def test_make_inputs_as_the_pipeline_passes_them():
    """1328 x 1328: 83 x 83 = 6889 image tokens; batch 1: no mask; the timestep is
    rounded to the latents' dtype before the division, as the pipeline does."""
    model = _model("image", torch.bfloat16)
    kw = make_inputs(model, 1, 1328, 1328, 128, timestep=937.5)
    assert image_tokens(1328, 1328) == 6889
    assert kw["hidden_states"].shape == (1, 6889, 16) and kw["hidden_states"].dtype is torch.bfloat16
    assert kw["encoder_hidden_states"].shape == (1, 128, 32) and kw["encoder_hidden_states_mask"] is None
    assert kw["img_shapes"] == [[(1, 83, 83)]] and kw["guidance"] is None and kw["return_dict"] is False
    expected = torch.tensor([937.5]).to(torch.bfloat16) / 1000
    assert kw["timestep"].dtype is torch.bfloat16 and same_bits(kw["timestep"], expected)
    kw = make_inputs(model, 2, 1024, 768, 10, text_lengths=[10, 4], condition_images=[(512, 512)])
    mask = kw["encoder_hidden_states_mask"]
    assert mask.dtype is torch.long and mask.tolist() == [[1] * 10, [1] * 4 + [0] * 6]
    padding = kw["encoder_hidden_states"][1, 4:]
    assert same_bits(padding, torch.zeros_like(padding))  # +0.0, as the pipeline pads
    assert kw["img_shapes"] == [[(1, 64, 48), (1, 32, 32)]] * 2 and kw["hidden_states"].shape[1] == 64 * 48 + 32 * 32
    with pytest.raises(ValueError, match="text_lengths"):
        make_inputs(model, 2, 64, 64, 10, text_lengths=[10])
    with pytest.raises(ValueError, match="unknown Qwen-Image variant"):
        tiny_config("edit")


# ---------------------------------------------------------------- every site goes through bitfuse

_SITE_FUNCS = ("layer_norm_modulate_site", "gated_residual_site", "modulate_site", "rms_norm_modulate_site")


@contextlib.contextmanager
def _recording_sites(monkeypatch):
    """Replace the site functions by recorders of their outermost calls (sites call each
    other when they fall back): (site function, the tier a norm site resolves, the
    marked module's site name, the parameters' shapes and whether each is a view, thread)."""
    records = []
    depth = threading.local()

    def wrap(name, real):
        @functools.wraps(real)
        def recorder(*args, **kwargs):
            if getattr(depth, "n", 0) == 0:
                norm_site = name.endswith("norm_modulate_site")
                block = args[0] if norm_site else None
                site = getattr(block, "_bitfuse_site", None)
                params = args[3:5] if norm_site else args[2:3]
                records.append(dict(
                    site=name, tier=sites._tier(block) if site else None, name=site.name if site else None,
                    x=tuple(args[2 if norm_site else 0].shape), thread=threading.get_ident(),
                    params=[(tuple(p.shape), p._base is not None, p.is_contiguous()) for p in params],
                ))
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
def test_every_adaln_site_is_routed(monkeypatch, variant):
    """Per block: 4 norm + modulate sites (image and text, before attention and MLP)
    and 4 gated residuals; the head: 1 norm + modulate site. Nothing else: the pointwise
    modulate and the RMSNorm sites have no place in Qwen-Image."""
    model = _model(variant)
    kw = _inputs(model, 2, condition_images=CONDITION, text_lengths=[7, 5])
    ref = run(model, kw)
    with _recording_sites(monkeypatch) as records:
        assert run(model, kw) is not None and records == []  # stock: no site calls
        with bitfuse.accelerate(model):
            out = run(model, kw)
    n = len(model.transformer_blocks)
    counts = {}
    for r in records:
        counts[r["site"]] = counts.get(r["site"], 0) + 1
    assert counts == {"layer_norm_modulate_site": 4 * n + 1, "gated_residual_site": 4 * n}
    names = {r["name"] for r in records if r["site"] == "layer_norm_modulate_site"}
    assert names == {"norm_out"} | {f"transformer_blocks.{i}" for i in range(n)}
    assert_same(out, ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameters_reach_the_sites_as_eager_builds_them(monkeypatch, variant):
    """Without modulate_index every scale/shift/gate is a [B, 1, D] view of the mod
    Linear's output (read in place, nothing copied); with it (edit-2511) the image
    stream's are the [B, S, D] tensors eager's `torch.where` makes, the text stream's
    still views. The head's are views of its Linear's output."""
    model = _model(variant)
    B, D = 2, model.inner_dim
    kw = _inputs(model, B, condition_images=CONDITION)
    S_img, S_txt = kw["hidden_states"].shape[1], kw["encoder_hidden_states"].shape[1]
    with _recording_sites(monkeypatch) as records, bitfuse.accelerate(model):
        run(model, kw)
    view = ((B, 1, D), True, False)
    per_token = ((B, S_img, D), False, True)
    seen = {(r["x"][1], p) for r in records if r["name"] != "norm_out" for p in r["params"]}
    assert seen == {(S_img, per_token if variant == "edit-2511" else view), (S_txt, view)}
    assert [r["params"] for r in records if r["name"] == "norm_out"] == [[view, view]]


def test_modulate_index_selects_rows_per_token():
    """`_norm_modulate` against diffusers' `_modulate(norm(x))` directly: an index with
    mixed zeros and ones in any order (not only the pipeline's two segments), parameter
    rows with exact zeros of both signs, an outlier channel, inf and NaN; fp32 and
    bf16, with and without the index. Bitwise, gate included."""
    for dtype in (torch.float32, torch.bfloat16):
        block = _model("edit-2511", dtype).transformer_blocks[0]
        B, S, D = 2, 11, block.dim
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(B, S, D, generator=gen).to(dtype)
        x[:, :, 3] *= 300.0  # an outlier channel
        x[0, 2] = 0.0
        mod = torch.randn(2 * B, 3 * D, generator=gen).to(dtype)
        mod[0, :5], mod[1, 5:10] = 0.0, -0.0
        mod[2, 7], mod[3, D + 1] = float("inf"), float("nan")
        index = torch.randint(0, 2, (B, S), generator=gen, dtype=torch.int32)
        for params, idx in ((mod, index), (mod[:B], None), (mod.t().contiguous().t(), index)):
            ours = qwenimage._norm_modulate(block, block.img_norm1, x, params, idx)
            stock = block._modulate(block.img_norm1(x), params, idx)
            assert all(same_bits(o, s) for o, s in zip(ours, stock)), (dtype, idx is None)


def test_an_overridden_modulate_is_used():
    """A block with its own `_modulate` (its class's, or an instance attribute) runs it
    on the norm's output, as its stock forward would."""
    model = _model("edit-2511")
    stock = type(model.transformer_blocks[0])

    class Scaled(stock):
        def _modulate(self, x, mod_params, index=None):
            out, gate = super()._modulate(x, mod_params, index)
            return out * 0.5, gate

    model.transformer_blocks[1].__class__ = Scaled
    block = model.transformer_blocks[0]
    block._modulate = lambda x, mod_params, index=None: (x, stock._modulate(block, x, mod_params, index)[1])
    cases = [_inputs(model, 1, condition_images=CONDITION), _inputs(model, 2)]
    plain = _model("edit-2511")
    assert not same_bits(run(model, cases[0])[0], run(plain, cases[0])[0])  # the override matters
    check_identity(model, cases)


def test_sites_change_the_output_when_they_change():
    """A control for the identity tests: perturb one site and the output moves."""
    model = _model("image")
    kw = _inputs(model, 2)
    ref = run(model, kw)
    real = sites.gated_residual_site
    with bitfuse.accelerate(model):
        try:
            sites.gated_residual_site = lambda x, y, gate: real(x, y, gate * 1.5)
            out = run(model, kw)
        finally:
            sites.gated_residual_site = real
    assert not same_bits(out[0], ref[0])


# ---------------------------------------------------------------- the attention processor


def _random_qk_weights(model, seed=11):
    """Non-unit q/k norm weights (they init to ones; a checkpoint's are not), so a
    dropped or misplaced weight shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm) and m.weight is not None:
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen))
    return model


@contextlib.contextmanager
def _recording_joint_site(monkeypatch):
    """Records each joint_qk_norm_rope_site call: (sources, freqs, rope_type)."""
    calls = []
    real = sites.joint_qk_norm_rope_site

    def recorder(sources, freqs, rope_type):
        calls.append((tuple(sources), freqs, rope_type))
        return real(sources, freqs, rope_type)

    monkeypatch.setattr(sites, "joint_qk_norm_rope_site", recorder)
    yield calls


@pytest.mark.parametrize("variant", VARIANTS)
def test_processors_route_the_qk_norms_and_rope_and_come_back(monkeypatch, variant):
    """Stock processors switch class (keeping their attention backend) and send both
    streams' q/k norms, RoPE and the query/key concatenation to the joint site: text
    first, each stream with its own frequencies (img_freqs, txt_freqs swapped into the
    sources' order), diffusers' RMSNorm modules with their weights. A processor of
    another class (a user's subclass) is left alone. On restore every processor is the
    same object, of its stock class, with its backend setting."""
    model = _random_qk_weights(_model(variant, torch.bfloat16))
    cases = _cases(model)
    refs = [run(model, kw) for kw in cases]
    mine = type("Mine", (QwenDoubleStreamAttnProcessor2_0,), {})()
    model.transformer_blocks[1].attn.set_processor(mine)
    assert all(same_bits(run(model, kw)[0], ref[0]) for kw, ref in zip(cases, refs))  # Mine computes stock's
    processors = {id(m): m.processor for m in model.modules() if hasattr(m, "processor")}
    for p in processors.values():
        p._attention_backend = "native"
    with _recording_joint_site(monkeypatch) as calls, bitfuse.accelerate(model):
        assert [type(p).__name__ for p in _processors(model)] == ["_AttnProcessor", "Mine"]
        assert isinstance(_processors(model)[0], QwenDoubleStreamAttnProcessor2_0)
        for kw, ref in zip(cases, refs):
            assert_same(run(model, kw), ref)
    assert len(calls) == len(cases)  # block 0 once per forward; block 1 (Mine) never
    attn = model.transformer_blocks[0].attn
    H, Dh = attn.heads, attn.inner_dim // attn.heads
    for (sources, freqs, rope), kw in zip(calls, cases):
        (nq_t, nk_t, q_t, k_t), (nq_i, nk_i, q_i, k_i) = sources
        assert (nq_t, nk_t, nq_i, nk_i) == (attn.norm_added_q, attn.norm_added_k, attn.norm_q, attn.norm_k)
        B, S_img, S_txt = kw["hidden_states"].shape[0], kw["hidden_states"].shape[1], \
            kw["encoder_hidden_states"].shape[1]
        assert [tuple(t.shape) for t in (q_t, k_t, q_i, k_i)] == [(B, S_txt, H, Dh)] * 2 + [(B, S_img, H, Dh)] * 2
        assert rope == "complex" and [tuple(f.shape) for f in freqs] == [(S_txt, Dh // 2), (S_img, Dh // 2)]
        assert all(f.dtype is torch.complex64 for f in freqs)
    assert is_stock(model)
    assert all(m.processor is processors[id(m)] and m.processor._attention_backend == "native"
               for m in model.modules() if hasattr(m, "processor"))
    assert type(model.transformer_blocks[0].attn.processor) is QwenDoubleStreamAttnProcessor2_0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_qk_norm_rope_is_diffusers_lines(dtype):
    """`qk_norm_rope` against the stock processor's lines (norms, apply_rotary_emb_qwen,
    torch.cat text first) on one block's modules with non-unit weights and the model's
    own RoPE tables: queries/keys with an outlier channel, zero rows of both signs, inf
    and NaN; with RoPE, without it, and with a missing norm (qk_norm=None: the stock
    `if attn.norm_q is not None` branches). Bitwise."""
    model = _random_qk_weights(_model("image", DTYPES[dtype]))
    attn = model.transformer_blocks[0].attn
    H, Dh = attn.heads, attn.inner_dim // attn.heads
    B, S_img, S_txt = 2, 12, 5
    gen = torch.Generator().manual_seed(3)

    def rows(S, scale=1.0):
        x = scale * torch.randn(B, S, H, Dh, generator=gen)
        x[..., 3] *= 300.0
        x[0, 1], x[1, 2] = 0.0, -0.0
        x[1, 0, 1, 5], x[0, 3, 0, 7] = float("inf"), float("nan")
        return x.to(DTYPES[dtype])

    img_q, img_k, txt_q, txt_k = rows(S_img), rows(S_img, 0.5), rows(S_txt), rows(S_txt, 2.0)
    freqs = model.pos_embed([(1, 4, 3)], max_txt_seq_len=S_txt, device=torch.device("cpu"))
    assert [tuple(f.shape) for f in freqs] == [(S_img, Dh // 2), (S_txt, Dh // 2)]

    def stock(rope, norm_q):
        iq = img_q if norm_q is None else norm_q(img_q)
        ik, tq, tk = attn.norm_k(img_k), attn.norm_added_q(txt_q), attn.norm_added_k(txt_k)
        if rope is not None:
            fi, ft = rope
            iq, ik = apply_rotary_emb_qwen(iq, fi, use_real=False), apply_rotary_emb_qwen(ik, fi, use_real=False)
            tq, tk = apply_rotary_emb_qwen(tq, ft, use_real=False), apply_rotary_emb_qwen(tk, ft, use_real=False)
        return torch.cat([tq, iq], dim=1), torch.cat([tk, ik], dim=1)

    with torch.no_grad():
        for rope in (freqs, None):
            got = qwenimage.qk_norm_rope(attn, img_q, img_k, txt_q, txt_k, rope)
            want = stock(rope, attn.norm_q)
            assert all(same_bits(g, w) for g, w in zip(got, want)), rope is None
        norm_q, attn.norm_q = attn.norm_q, None
        try:
            got = qwenimage.qk_norm_rope(attn, img_q, img_k, txt_q, txt_k, freqs)
        finally:
            attn.norm_q = norm_q
        want = stock(freqs, None)
        assert all(same_bits(g, w) for g, w in zip(got, want))
        assert not same_bits(want[0], stock(freqs, attn.norm_q)[0])  # the missing norm mattered


def test_missing_qk_norms_keep_stock_output():
    """Blocks whose attention lacks some q/k norms (set to None, as qk_norm=None builds
    them) run diffusers' branches through the copy: the same bits as stock."""
    model = _random_qk_weights(_model("edit-2511", torch.bfloat16))
    model.transformer_blocks[0].attn.norm_q = None
    model.transformer_blocks[1].attn.norm_added_k = None
    check_identity(model, _cases(model)[2:4])


def test_the_qk_site_changes_the_output_when_it_changes(monkeypatch):
    """A control for the identity tests: the processor's query/key come from the joint
    site (perturb it and the output moves)."""
    model = _random_qk_weights(_model("image"))
    kw = _inputs(model, 2)
    ref = run(model, kw)
    real = sites.joint_qk_norm_rope_site
    monkeypatch.setattr(sites, "joint_qk_norm_rope_site",
                        lambda sources, freqs, rope: tuple(t * 1.5 for t in real(sources, freqs, rope)))
    with bitfuse.accelerate(model):
        out = run(model, kw)
    assert not same_bits(out[0], ref[0])


# ---------------------------------------------------------------- tiers


def test_quality_high_mounts_on_every_site_and_a_request_overrides_it(monkeypatch):
    model = _model("edit-2511", torch.bfloat16)
    check_high_mount(model, _inputs(model, 2, condition_images=CONDITION), lambda: _recording_sites(monkeypatch))


def test_quality_high_is_all_or_nothing():
    """An affine norm has no one-pass kernel: "high" is refused for the whole model and
    nothing is left installed; lossless routes it (the norm, then the exact modulate)."""
    model = _model("image")
    block = model.transformer_blocks[1]
    block.txt_norm2 = torch.nn.LayerNorm(block.dim, eps=1e-6)
    with torch.no_grad():
        block.txt_norm2.weight.normal_()
    with pytest.raises(bitfuse.MountError, match="transformer_blocks.1"):
        bitfuse.accelerate(model, quality="high")
    assert is_stock(model)
    check_identity(model, [_inputs(model, 2)])


# ---------------------------------------------------------------- torch.compile


def test_compile_traces_the_plain_expressions():
    """Under torch.compile the sites emit diffusers' expressions: the traced graphs hold
    aten's layer_norm and no bitfuse op, and the compiled accelerated model equals stock."""
    torch._dynamo.reset()
    model = _model("edit-2511", torch.bfloat16)
    kw = _inputs(model, 1, condition_images=CONDITION)
    ref = run(model, kw)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    try:
        with bitfuse.accelerate(model):
            assert_same(run(torch.compile(model, backend=backend), kw), ref)
        targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
        assert sum("layer_norm" in t for t in targets) == 4 * len(model.transformer_blocks) + 1
        assert not any("bitfuse" in t for t in targets)
    finally:
        torch._dynamo.reset()


def test_compile_repeated_blocks_fullgraph_equals_stock():
    """diffusers' regional compile of the accelerated blocks traces whole (fullgraph)."""
    torch._dynamo.reset()
    model = _model("edit-2511", torch.bfloat16)
    kw = _inputs(model, 2, condition_images=CONDITION, text_lengths=[7, 3])
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
    """A stand-in for QwenImagePipeline (its denoising loop calls `self.transformer` for the
    conditional and the unconditional prompt, batch 1 each): accelerate(pipe) accelerates
    pipe.transformer, and restore() gives the stock model back."""
    model = _model("image", torch.bfloat16)
    pipe = types.SimpleNamespace(transformer=model)
    cond, uncond = _inputs(model, 1, 9, seed=1), _inputs(model, 1, 3, seed=1)
    refs = [run(pipe.transformer, kw) for kw in (cond, uncond)]
    with bitfuse.accelerate(pipe) as handle:
        assert handle.model is model and handle.pipeline is pipe and len(handle.sites) == 3
        for kw, ref in zip((cond, uncond), refs):
            assert_same(run(pipe.transformer, kw), ref)
        assert bitfuse.accelerate(pipe) is handle
    assert is_stock(model)


def test_restore_is_complete_and_idempotent():
    model = _model("image")
    stock_norm_out = model.norm_out.forward
    handle = bitfuse.accelerate(model)
    assert model.transformer_blocks[0].forward.__func__ is qwenimage._block_forward
    assert model.norm_out.forward.__func__ is adaln.FORWARDS[type(model.norm_out)]
    handle.restore()
    handle.restore()
    assert is_stock(model) and not handle.active and model.norm_out.forward == stock_norm_out


def test_refuses_a_changed_diffusers_source(monkeypatch):
    model = _model("image")
    monkeypatch.setitem(qwenimage.VERIFIED_SOURCES, "QwenImageTransformerBlock._modulate", "0" * 64)
    with pytest.raises(UnsupportedVersionError, match=r"QwenImageTransformerBlock\._modulate differs"):
        bitfuse.accelerate(model)
    assert is_stock(model)
    with pytest.warns(UserWarning, match="differs"):
        bitfuse.accelerate(model, force=True).restore()


@pytest.mark.parametrize("name", ["QwenDoubleStreamAttnProcessor2_0.__call__", "RMSNorm.forward",
                                  "apply_rotary_emb_qwen"])
def test_refuses_a_changed_attention_source_and_force_installs_it(monkeypatch, name):
    """The processor's copy and what qk_norm_rope reproduces are pinned: a changed source
    is refused with nothing installed; force=True warns and installs everything (the
    processors included), with stock's output on this diffusers, and restores."""
    model = _random_qk_weights(_model("edit-2511", torch.bfloat16))
    cases = _cases(model)[2:4]
    monkeypatch.setitem(qwenimage.VERIFIED_SOURCES, name, "0" * 64)
    with pytest.raises(UnsupportedVersionError, match=re.escape(name) + " differs"):
        bitfuse.accelerate(model)
    assert is_stock(model)
    refs = [run(model, kw) for kw in cases]
    with pytest.warns(UserWarning, match="differs"):
        handle = bitfuse.accelerate(model, force=True)
    try:
        assert all(type(p) is qwenimage.PROCESSORS[QwenDoubleStreamAttnProcessor2_0] for p in _processors(model))
        for kw, ref in zip(cases, refs):
            assert_same(run(model, kw), ref)
    finally:
        handle.restore()
    assert is_stock(model)



# ---------------------------------------------------------------- the real kernels, interpreted


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton's interpreter (CPU runs)")
def test_the_kernels_read_qwen_layouts_through_the_gate(monkeypatch):
    """fp32 under Triton's interpreter: the gated residual kernel is verified bitwise on
    both of Qwen-Image's parameter layouts (the strided [B, 1, D] views and the
    `where`'s per-token [B, S, D]) and the output keeps stock's bits. (The LayerNorm
    kernel reproduces CUDA's reduction order, not the CPU's: its verdict here may be a
    mismatch, which falls back to eager; the GPU tests judge it.)"""
    model = _model("edit-2511")
    kw = _inputs(model, 2, 3, condition_images=CONDITION)
    ref = run(model, kw)
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    with bitfuse.accelerate(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)
        assert_same(run(model, kw), ref)
    verified = {v.signature.rsplit(" ", 1)[1] for v in policy.verdicts() if v.op == "gated_residual" and v.active}
    assert verified == {"per-sample/strided", "per-token"}, [v.signature for v in policy.verdicts()]


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs triton's interpreter (CPU runs)")
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_qk_kernel_runs_on_the_processors_operands(monkeypatch, variant):
    """fp32 under Triton's interpreter, heads of 32 (narrower rows are refused by the
    kernel's planner): the processor's call reaches the fused q/k norm + RoPE kernel
    through the gate (a verdict for Qwen's layout: diffusers' norm, complex RoPE, two
    sources, weights), which runs without error. The kernel reproduces CUDA's reduction
    order, not the CPU's, so its verdict here may be a mismatch (then eager runs; the
    GPU tests judge the bits); the output is stock's either way."""
    model = _random_qk_weights(_model(variant, attention_head_dim=32, num_attention_heads=2,
                                      axes_dims_rope=(8, 12, 12)))
    kw = _inputs(model, 2, 3, condition_images=CONDITION)
    ref = run(model, kw)
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    with bitfuse.accelerate(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)
        outs = [run(model, kw) for _ in range(2)]
    for out in outs:
        assert_same(out, ref)
    qk = [v for v in policy.verdicts() if v.op == "qk_norm_rope"]
    assert qk and all(v.status in ("verified", "mismatch") for v in qk), [(v.signature, v.status, v.detail) for v in qk]
    assert all(" diffusers complex " in v.signature and "2 sources" in v.signature and " weight" in v.signature
               for v in qk), [v.signature for v in qk]
