"""Wan (diffusers WanTransformer3DModel, Wan 2.1 and Wan 2.2 TI2V): bitfuse's forwards are faithful.

On CPU every site falls back to its eager expression, so bitwise equality between the
accelerated and the stock model (built from the same seed, with the dtypes
`from_pretrained` gives: fp32 tables and norms, float64 RoPE tables, bf16 elsewhere)
checks that the copies of the block forward, the model forward and the attention
processor compute exactly what diffusers computes, with every site routed through
bitfuse (counted below). The kernels' indexing is checked in tests/test_wan_ops.py
under Triton's interpreter; their bits on the GPU in tests/gpu/test_wan_gpu.py."""

from __future__ import annotations

import collections
import types

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import sites  # noqa: E402
from bitfuse.models import UnsupportedVersionError, wan  # noqa: E402
from bitfuse.models.wan_configs import (  # noqa: E402
    VARIANTS,
    build_model,
    full_config,
    make_inputs,
    tiny_config,
    video_tokens,
)
from bitfuse.numerics import same_bits  # noqa: E402
from bitfuse.ops._params import Folded, value32  # noqa: E402
from model_checks import assert_same, check_identity, is_stock, run  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZE = {"2.1-14b": (64, 96, 9), "2.2-5b": (128, 160, 9)}  # 3 x 4 x 6 and 3 x 4 x 5 tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(variant="2.1-14b", dtype=torch.bfloat16, seed=0, **overrides):
    return build_model(tiny_config(variant, **overrides), dtype=dtype, seed=seed)


def _inputs(model, variant, batch=1, **options):
    h, w, f = SIZE[variant]
    return make_inputs(model, batch, h, w, f, variant=variant, text_tokens=16, **options)


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_identity(variant, dtype):
    """Wan 2.1 (per-sample timestep) and Wan 2.2 TI2V (per-token timestep), batch 1 and 2."""
    model = _model(variant, DTYPES[dtype])
    check_identity(model, [_inputs(model, variant, 1, seed=1), _inputs(model, variant, 2, seed=2)])


@pytest.mark.parametrize("variant", VARIANTS)
def test_identity_other_layouts(variant):
    """The other timestep layout of each variant, the high tier, no cross-attention norm
    (norm2 is an Identity), return_dict=True, and a wholly bf16 model (tables and norms
    cast too: eager's `table + temb.float()` is still fp32)."""
    model = _model(variant)
    kw = _inputs(model, variant, 2, per_token_timestep=variant != "2.2-5b", seed=3)
    check_identity(model, [kw], quality="high")
    ref = run(model, dict(kw, return_dict=True))
    with bitfuse.accelerate(model):
        out = run(model, dict(kw, return_dict=True))
    assert_same((out.sample,), (ref.sample,))
    plain = _model(variant, cross_attn_norm=False)
    assert isinstance(plain.blocks[0].norm2, torch.nn.Identity)
    check_identity(plain, [_inputs(plain, variant, 1, seed=4)])
    cast = torch.nn.Module.to(_model(variant), torch.bfloat16)
    assert cast.blocks[0].scale_shift_table.dtype is torch.bfloat16
    check_identity(cast, [_inputs(cast, variant, 1, seed=5)])


def test_identity_fused_projections_and_i2v():
    """Fused q/k/v projections (the norms read views of one Linear's output in place) and
    the I2V image branch (added K/V: its norm_added_k runs as diffusers runs it)."""
    model = _model("2.1-14b", added_kv_proj_dim=48, image_dim=32)  # added K/V read the embedded image tokens (inner dim)
    kw = make_inputs(model, 1, *SIZE["2.1-14b"], text_tokens=512, seed=6)  # the processor splits off the last 512
    kw["encoder_hidden_states_image"] = torch.randn(1, 4, 32).to(torch.bfloat16)
    check_identity(model, [kw])
    model = _model("2.2-5b")
    for m in model.modules():
        if isinstance(m, diffusers.models.transformers.transformer_wan.WanAttention):
            m.fuse_projections()
    check_identity(model, [_inputs(model, "2.2-5b", 1, seed=7)])


def test_make_inputs_as_the_pipeline_passes_them():
    """Wan 2.1 at 832 x 480 x 81: latents [1, 16, 21, 60, 104], 32,760 tokens, timestep
    `t.expand(B)`; Wan 2.2 5B at 1280 x 704 x 121: [1, 48, 31, 44, 80], 27,280 tokens, the
    timestep per token [B, S] (expand_timesteps), fp32 as the scheduler's."""
    assert video_tokens("2.1-14b", 480, 832, 81) == 32760
    assert video_tokens("2.2-5b", 704, 1280, 121) == 27280
    cfg = full_config("2.1-14b", layers=1)
    assert (cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"], cfg["in_channels"]) == (5120, 13824, 16)
    cfg = full_config("2.2-5b")
    assert (cfg["num_attention_heads"] * 128, cfg["ffn_dim"], cfg["num_layers"], cfg["in_channels"]) == (3072, 14336, 30, 48)
    model = _model("2.2-5b")
    kw = make_inputs(model, 2, 128, 160, 9, variant="2.2-5b", text_tokens=16, timestep=937.5)
    assert kw["hidden_states"].shape == (2, 12, 3, 8, 10) and kw["hidden_states"].dtype is torch.bfloat16
    assert kw["timestep"].shape == (2, 3 * 4 * 5) and kw["timestep"].dtype is torch.float32
    assert (kw["timestep"] == 937.5).all() and kw["return_dict"] is False
    assert kw["encoder_hidden_states"].shape == (2, 16, 32)
    model = _model("2.1-14b")
    kw = make_inputs(model, 1, 64, 96, 9, text_tokens=16, timestep=500.0)
    assert kw["timestep"].shape == (1,) and kw["hidden_states"].shape == (1, 4, 3, 8, 12)
    with pytest.raises(ValueError, match="unknown Wan variant"):
        tiny_config("2.2")


def test_build_model_keeps_from_pretrained_dtypes():
    model = _model("2.1-14b")
    block = model.blocks[0]
    assert block.scale_shift_table.dtype is torch.float32 and block.norm2.weight.dtype is torch.float32
    assert model.scale_shift_table.dtype is torch.float32
    assert block.attn1.to_q.weight.dtype is torch.bfloat16 and block.attn1.norm_q.weight.dtype is torch.bfloat16
    assert model.rope.freqs_cos.dtype is torch.float32  # get_1d_rotary_pos_embed returns .float()


# ---------------------------------------------------------------- every site goes through bitfuse

_SITE_FUNCS = ("layer_norm_modulate_f32_site", "gated_residual_f32_site", "layer_norm_f32_site",
               "qk_norm_rope_site", "modulate_site", "gated_residual_site", "layer_norm_modulate_site")


def _recording_sites(monkeypatch):
    records = []

    def wrap(name, real):
        def recorder(*args, **kwargs):
            records.append((name, args))
            return real(*args, **kwargs)

        return recorder

    for name in _SITE_FUNCS:
        monkeypatch.setattr(sites, name, wrap(name, getattr(sites, name)))
    return records


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_site_is_routed(monkeypatch, variant):
    """Per block: 2 norm + modulate sites, 2 gated residuals, 1 norm2, 2 q/k norm (+ RoPE)
    sites (self-attention with "wan" RoPE, cross-attention without); the head: 1 norm +
    modulate. The parameters reach the sites as eager builds them: fp32 [B, 1, D] views
    (per-sample), Folded rows of the bf16 temb (per-token)."""
    model = _model(variant)
    kw = _inputs(model, variant, 2)
    ref = run(model, kw)
    records = _recording_sites(monkeypatch)
    with bitfuse.accelerate(model):
        out = run(model, kw)
    assert_same(out, ref)
    n = len(model.blocks)
    counts = collections.Counter(name for name, _ in records)
    assert counts == {"layer_norm_modulate_f32_site": 2 * n + 1, "gated_residual_f32_site": 2 * n,
                      "layer_norm_f32_site": n, "qk_norm_rope_site": 2 * n}
    ropes = [args[6] for name, args in records if name == "qk_norm_rope_site"]
    assert ropes == ["wan", None] * n
    S, D = kw["timestep"].shape[-1] if variant == "2.2-5b" else None, model.config.num_attention_heads * 24
    for name, args in records:
        if name == "gated_residual_f32_site":
            params = [args[2]]
        elif name == "layer_norm_modulate_f32_site" and args[0] is not model.norm_out:
            params = list(args[2:4])
        else:
            continue
        for p in params:
            if variant == "2.2-5b":
                assert p.__class__ is Folded and p.table.dtype is torch.float32 and p.temb.dtype is torch.bfloat16
                assert p.temb.shape == (2, S, D)
            else:
                assert p.__class__ is torch.Tensor and p.dtype is torch.float32 and p.shape == (2, 1, D)
                assert not p.is_contiguous()  # a chunk of the [B, 6, D] sum, read in place


def test_per_token_params_are_eagers_chunks():
    table = torch.randn(1, 6, 8)
    temb = torch.randn(2, 5, 6, 8).to(torch.bfloat16)
    eager = [c.squeeze(2) for c in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    folded = wan._per_token_params(table, temb)
    assert all(f.__class__ is Folded and f.squeeze(2) is f for f in folded)
    assert all(same_bits(value32(f), e) for f, e in zip(folded, eager))
    odd = wan._per_token_params(torch.randn(1, 6, 1), torch.randn(2, 5, 6, 1))  # D = 1: eager's chunks
    assert all(t.__class__ is torch.Tensor for t in odd)


def test_sites_change_the_output_when_they_change(monkeypatch):
    """A control for the identity tests: perturb one site and the output moves."""
    model = _model("2.2-5b")
    kw = _inputs(model, "2.2-5b", 1)
    ref = run(model, kw)
    real = sites.gated_residual_f32_site
    monkeypatch.setattr(sites, "gated_residual_f32_site", lambda x, y, gate: real(x, y * 1.5, gate))
    with bitfuse.accelerate(model):
        out = run(model, kw)
    assert not same_bits(out[0], ref[0])


# ---------------------------------------------------------------- tiers, compile


def test_quality_high_mounts_on_every_site():
    model = _model("2.1-14b")
    with bitfuse.accelerate(model, quality="high") as handle:
        marked = sites.sites_of(model)
        assert len(marked) == len(model.blocks) + 1 and all(s.tier == "high" for s in marked)
        assert handle.quality == "high"
    assert is_stock(model)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compile_traces_the_plain_expressions(variant):
    """Under torch.compile the sites emit diffusers' expressions: no bitfuse op in the
    traced graphs, aten's layer norms and RMSNorms there, and the output equals stock."""
    torch._dynamo.reset()
    model = _model(variant)
    kw = _inputs(model, variant, 1)
    ref = run(model, kw)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    try:
        with bitfuse.accelerate(model):
            assert_same(run(torch.compile(model, backend=backend), kw), ref)
        targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
        assert sum("layer_norm" in t for t in targets) == 3 * len(model.blocks) + 1
        assert not any("bitfuse" in t for t in targets)
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------- pipelines, versions, restore


def test_a_pipeline_is_accelerated_through_its_transformer():
    model = _model("2.1-14b")
    pipe = types.SimpleNamespace(transformer=model)
    kw = _inputs(model, "2.1-14b", 1)
    ref = run(model, kw)
    with bitfuse.accelerate(pipe) as handle:
        assert handle.model is model and handle.pipeline is pipe and len(handle.sites) == len(model.blocks) + 1
        assert_same(run(pipe.transformer, kw), ref)
        assert bitfuse.accelerate(pipe) is handle
    assert is_stock(model)


def test_restore_is_complete_and_idempotent():
    model = _model("2.1-14b")
    handle = bitfuse.accelerate(model)
    assert model.blocks[0].forward.__func__ is wan._block_forward
    assert type(model.blocks[0].attn1.processor) is wan._AttnProcessor
    handle.restore()
    handle.restore()
    assert is_stock(model) and not handle.active


def test_refuses_a_changed_diffusers_source(monkeypatch):
    model = _model("2.1-14b")
    monkeypatch.setitem(wan.VERIFIED_SOURCES, "WanAttnProcessor.__call__", "0" * 64)
    with pytest.raises(UnsupportedVersionError, match=r"WanAttnProcessor\.__call__ differs"):
        bitfuse.accelerate(model)
    assert is_stock(model)
    with pytest.warns(UserWarning, match="differs"):
        bitfuse.accelerate(model, force=True).restore()

