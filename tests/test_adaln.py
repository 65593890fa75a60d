"""The generic adaLN layer (bitfuse.models.adaln) on CPU: diffusers' shared adaLN modules
routed in any diffusers model, bit for bit; models without one are refused.

On CPU every site takes its eager path: these tests check the copies, which modules are
routed and which site each takes, the tiers, restore and the registry's choice."""

from __future__ import annotations

import types

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers.models.modeling_utils import ModelMixin  # noqa: E402
from diffusers.models.normalization import (  # noqa: E402
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    SD35AdaLayerNormZeroX,
)

import bitfuse  # noqa: E402
from bitfuse import models, policy, sites  # noqa: E402
from bitfuse.models import UnsupportedModelError, adaln, flux, flux2, ltx2  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Toy(ModelMixin):
    """A diffusers model made of the four shared adaLN modules, each output returned."""

    def __init__(self, dim=32, norm_type="layer_norm", affine=False):
        super().__init__()
        self.zero = AdaLayerNormZero(dim)
        self.single = AdaLayerNormZeroSingle(dim)
        self.x = SD35AdaLayerNormZeroX(dim)
        self.out = AdaLayerNormContinuous(dim, dim, elementwise_affine=affine, eps=1e-6, norm_type=norm_type)

    def forward(self, x, emb):
        h, *zero = self.zero(x, emb=emb)
        h, gate = self.single(h, emb=emb)
        h, *x_out = self.x(h, emb=emb)
        return (self.out(h, emb), *zero, gate, *x_out)


def _toy(dtype=torch.float32, dim=32, **kwargs):
    torch.manual_seed(0)
    model = Toy(dim, **kwargs).to(dtype).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None:
                m.weight.normal_()
    return model


def _toy_inputs(model, batch=3, tokens=7, seed=0):
    """x [B, S, D] with an outlier channel, a zero row, signed zeros, an inf and a NaN row
    (sample 0, last tokens); per-sample conditioning emb [B, D]."""
    dim = model.zero.linear.in_features
    dtype = model.zero.linear.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, dim, generator=gen)
    x[..., 3] *= 200
    x[0, 1] = 0.0
    x[0, 2, ::2] = -0.0
    x[0, -2, 5] = float("inf")
    x[0, -1, 7] = float("nan")
    return dict(x=x.to(dtype), emb=torch.randn(batch, dim, generator=gen).to(dtype))


def _run(model, kw):
    with torch.no_grad():
        out = model(**kw)
    return out if isinstance(out, tuple) else (out,)


def _assert_same(out, ref):
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert policy.same_bits(o, r), f"{int((o != r).sum())} of {r.numel()} elements differ"


def _is_stock(model) -> bool:
    return all("forward" not in m.__dict__ for m in model.modules())


def _check_identity(model, kwargs_list, quality="lossless"):
    refs = [_run(model, kw) for kw in kwargs_list]
    handle = bitfuse.accelerate(model, quality=quality)
    try:
        assert isinstance(handle, adaln.AdaLNHandle) and not _is_stock(model)
        for kw, ref in zip(kwargs_list, refs):
            _assert_same(_run(model, kw), ref)
    finally:
        handle.restore()
    assert _is_stock(model) and not sites.sites_of(model) and handle.routed == {}
    for kw, ref in zip(kwargs_list, refs):
        _assert_same(_run(model, kw), ref)
    return handle


def _recording(monkeypatch):
    calls = []
    for name in ("layer_norm_modulate_site", "rms_norm_modulate_site"):
        real = getattr(sites, name)

        def recorder(block, norm, x, scale, shift, _name=name, _real=real):
            calls.append((_name, block._bitfuse_site.name, sites._tier(block)))
            return _real(block, norm, x, scale, shift)

        monkeypatch.setattr(sites, name, recorder)
    return calls


# ---------------------------------------------------------------- the four modules


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("dim", [32, 36])
@pytest.mark.parametrize("norm_type", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_module_is_routed_and_exact(monkeypatch, dtype, norm_type, dim, quality):
    """Each module's site, named by its path, at the tier mounted; AdaLayerNormContinuous
    with diffusers' RMSNorm takes the RMS site; SD35AdaLayerNormZeroX's one norm feeds two
    fused sites. Outliers, zeros of both signs, inf and NaN rows: the same bits as stock."""
    model = _toy(DTYPES[dtype], dim, norm_type=norm_type)
    cases = [_toy_inputs(model), _toy_inputs(model, batch=1, tokens=5, seed=1)]
    calls = _recording(monkeypatch)
    with bitfuse.accelerate(model, quality=quality) as handle:
        assert repr(handle).endswith("routed: AdaLayerNormZero x1, AdaLayerNormZeroSingle x1, "
                                     "SD35AdaLayerNormZeroX x1, AdaLayerNormContinuous x1>")
    _check_identity(model, cases, quality)
    out_site = "rms_norm_modulate_site" if norm_type == "rms_norm" else "layer_norm_modulate_site"
    per_call = [("layer_norm_modulate_site", "zero", quality), ("layer_norm_modulate_site", "single", quality),
                ("layer_norm_modulate_site", "x", quality), ("layer_norm_modulate_site", "x", quality),
                (out_site, "out", quality)]
    assert calls == per_call * len(cases)


def test_a_norm_without_a_fused_kernel_is_exact_and_holds_back_high():
    """An affine LayerNorm (or any norm the kernels do not reproduce) still runs our copy,
    where the site calls the norm module as is, then the exact modulate: stock bits. Its
    site has no one-pass kernel, so "high" is refused for the whole model, nothing installed."""
    model = _toy(torch.bfloat16, affine=True)
    _check_identity(model, [_toy_inputs(model)])
    with pytest.raises(bitfuse.MountError, match="out: no one-pass kernel for LayerNorm"):
        bitfuse.accelerate(model, quality="high")
    assert _is_stock(model) and not sites.sites_of(model)


def test_hooked_norms_take_the_module():
    """A hook on a norm (added after accelerate) is honoured: the site calls the module."""
    model = _toy()
    kw = _toy_inputs(model)
    ref = _run(model, kw)
    seen = []
    with bitfuse.accelerate(model):
        hook = model.zero.norm.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        _assert_same(_run(model, kw), ref)
        hook.remove()
    assert len(seen) == 1


# ---------------------------------------------------------------- real diffusers models


def _sd3(dtype=torch.float32):
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
        dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    return torch.nn.Module.to(model, dtype).eval()


def _sd3_inputs(model, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = model.dtype
    return dict(
        hidden_states=torch.randn(batch, 4, 8, 8, generator=gen).to(dtype),
        encoder_hidden_states=torch.randn(batch, 5, 24, generator=gen).to(dtype),
        pooled_projections=torch.randn(batch, 16, generator=gen).to(dtype),
        timestep=torch.rand(batch, generator=gen) * 1000,
        return_dict=False,
    )


@pytest.mark.parametrize("quality", ["lossless", "high"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sd3(dtype, quality):
    """SD3.5-style: AdaLayerNormZero blocks, an SD35AdaLayerNormZeroX (dual attention) block,
    the last block's context AdaLayerNormContinuous and norm_out; the blocks' inline norm2
    modulation stays diffusers'."""
    model = _sd3(DTYPES[dtype])
    with bitfuse.accelerate(model, quality=quality) as handle:
        assert handle.routed == {"SD35AdaLayerNormZeroX": 1, "AdaLayerNormZero": 4, "AdaLayerNormContinuous": 2}
        assert [s.name for s in handle.sites][-2:] == ["transformer_blocks.2.norm1_context", "norm_out"]
        assert all(s.tier == quality for s in handle.sites)
    _check_identity(model, [_sd3_inputs(model), _sd3_inputs(model, batch=1, seed=1)], quality)


def test_sd3_under_torch_compile():
    torch._dynamo.reset()
    model = _sd3(torch.bfloat16)
    kw = _sd3_inputs(model)
    ref = _run(model, kw)
    with bitfuse.accelerate(model):
        _assert_same(_run(torch.compile(model, backend="eager"), kw), ref)
    torch._dynamo.reset()


def test_dit_class_conditioned_zero_norms():
    """DiT: AdaLayerNormZero computing its own embedding (timestep and class labels)."""
    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                            out_channels=8, num_layers=2, sample_size=8, num_embeds_ada_norm=10)
    model = torch.nn.Module.to(model, torch.bfloat16).eval()
    kw = dict(hidden_states=torch.randn(2, 4, 8, 8).bfloat16(), timestep=torch.tensor([3, 700]),
              class_labels=torch.tensor([1, 7]), return_dict=False)
    with bitfuse.accelerate(model) as handle:
        assert handle.routed == {"AdaLayerNormZero": 2}
    _check_identity(model, [kw])


def test_models_without_a_recognised_module_are_refused():
    torch.manual_seed(0)
    pixart = diffusers.PixArtTransformer2DModel(  # adaLN-single, modulation written inline
        sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=2, caption_channels=16,
        in_channels=4, cross_attention_dim=16, out_channels=8, norm_type="ada_norm_single")
    with pytest.raises(UnsupportedModelError, match="PixArtTransformer2DModel: it has no adaLN module.*found: none"):
        bitfuse.accelerate(pixart)
    aura = diffusers.AuraFlowTransformer2DModel(  # AdaLayerNormZero, but over FP32LayerNorm
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    with pytest.raises(UnsupportedModelError, match=r"AdaLayerNormZero with FP32LayerNorm"):
        bitfuse.accelerate(aura)
    for model in (pixart, aura):
        assert _is_stock(model) and not sites.sites_of(model) and "_bitfuse_handle" not in model.__dict__
    with pytest.raises(UnsupportedModelError, match="no support for torch.nn.modules.linear.Linear"):
        bitfuse.accelerate(types.SimpleNamespace(transformer=torch.nn.Linear(2, 2)))


def test_models_with_an_integration_of_their_own_take_it():
    """The registry matches along the MRO: a model's own class comes before ModelMixin."""
    from bitfuse.models import flux2_configs, flux_configs, ltx2_configs

    for configs, module in ((flux_configs, flux), (flux2_configs, flux2), (ltx2_configs, ltx2)):
        model = configs.build_model(configs.tiny_config())
        assert models.integration_for(model) is module
        with bitfuse.accelerate(model) as handle:
            assert type(handle).__module__ == module.__name__
    assert models.integration_for(_toy()) is adaln

