"""FLUX.1 (diffusers FluxTransformer2DModel) on CPU: bitfuse's forwards are faithful.

On CPU every site takes its eager path, so equality with stock diffusers here
checks the copied forwards, the install, the dispatch and restore; the GPU file
(tests/gpu/test_flux_gpu.py) checks the kernels at full width. One test runs the
pointwise kernels in Triton's interpreter (fp32) on the model's own operands."""

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
from bitfuse.models import UnsupportedVersionError, adaln, flux  # noqa: E402
from bitfuse.models.flux_configs import build_model, make_inputs, tiny_config  # noqa: E402
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


def _model(variant="dev", dtype=torch.float32, seed=0, **overrides):
    model = build_model(tiny_config(variant, **overrides), dtype=dtype, seed=seed)
    _random_norm_weights(model)
    return model


def _random_norm_weights(model):
    """The q/k RMSNorm weights initialise to ones: draw them, so that a mix-up shows."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen))


def _outliers(kw, channels=(1, 5), factor=300.0):
    """The same inputs with a few image and text channels scaled up (outlier channels)."""
    kw = dict(kw)
    for name in ("hidden_states", "encoder_hidden_states"):
        x = kw[name].clone()
        x[..., list(channels)] *= factor
        kw[name] = x
    return kw


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_identity(variant, dtype, quality):
    """Per-sample timesteps (a batch of requests at different steps), the pipeline's
    shared one, odd token counts, outlier channels; both tiers (on CPU both are stock bits)."""
    model = _model(variant, DTYPES[dtype])
    cases = [
        make_inputs(model, batch=2, per_sample_t=True, **SMALL),
        make_inputs(model, batch=1, height=48, width=80, text_tokens=7, seed=1),  # 3 x 5 tokens
        _outliers(make_inputs(model, batch=3, per_sample_t=True, seed=2, **SMALL)),
    ]
    check_identity(model, cases, quality=quality)


def test_identity_controlnet_residuals_and_attention_kwargs():
    """The model forward (stock) adds controlnet residuals between our blocks; an
    empty joint_attention_kwargs and return_dict=True pass through."""
    model = _model("dev", torch.bfloat16)
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    gen = torch.Generator().manual_seed(3)
    shape = (2, kw["hidden_states"].shape[1], model.inner_dim)
    controlnet = dict(
        controlnet_block_samples=[torch.randn(shape, generator=gen).bfloat16()],
        controlnet_single_block_samples=[torch.randn(shape, generator=gen).bfloat16() for _ in range(2)],
    )
    cases = [dict(kw, **controlnet), dict(kw, joint_attention_kwargs={})]
    check_identity(model, cases)
    ref = run(model, dict(kw, return_dict=True)).sample
    with bitfuse.accelerate(model):
        assert torch.equal(run(model, dict(kw, return_dict=True)).sample, ref)


def test_sites_change_the_output_when_they_change(monkeypatch):
    """A control for the identity tests: perturb the gated residual site and the output moves."""
    model = _model()
    kw = make_inputs(model, batch=2, **SMALL)
    ref = run(model, kw)
    real = sites.gated_residual_site
    monkeypatch.setattr(sites, "gated_residual_site", lambda x, y, gate: real(x, y, value(gate) * 1.5))
    with bitfuse.accelerate(model):
        out = run(model, kw)
    assert not torch.equal(out[0], ref[0])


def test_single_blocks_route_the_gelu_and_concatenation(monkeypatch):
    """Every single block sends its attention output and its MLP's pre-activation to
    `sites.cat_act_site` as "gelu_tanh" (dim 2); an act_mlp with a hook runs as a module
    where stock runs it (before the attention) and the site only concatenates. The
    output is stock's both ways, and the control (the site's result perturbed) moves it."""
    model = _model()
    kw = make_inputs(model, batch=2, **SMALL)
    ref = run(model, kw)
    real, calls = sites.cat_act_site, []

    def recording(a, m, act, dim=-1):
        calls.append((act, dim, a is not None))
        return real(a, m, act, dim)

    monkeypatch.setattr(sites, "cat_act_site", recording)
    with bitfuse.accelerate(model):
        assert_same(run(model, kw), ref)
    assert calls == [("gelu_tanh", 2, True)] * len(model.single_transformer_blocks)

    order = []
    block = model.single_transformer_blocks[0]
    hooks = [block.act_mlp.register_forward_hook(lambda *a: order.append("act")),
             block.attn.register_forward_hook(lambda *a: order.append("attn"))]
    try:
        ref = run(model, kw)
        stock_order, order[:], calls[:] = list(order), [], []
        with bitfuse.accelerate(model):
            assert_same(run(model, kw), ref)
    finally:
        for h in hooks:
            h.remove()
    assert order == stock_order == ["act", "attn"]
    assert calls[0] == (None, 2, True) and calls[1:] == [("gelu_tanh", 2, True)] * (len(calls) - 1)

    monkeypatch.setattr(sites, "cat_act_site", lambda a, m, act, dim=-1: real(a, m, act, dim) * 1.5)
    with bitfuse.accelerate(model):
        assert not torch.equal(run(model, kw)[0], ref[0])


def test_processors_route_the_qk_norms_and_rope_and_come_back(monkeypatch):
    """FluxAttnProcessor instances switch class (keeping their backend setting) and send
    their q/k norms and RoPE through qk_norm_rope: with the text stream in double blocks,
    without it in single blocks. Another processor class is left alone."""
    model = _model()
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    mine = type("Mine", (diffusers.models.transformers.transformer_flux.FluxAttnProcessor,), {})()
    model.single_transformer_blocks[1].attn.set_processor(mine)
    processors = {id(m): m.processor for m in model.modules() if hasattr(m, "processor")}
    for p in processors.values():
        p._attention_backend = "native"
    calls = []
    real = flux.qk_norm_rope
    monkeypatch.setattr(flux, "qk_norm_rope", lambda attn, q, k, eq, ek, rope: (
        calls.append(eq is not None), real(attn, q, k, eq, ek, rope))[1])
    with bitfuse.accelerate(model):
        assert [type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")] == [
            "_AttnProcessor"] * 3 + ["Mine"]
        assert_same(run(model, kw), ref)
    assert calls == [True, True, False]
    assert all(m.processor is processors[id(m)] and type(m.processor).__module__ != "bitfuse.models.flux"
               and m.processor._attention_backend == "native" for m in model.modules() if hasattr(m, "processor"))


# ---------------------------------------------------------------- every site goes through bitfuse

_SITE_FUNCS = ("rms_norm_modulate_site", "layer_norm_modulate_site", "modulate_site", "gated_residual_site")


@contextlib.contextmanager
def _recording_sites(monkeypatch):
    """Replace the site functions by recorders (outermost calls only: a site's fallback
    calls other sites) of (site function, tier the norm site resolves, its site name,
    the parameters as passed)."""
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
    """A parameter diffusers made by `chunk` (+ `[:, None]` / `unsqueeze(1)`): a view into
    the larger modulation tensor, reaching the site without a densifying copy."""
    return p._base is not None and p.untyped_storage().nbytes() > p.numel() * p.element_size()


def test_every_adaln_site_is_routed(monkeypatch):
    model = _model()
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    with _recording_sites(monkeypatch) as records:
        assert run(model, kw) is not None and records == []  # stock: no site calls
        with bitfuse.accelerate(model) as handle:
            out = run(model, kw)
            assert handle.routed == {"FluxTransformerBlock": 2, "AdaLayerNormZero": 4,
                                     "AdaLayerNormZeroSingle": 2, "AdaLayerNormContinuous": 1}
            assert "routed: FluxTransformerBlock x2" in repr(handle)
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    # double block: norm1, norm1_context (adaLN modules), norm2, norm2_context; 4 gated residuals;
    # single block: its adaLN norm, 1 gated residual; the head: norm_out
    assert _counts(records) == {"layer_norm_modulate_site": 4 * double + single + 1,
                                "gated_residual_site": 4 * double + single}
    names = {r[2] for r in records if r[0] == "layer_norm_modulate_site"}
    assert names == {"norm_out"} | {f"transformer_blocks.{i}{s}" for i in range(double)
                                    for s in ("", ".norm1", ".norm1_context")} | {
        f"single_transformer_blocks.{i}.norm" for i in range(single)}
    params = [p for r in records for p in r[3]]
    assert params and all(p.shape == (2, 1, model.inner_dim) and _is_view_in_place(p) for p in params)
    assert_same(out, ref)


def test_quality_high_mounts_on_every_site(monkeypatch):
    model = _model("dev", torch.bfloat16)
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    with bitfuse.accelerate(model, quality="high") as handle:
        marked = sites.sites_of(model)
        assert len(marked) == sum(handle.routed.values()) == 9 and all(s.tier == "high" for s in marked)
        with _recording_sites(monkeypatch) as records:
            out = run(model, kw)
            with bitfuse.quality("lossless"):
                out_lossless = run(model, kw)
        n = len(records) // 2
        tiers = [{r[1] for r in half if r[2] is not None} for half in (records[:n], records[n:])]
        assert n > 0 and tiers == [{"high"}, {"lossless"}]
    assert_same(out, ref)
    assert_same(out_lossless, ref)
    assert is_stock(model) and not sites.sites_of(model)


def test_pointwise_kernels_run_on_the_models_operands(monkeypatch):
    """fp32 under Triton's interpreter: the gated residual kernel runs on the blocks' real
    operands (per-sample [B, 1, D] chunk views, read in place) and is verified against
    eager; the norm kernels (layer norm + modulate, the q/k norms + RoPE) reproduce
    CUDA's reduction order, not the CPU's, and the single blocks' GELU + concatenation
    computes a stand-in tanh in the interpreter, so they may fall back to eager with a
    warning. The output is stock's either way."""
    pytest.importorskip("triton")
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)
    model = _model()
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    with bitfuse.accelerate(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [run(model, kw) for _ in range(2)]  # first sight, then the verified path
    for out in outs:
        assert_same(out, ref)
    statuses = {(v.op, v.status) for v in policy.verdicts()}
    assert ("gated_residual", "verified") in statuses
    assert {op for op, _ in statuses} == {"gated_residual", "layer_norm_modulate", "qk_norm_rope", "cat_gelu_tanh"}


# ---------------------------------------------------------------- torch.compile


def test_compile_sees_the_plain_expressions():
    """Under torch.compile (fullgraph) the sites trace to the eager expressions: the
    graph has aten's layer_norm and no bitfuse op, and its output is stock's."""
    torch._dynamo.reset()
    model = _model("dev", torch.bfloat16)
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with bitfuse.accelerate(model):
        assert_same(run(torch.compile(model, fullgraph=True, backend=backend), kw), ref)
    code = "\n".join(g.code for g in graphs)
    assert len(graphs) == 1 and "layer_norm" in code and "bitfuse" not in code
    torch._dynamo.reset()


def test_compile_with_graph_breaks_and_repeated_blocks_equal_stock():
    torch._dynamo.reset()
    model = _model("dev", torch.bfloat16)
    kw = make_inputs(model, batch=2, per_sample_t=True, **SMALL)
    ref = run(model, kw)
    with bitfuse.accelerate(model):
        assert_same(run(torch.compile(model, fullgraph=False, backend="eager"), kw), ref)
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
        try:
            assert_same(run(model, kw), ref)
        finally:
            for b in list(model.transformer_blocks) + list(model.single_transformer_blocks):
                b._compiled_call_impl = None
    torch._dynamo.reset()


# ---------------------------------------------------------------- pipelines and the registry


def test_a_pipeline_stand_in_and_a_compiled_wrapper_are_unwrapped():
    model = _model()
    kw = make_inputs(model, batch=1, **SMALL)
    ref = run(model, kw)
    pipe = types.SimpleNamespace(transformer=model)
    with bitfuse.accelerate(pipe) as handle:
        assert handle.model is model and handle.pipeline is pipe and isinstance(handle, flux.FluxHandle)
        assert_same(run(model, kw), ref)
    with bitfuse.accelerate(torch.compile(model, backend="eager")) as handle:
        assert handle.model is model
    assert is_stock(model)


def test_flux_pipeline_output_is_bit_identical():
    """diffusers' FluxPipeline with tiny random components (prompt embeddings passed, no
    text encoders): three denoising steps and the VAE decode, accelerated == stock."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=2,
        layers_per_block=1, norm_num_groups=4, sample_size=16, shift_factor=0.0609, scaling_factor=1.5035,
    ).eval()
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=_model(),
    )
    pipe.set_progress_bar_config(disable=True)

    def generate():
        gen = torch.Generator().manual_seed(0)
        return pipe(
            prompt_embeds=torch.randn(2, 5, 24, generator=gen), pooled_prompt_embeds=torch.randn(2, 16, generator=gen),
            height=32, width=48, num_inference_steps=3, generator=gen, output_type="pt",
        ).images

    ref = generate()
    with bitfuse.accelerate(pipe) as handle:
        assert handle.pipeline is pipe
        out = generate()
    assert ref.shape == (2, 3, 32, 48) and torch.equal(out, ref)


def test_the_registry_picks_flux_before_the_generic_layer():
    model = _model()
    assert models.integration_for(model) is flux

    class Custom(diffusers.FluxTransformer2DModel):
        pass

    torch.manual_seed(0)
    assert models.integration_for(Custom(**tiny_config())) is flux
    assert models.integration_for(diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4)) is adaln


# ---------------------------------------------------------------- the version pin


def test_refuses_a_changed_diffusers_source(monkeypatch):
    """The adaLN modules' sources are FLUX.1's too: a change there refuses FLUX.1."""
    model = _model()
    for name in ("FluxSingleTransformerBlock.forward", "AdaLayerNormContinuous.forward"):
        with monkeypatch.context() as m:
            m.setitem(flux.VERIFIED_SOURCES, name, "0" * 64)
            with pytest.raises(UnsupportedVersionError, match=f"{name} differs"):
                bitfuse.accelerate(model)
            assert is_stock(model)
            with pytest.warns(UserWarning, match="differs"):
                bitfuse.accelerate(model, force=True).restore()


def test_flux_pins_the_adaln_sources_it_reuses():
    """FLUX.1 routes its norms through the generic adaLN copies: their pins are its pins too."""
    assert set(adaln.VERIFIED_SOURCES) <= set(flux.VERIFIED_SOURCES)


def test_cuda_graphs_wrap_and_restore():
    """accelerate(cuda_graphs=True) (emulated capture on CPU): one graph for the signature,
    replayed with new inputs each call, stock bits; restore() removes it all."""
    from bitfuse import graphs

    model = _model()
    cases = [make_inputs(model, batch=2, per_sample_t=True, seed=s, **SMALL) for s in range(3)]
    refs = [run(model, kw) for kw in cases]
    backend = graphs.EmulatedGraphBackend()
    with bitfuse.accelerate(model, cuda_graphs=True, backend=backend, warmup=1) as handle:
        for kw, ref in zip(cases, refs):
            assert_same(run(model, kw), ref)
        assert backend.captures == 1 and backend.replays == 3
        assert handle.graphs.report()["signatures"][0]["segments"] == 1
    assert handle.graphs is None and is_stock(model)
