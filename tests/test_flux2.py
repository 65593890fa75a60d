"""FLUX.2 (diffusers Flux2Transformer2DModel) on CPU: bitfuse's forwards are faithful.

As for FLUX.1 (tests/test_flux.py): on CPU every site takes its eager path, so
equality with stock diffusers checks the copies, the install, the dispatch and
restore. FLUX.2's modulation is computed once per forward by shared modules and
split in each block; in KV-extract mode (reference-image tokens, the Klein KV
pipeline's first step) it is per token."""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import models, policy, sites  # noqa: E402
from bitfuse.models import UnsupportedVersionError, flux2  # noqa: E402
from bitfuse.models.flux2_configs import build_model, make_inputs, tiny_config, use_kv_processors  # noqa: E402
from bitfuse.ops import _params  # noqa: E402
from bitfuse.ops._params import value  # noqa: E402
from model_checks import assert_same, check_identity, is_stock, run  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMALL = dict(height=64, width=48, text_tokens=5)  # 4 x 3 image tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(dtype=torch.float32, seed=0, kv=False, **overrides):
    """kv: the KV-cache processors (bitfuse leaves them alone), for reference tokens."""
    model = build_model(tiny_config(**overrides), dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the q/k RMSNorm weights initialise to ones: draw them, so that a mix-up shows
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen))
    if kv:
        use_kv_processors(model)
    return model


def _assert_equal(out, ref):
    """The sample, and in KV-extract mode the cached reference K/V of every block."""
    assert isinstance(out, tuple) and len(out) == len(ref)
    assert_same(out[:1], ref[:1])
    if len(ref) == 2:
        caches = [(a, b) for kind in ("double_block_caches", "single_block_caches")
                  for a, b in zip(getattr(out[1], kind), getattr(ref[1], kind))]
        assert caches and out[1].num_ref_tokens == ref[1].num_ref_tokens
        assert all(torch.equal(a.k_ref, b.k_ref) and torch.equal(a.v_ref, b.v_ref) for a, b in caches)


def _outliers(kw, channels=(1, 5), factor=300.0):
    kw = dict(kw)
    for name in ("hidden_states", "encoder_hidden_states"):
        x = kw[name].clone()
        x[..., list(channels)] *= factor
        kw[name] = x
    return kw


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_identity(dtype, quality):
    """Per-sample timesteps, the pipeline's shared one, no guidance (Klein), odd token
    counts, outlier channels; then with the KV processors, per-token modulation (KV
    extract with reference tokens)."""
    model = _model(DTYPES[dtype])
    cases = [
        make_inputs(model, batch=2, per_sample_t=True, **SMALL),
        make_inputs(model, batch=1, height=48, width=80, text_tokens=7, guidance_scale=None, seed=1),
        _outliers(make_inputs(model, batch=3, per_sample_t=True, seed=2, **SMALL)),
    ]
    check_identity(model, cases, quality=quality, compare=_assert_equal)
    use_kv_processors(model)
    check_identity(model, [make_inputs(model, batch=2, per_sample_t=True, ref_tokens=3, seed=3, **SMALL)],
                   quality=quality, compare=_assert_equal)


def test_identity_without_a_guidance_embedding():
    model = _model(torch.bfloat16, guidance_embeds=False)
    check_identity(model, [make_inputs(model, batch=2, per_sample_t=True, guidance_scale=None, **SMALL)],
                   compare=_assert_equal)


def test_processors_route_the_qk_norms_and_rope_and_come_back(monkeypatch):
    """The default processors switch class (keeping their backend setting) and send their
    q/k norms and RoPE through flux.qk_norm_rope: per attention, with the text stream in
    double blocks, without it in single blocks. The KV processors are left alone."""
    model = _model()
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    processors = {id(m): m.processor for m in model.modules() if hasattr(m, "processor")}
    for p in processors.values():
        p._attention_backend = "native"
    calls = []
    real = flux2.qk_norm_rope
    monkeypatch.setattr(flux2, "qk_norm_rope", lambda attn, q, k, eq, ek, rope: (
        calls.append(eq is not None), real(attn, q, k, eq, ek, rope))[1])
    with bitfuse.accelerate(model):
        assert {type(p).__name__ for p in processors.values()} == {"_AttnProcessor", "_ParallelSelfAttnProcessor"}
        _assert_equal(run(model, kw), ref)
    assert calls == [True] * 2 + [False] * 2
    assert all(m.processor is processors[id(m)] and type(m.processor).__module__.startswith("diffusers.")
               and m.processor._attention_backend == "native" for m in model.modules() if hasattr(m, "processor"))
    use_kv_processors(model)
    with bitfuse.accelerate(model):
        assert all(type(m.processor).__module__.startswith("diffusers.") for m in model.modules()
                   if hasattr(m, "processor"))


def test_sites_change_the_output_when_they_change(monkeypatch):
    model = _model()
    kw = make_inputs(model, batch=2, **SMALL)
    ref = run(model, kw)
    real = sites.gated_residual_site
    monkeypatch.setattr(sites, "gated_residual_site", lambda x, y, gate: real(x, y, value(gate) * 1.5))
    with bitfuse.accelerate(model):
        out = run(model, kw)
    assert not torch.equal(out[0], ref[0])


# ---------------------------------------------------------------- every site goes through bitfuse

_SITE_FUNCS = ("rms_norm_modulate_site", "layer_norm_modulate_site", "modulate_site", "gated_residual_site")


@contextlib.contextmanager
def _recording_sites(monkeypatch):
    """Site functions replaced by recorders (outermost calls only) of (site function,
    tier the norm site resolves, its site name, the parameters as passed)."""
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
                records.append((name, sites._tier(block) if site else None, site.name if site else None, params))
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return real(*args, **kwargs)
            finally:
                depth.n -= 1

        return recorder

    for name in _SITE_FUNCS:
        monkeypatch.setattr(sites, name, wrap(name, getattr(sites, name)))
    yield records


def _counts(records):
    out = {}
    for name, *_ in records:
        out[name] = out.get(name, 0) + 1
    return out


def _is_view_in_place(p: torch.Tensor) -> bool:
    """A parameter diffusers made by `chunk`: a view into the shared modulation tensor,
    reaching the site without a densifying copy."""
    return p._base is not None and p.untyped_storage().nbytes() > p.numel() * p.element_size()


@pytest.mark.parametrize("ref_tokens", [0, 3], ids=["per-sample", "per-token"])
def test_every_adaln_site_is_routed(monkeypatch, ref_tokens):
    model = _model(kv=bool(ref_tokens))
    kw = make_inputs(model, batch=2, per_sample_t=True, ref_tokens=ref_tokens, **SMALL)
    ref = run(model, kw)
    with _recording_sites(monkeypatch) as records:
        assert run(model, kw) is not None and records == []  # stock: no site calls
        with bitfuse.accelerate(model) as handle:
            out = run(model, kw)
            assert handle.routed == {"Flux2TransformerBlock": 2, "Flux2SingleTransformerBlock": 2,
                                     "AdaLayerNormContinuous": 1}
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    # double block: norm1, norm1_context, norm2, norm2_context, 4 gated residuals; single block: 1 + 1;
    # the head: norm_out
    assert _counts(records) == {"layer_norm_modulate_site": 4 * double + single + 1,
                                "gated_residual_site": 4 * double + single}
    names = {r[2] for r in records if r[0] == "layer_norm_modulate_site"}
    assert names == {"norm_out"} | {f"transformer_blocks.{i}" for i in range(double)} | {
        f"single_transformer_blocks.{i}" for i in range(single)}
    # block parameters: Flux2Modulation.split's views, [B, 1, D] per sample; with reference
    # tokens the image stream's and the single stream's are [B, S, D] per token
    D, tokens, text = model.inner_dim, kw["hidden_states"].shape[1], SMALL["text_tokens"]
    shapes = {tuple(p.shape) for r in records if r[2] != "norm_out" for p in r[3]}
    expected = {(2, 1, D)} if not ref_tokens else {(2, tokens, D), (2, 1, D), (2, text + tokens, D)}
    assert shapes == expected
    assert all(_is_view_in_place(p) for r in records for p in r[3])
    _assert_equal(out, ref)


def test_quality_high_mounts_on_every_site(monkeypatch):
    model = _model(torch.bfloat16, kv=True)
    kw = make_inputs(model, batch=2, per_sample_t=True, ref_tokens=3, **SMALL)
    ref = run(model, kw)
    with bitfuse.accelerate(model, quality="high"):
        marked = sites.sites_of(model)
        assert len(marked) == 5 and all(s.tier == "high" for s in marked)
        with _recording_sites(monkeypatch) as records:
            out = run(model, kw)
            with bitfuse.quality("lossless"):
                out_lossless = run(model, kw)
        n = len(records) // 2
        tiers = [{r[1] for r in half if r[2] is not None} for half in (records[:n], records[n:])]
        assert n > 0 and tiers == [{"high"}, {"lossless"}]
    _assert_equal(out, ref)
    _assert_equal(out_lossless, ref)
    assert is_stock(model)


def test_the_swiglus_route_through_the_concatenation_site(monkeypatch):
    """The single blocks' parallel processor sends its attention output and its MLP half
    to `sites.cat_act_site` as "swiglu"; each feed-forward (image and text streams of
    every double block) sends its SwiGLU alone. Output: stock's; perturbing the site's
    result moves it (the control)."""
    model = _model()
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    real, calls = sites.cat_act_site, []

    def recording(a, m, act, dim=-1):
        calls.append((act, a is not None))
        return real(a, m, act, dim)

    monkeypatch.setattr(sites, "cat_act_site", recording)
    with bitfuse.accelerate(model):
        _assert_equal(run(model, kw), ref)
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    assert sorted(calls) == sorted([("swiglu", False)] * 2 * double + [("swiglu", True)] * single)
    monkeypatch.setattr(sites, "cat_act_site", lambda a, m, act, dim=-1: real(a, m, act, dim) * 1.5)
    with bitfuse.accelerate(model):
        assert not torch.equal(run(model, kw)[0], ref[0])


def test_a_swiglu_that_is_not_stock_runs_as_a_module():
    """A Flux2SwiGLU with a hook, or whose gate is not a plain nn.SiLU, is called as a
    module: the hook sees every call, the output is stock's."""
    model = _model()
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    seen = []
    ff = model.transformer_blocks[0].ff
    single = model.single_transformer_blocks[0].attn
    handle = ff.act_fn.register_forward_hook(lambda *a: seen.append("ff"))
    single.mlp_act_fn.gate_fn = torch.nn.SiLU(inplace=True)
    try:
        ref = run(model, kw)
        stock_seen, seen[:] = list(seen), []
        with bitfuse.accelerate(model):
            _assert_equal(run(model, kw), ref)
    finally:
        handle.remove()
    assert seen == stock_seen == ["ff"]
    assert not flux2._plain_swiglu(single.mlp_act_fn) and flux2._plain_swiglu(model.transformer_blocks[0].ff_context.act_fn)


def test_pointwise_kernels_run_on_the_models_operands(monkeypatch):
    """fp32 under Triton's interpreter, per token (KV extract): the gated residual kernel
    runs on the blocks' [B, S, D] and [B, 1, D] split views and is verified; the norm
    kernels (CUDA's reduction order) fall back to eager on CPU. Output: stock's."""
    pytest.importorskip("triton")
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    model = _model(kv=True)
    kw = make_inputs(model, batch=2, per_sample_t=True, ref_tokens=3, **SMALL)
    ref = run(model, kw)
    with bitfuse.accelerate(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [run(model, kw) for _ in range(2)]
    for out in outs:
        _assert_equal(out, ref)
    verified = {v.signature for v in policy.verdicts() if v.op == "gated_residual" and v.status == "verified"}
    assert any("per-token" in s for s in verified) and any("per-sample" in s for s in verified), verified
    assert {v.signature for v in policy.verdicts() if v.op == "cat_swiglu"}, "the feed-forwards' SwiGLU was not routed"


# ---------------------------------------------------------------- torch.compile


def test_compile_sees_the_plain_expressions():
    torch._dynamo.reset()
    model = _model(torch.bfloat16)
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with bitfuse.accelerate(model):
        _assert_equal(run(torch.compile(model, fullgraph=True, backend=backend), kw), ref)
    code = "\n".join(g.code for g in graphs)
    assert len(graphs) == 1 and "layer_norm" in code and "bitfuse" not in code
    torch._dynamo.reset()


def test_compile_with_graph_breaks_equals_stock():
    torch._dynamo.reset()
    model = _model(torch.bfloat16, kv=True)
    kw = make_inputs(model, batch=2, per_sample_t=True, ref_tokens=3, **SMALL)
    ref = run(model, kw)
    with bitfuse.accelerate(model):
        _assert_equal(run(torch.compile(model, fullgraph=False, backend="eager"), kw), ref)
    torch._dynamo.reset()


# ---------------------------------------------------------------- pipelines, registry, pins


def test_a_pipeline_stand_in_is_unwrapped():
    model = _model()
    kw = make_inputs(model, batch=1, **SMALL)
    ref = run(model, kw)
    pipe = types.SimpleNamespace(transformer=model)
    with bitfuse.accelerate(pipe) as handle:
        assert handle.model is model and handle.pipeline is pipe and isinstance(handle, flux2.Flux2Handle)
        _assert_equal(run(model, kw), ref)
    assert is_stock(model) and models.integration_for(model) is flux2


def test_flux2_pipeline_output_is_bit_identical():
    """diffusers' Flux2Pipeline with tiny random components (prompt embeddings passed, no
    text encoder): three denoising steps and the VAE decode, accelerated == stock."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=2,
        layers_per_block=1, norm_num_groups=4, sample_size=16,
    ).eval()
    pipe = diffusers.Flux2Pipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                   text_encoder=None, tokenizer=None, transformer=_model())
    pipe.set_progress_bar_config(disable=True)

    def generate():
        gen = torch.Generator().manual_seed(0)
        return pipe(prompt_embeds=torch.randn(2, 5, 24, generator=gen), height=32, width=48, num_inference_steps=3,
                    generator=gen, output_type="pt").images

    ref = generate()
    with bitfuse.accelerate(pipe) as handle:
        assert handle.pipeline is pipe
        out = generate()
    assert ref.shape == (2, 3, 32, 48) and torch.equal(out, ref)


def test_refuses_a_changed_diffusers_source(monkeypatch):
    model = _model()
    monkeypatch.setitem(flux2.VERIFIED_SOURCES, "Flux2TransformerBlock.forward", "0" * 64)
    with pytest.raises(UnsupportedVersionError, match="Flux2TransformerBlock.forward differs"):
        bitfuse.accelerate(model)
    assert is_stock(model)



def test_cuda_graphs_wrap_and_restore():
    """accelerate(cuda_graphs=True) (emulated capture on CPU), per token: one graph, replayed
    with new inputs each call, stock bits (the KV cache included); restore() removes it all."""
    from bitfuse import graphs

    model = _model(kv=True)
    cases = [make_inputs(model, batch=2, per_sample_t=True, ref_tokens=3, seed=s, **SMALL) for s in range(3)]
    refs = [run(model, kw) for kw in cases]
    backend = graphs.EmulatedGraphBackend()
    with bitfuse.accelerate(model, cuda_graphs=True, backend=backend, warmup=1) as handle:
        for kw, ref in zip(cases, refs):
            _assert_equal(run(model, kw), ref)
        assert backend.captures == 1 and backend.replays == 3
    assert handle.graphs is None and is_stock(model)
