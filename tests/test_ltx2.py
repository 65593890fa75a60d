"""LTX-2 (diffusers LTX2VideoTransformer3DModel): bitfuse's forwards are faithful.

On CPU every site falls back to its eager expression, so `torch.equal` between
the accelerated and the stock model checks that bitfuse's copies of diffusers'
block and model forwards compute exactly what diffusers computes, with every
adaLN site routed through bitfuse (counted below)."""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import policy, sites  # noqa: E402
from bitfuse.models import (  # noqa: E402  # noqa: E402
    AlreadyAcceleratedError,
    UnsupportedModelError,
    UnsupportedVersionError,
    _install,
    ltx2,
)
from bitfuse.models.ltx2_configs import build_model, make_inputs, tiny_config  # noqa: E402
from bitfuse.numerics import same_bits
from bitfuse.ops._params import value  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one intra-op thread (and CI cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(variant="2.0", dtype=torch.float32, seed=0, **overrides):
    return build_model(tiny_config(variant, **overrides), dtype=dtype, seed=seed)


def _run(model, kwargs):
    with torch.no_grad():
        return model(**kwargs)


def _assert_equal(out, ref):
    assert isinstance(out, tuple) and len(out) == len(ref) == 2
    for o, r in zip(out, ref):
        assert not r.isnan().any(), "the stock output has NaNs: the comparison would mean nothing"
        assert o.dtype == r.dtype and o.shape == r.shape
        assert same_bits(o, r), f"{int((o != r).sum())} of {r.numel()} elements differ"


def _is_stock(model) -> bool:
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    return all("forward" not in m.__dict__ for m in model.modules()) and all(
        type(p).__module__.startswith("diffusers.") for p in processors
    )


def _check_identity(model, kwargs_list):
    """stock, then accelerated (== stock), then restored (== stock again)."""
    refs = [_run(model, kw) for kw in kwargs_list]
    handle = bitfuse.accelerate(model)
    try:
        assert not _is_stock(model)
        for kw, ref in zip(kwargs_list, refs):
            _assert_equal(_run(model, kw), ref)
    finally:
        handle.restore()
    assert _is_stock(model) and not sites.sites_of(model)
    for kw, ref in zip(kwargs_list, refs):
        _assert_equal(_run(model, kw), ref)


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_identity(variant, per_token, dtype):
    model = _model(variant, DTYPES[dtype])
    cases = [
        make_inputs(model, batch=b, per_token=per_token, masks=masks, seed=b + 2 * masks)
        for b in (1, 2)
        for masks in (False, True)
    ]
    _check_identity(model, cases)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_identity_ltx23_forward_options(dtype):
    """The extra forward arguments of 0.42.1: sigma with use_cross_timestep, isolate_modalities,
    spatio-temporal guidance blocks (all perturbed, or the lerp path with a mixed mask),
    precomputed RoPE coordinates, and a non-default fps."""
    model = _model("2.3", DTYPES[dtype])
    mixed = torch.tensor([0.0, 1.0])
    cases = [
        make_inputs(model, batch=2, use_cross_timestep=True),
        make_inputs(model, batch=2, per_token=True, use_cross_timestep=True, masks=True),
        make_inputs(model, batch=2, isolate_modalities=True),
        make_inputs(model, batch=2, stg_blocks=[1]),  # no mask: every sample perturbed
        make_inputs(model, batch=2, stg_blocks=[0, 1], perturbation_mask=mixed, per_token=True),
        make_inputs(model, batch=1, pass_coords=True, per_token=True),
        dict(make_inputs(model, batch=2), fps=25.0),
    ]
    _check_identity(model, cases)


def test_identity_asymmetric_and_static_prompt_table():
    """Video-only prompt modulation (audio Q unmodulated, audio K/V still modulated),
    the static prompt table (use_prompt_adaln_single=False), keyframe embedding, no FF bias,
    interleaved RoPE, audio gated attention only, LTX-2.0-style STG args on a perturbed model."""
    model = _model(
        "2.3",
        torch.bfloat16,
        audio_cross_attn_mod=False,
        gated_attn=False,
        use_prompt_adaln_single=False,
        use_keyframes_abs_pos_embedding=True,
        ff_bias=False,
        rope_type="interleaved",
    )
    with torch.no_grad():
        model.keyframes_abs_pos_embedding.normal_()
    base = make_inputs(model, batch=2, per_token=True, masks=True)
    keyframes = (torch.arange(base["hidden_states"].shape[1]) < 16).float()[None, :, None].expand(2, -1, -1)
    cases = [base, dict(base, video_keyframes_mask=keyframes), make_inputs(model, batch=1, stg_blocks=[0])]
    _check_identity(model, cases)


def test_identity_lossless_with_affine_norms():
    """Affine norms have no fused kernel; lossless still routes them (norm, then modulate)."""
    model = _model("2.3", torch.bfloat16, norm_elementwise_affine=True)
    with torch.no_grad():
        for b in model.transformer_blocks:
            b.norm1.weight.normal_()
    _check_identity(model, [make_inputs(model, batch=2, per_token=True)])


def test_identity_return_dict_and_attention_kwargs():
    model = _model("2.0")
    kw = dict(make_inputs(model, batch=2), return_dict=True, attention_kwargs={"scale": 1.0})
    ref = _run(model, kw)
    with bitfuse.accelerate(model):
        out = _run(model, kw)
    _assert_equal((out.sample, out.audio_sample), (ref.sample, ref.audio_sample))


def test_video_coords_on_device_are_bit_identical():
    rope_cfgs = [dict(), dict(patch_size=2, patch_size_t=2), dict(vae_scale_factors=(4, 16, 16), causal_offset=0)]
    for cfg in rope_cfgs:
        model = _model("2.0", **cfg)
        for args in [(1, 3, 4, 6), (2, 5, 8, 2)]:
            for fps in (24.0, 25.0, 30000 / 1001):
                ref = model.rope.prepare_video_coords(*args, torch.device("cpu"), fps=fps)
                out = ltx2._prepare_video_coords(model.rope, *args, torch.device("cpu"), fps=fps)
                assert out.dtype == ref.dtype and same_bits(out, ref)


def test_no_host_tensor_copy_inside_the_forward(monkeypatch):
    """diffusers builds two tensors from host lists with device=... while computing RoPE
    coordinates (a pageable host-to-device copy on CUDA, which breaks graph capture);
    the accelerated forward builds none."""
    model = _model("2.3")
    kw = make_inputs(model, batch=2)
    calls = []
    real = torch.tensor

    def spy(*args, **kwargs):
        if kwargs.get("device") is not None:
            calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy)
    ref = _run(model, kw)
    assert len(calls) == 2  # the stock forward does build them (else this test checks nothing)
    calls.clear()
    with bitfuse.accelerate(model):
        out = _run(model, kw)
    assert calls == []
    _assert_equal(out, ref)


def test_rope_cache_returns_the_same_bits_and_keys_on_everything():
    """Coordinates the forward builds itself: their RoPE tables are kept between calls
    (the same tensor objects), and every input they depend on keys them: shapes,
    fps, batch, a RoPE setting changed on the module, an in-place write to a kept
    table. Each call still equals the stock model's output."""
    model = _model("2.3")
    kw_a = make_inputs(model, batch=1, seed=1)
    kw_b = make_inputs(model, batch=2, video_tokens_shape=(3, 2, 4), audio_tokens=5, seed=2)
    kw_fps = dict(kw_a, fps=25.0)
    refs = {k: _run(model, kw) for k, kw in (("a", kw_a), ("b", kw_b), ("fps", kw_fps))}
    with bitfuse.accelerate(model) as handle:
        cache = handle.rope_cache
        _assert_equal(_run(model, kw_a), refs["a"])
        kept = cache.entries["video"][1]
        _assert_equal(_run(model, kw_a), refs["a"])
        assert cache.entries["video"][1] is kept  # a hit
        for name, kw in (("b", kw_b), ("fps", kw_fps), ("a", kw_a)):
            _assert_equal(_run(model, kw), refs[name])
        assert cache.entries["video"][1] is not kept  # re-keyed by fps, then shapes
        kept = cache.entries["video"][1]
        kept[0][0].add_(1.0)  # a write in place: the next call recomputes
        _assert_equal(_run(model, kw_a), refs["a"])
        assert cache.entries["video"][1] is not kept
        theta = model.rope.theta
    model.rope.theta = theta / 2  # a changed setting
    try:
        ref_theta = _run(model, kw_a)
        with bitfuse.accelerate(model) as handle:
            _run(model, kw_a)  # fills the cache with theta / 2
            _assert_equal(_run(model, kw_a), ref_theta)
            model.rope.theta = theta
            _assert_equal(_run(model, kw_a), refs["a"])
        assert handle.rope_cache.entries == {}  # restore() frees the tables
    finally:
        model.rope.theta = theta


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_timestep_projections_are_shared_between_equal_inputs(monkeypatch, per_token):
    """The six timestep embeddings of the forward share the sinusoidal projection of
    equal inputs (and the gates their product): per-sample, one timestep tensor and
    one product, so 2 projections instead of 6; per-token, video and audio differ
    (4). A hook on one projection module takes that module out of the sharing."""
    from diffusers.models.embeddings import Timesteps

    model = _model("2.0")
    kw = make_inputs(model, batch=2, per_token=per_token, seed=5)
    ref = _run(model, kw)
    calls = []
    real = Timesteps.forward
    with bitfuse.accelerate(model):
        monkeypatch.setattr(Timesteps, "forward", lambda self, t: calls.append(self) or real(self, t))
        _assert_equal(_run(model, kw), ref)
        assert len(calls) == (4 if per_token else 2)
        calls.clear()
        seen = []
        model.av_cross_attn_video_scale_shift.emb.time_proj.register_forward_hook(lambda *a: seen.append(1))
        _assert_equal(_run(model, kw), ref)
        assert seen == [1] and len(calls) == (5 if per_token else 3)


def test_rope_cache_skips_passed_coords_hooks_and_compiling(monkeypatch):
    model = _model("2.0")
    kw_passed = make_inputs(model, batch=1, pass_coords=True, seed=3)
    kw = make_inputs(model, batch=1, seed=3)
    ref_passed, ref = _run(model, kw_passed), _run(model, kw)
    with bitfuse.accelerate(model) as handle:
        _assert_equal(_run(model, kw_passed), ref_passed)
        assert handle.rope_cache.entries == {}  # passed coordinates: never kept
        hook = model.rope.register_forward_hook(lambda m, a, o: None)
        _assert_equal(_run(model, kw), ref)
        assert "video" not in handle.rope_cache.entries and "audio" in handle.rope_cache.entries
        hook.remove()
        monkeypatch.setattr(policy, "capturing", lambda: True)
        handle.rope_cache.clear()
        _assert_equal(_run(model, kw), ref)
        assert handle.rope_cache.entries == {}


def test_paired_tables_hold_every_value_and_step_aside(monkeypatch):
    """`ltx2_host.paired`: a stock interleaved RoPE module's tables get their compact
    halves, columns 2i of tables whose columns 2i and 2i + 1 are equal (the padding
    included: dim % 6 != 0 here); a split module, a hooked one, compiling and
    BITFUSE_DISABLE get the tables as they are."""
    from bitfuse.models import ltx2_host

    model = _model("2.0", attention_head_dim=11)  # dim 4 x 11 = 44: 44 % 6 = 2 columns of padding
    rope = model.rope
    coords = make_inputs(model, batch=2, pass_coords=True)["video_coords"]
    tables = rope(coords, device="cpu")
    out = ltx2_host.paired(rope, tables)
    assert isinstance(out, ltx2_host.PairedTables) and tuple(out) == tuple(tables)
    for full, half in zip(tables, out.pairs):
        assert half.is_contiguous() and half.shape == (*full.shape[:-1], full.shape[-1] // 2)
        assert same_bits(half.repeat_interleave(2, -1), full)
    hook = rope.register_forward_hook(lambda m, a, o: None)
    assert ltx2_host.paired(rope, tables) is tables
    hook.remove()
    monkeypatch.setattr(policy, "compiling", lambda: True)
    assert ltx2_host.paired(rope, tables) is tables
    monkeypatch.undo()
    monkeypatch.setattr(policy, "DISABLED", True)  # BITFUSE_DISABLE: the sites run plain, nothing reads halves
    assert ltx2_host.paired(rope, tables) is tables
    monkeypatch.undo()
    split = _model("2.3").rope
    assert split.rope_type == "split" and ltx2_host.paired(split, tables) is tables


# ---------------------------------------------------------------- every site goes through bitfuse

_SITE_FUNCS = ("rms_norm_modulate_site", "layer_norm_modulate_site", "modulate_site", "gated_residual_site",
               "rms_norm_site", "head_gate_site")


@contextlib.contextmanager
def _recording_sites(monkeypatch):
    """Replace the site functions by recorders (outermost calls only: sites call each
    other when they fall back) that note (site function, the tier in force at a norm
    site's block, the block's site name, thread). The pointwise sites take no block:
    they are exact in every tier, so None and None there."""
    records = []
    depth = threading.local()

    def wrap(name, real):
        @functools.wraps(real)
        def recorder(*args, **kwargs):
            outer = getattr(depth, "n", 0) == 0
            if outer:
                block = args[0] if name.endswith("norm_modulate_site") else None
                site = getattr(block, "_bitfuse_site", None)
                tier = sites._tier(block) if site else None  # what the site resolves
                records.append((name, tier, site.name if site else None, threading.get_ident()))
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


@pytest.mark.parametrize(
    "variant,options,per_block",
    [
        # per block: (rms_norm_modulate, modulate, gated_residual, rms_norm, head_gate)
        ("2.0", {}, (4, 4, 6, 4, 0)),  # rms_norm: the text-attention norms (unmodulated in 2.0), a2v and v2a
        ("2.3", {}, (6, 6, 8, 2, 6)),  # + text Q norm-modulate x2, text K/V modulate x2, text gated residual x2;
        # every attention gated per head
        ("2.0", {"isolate_modalities": True}, (4, 0, 4, 2, 0)),  # no a2v/v2a
        ("2.3", {"isolate_modalities": True}, (6, 2, 6, 0, 4)),
    ],
)
def test_every_adaln_site_is_routed(monkeypatch, variant, options, per_block):
    model = _model(variant)
    kw = make_inputs(model, batch=2, per_token=True, **options)
    ref = _run(model, kw)
    with _recording_sites(monkeypatch) as records:
        assert _run(model, kw) is not None and records == []  # stock: no site calls
        with bitfuse.accelerate(model):
            out = _run(model, kw)
    n = len(model.transformer_blocks)
    rms, mod, gated, norm, head_gate = per_block
    expected = {"rms_norm_modulate_site": rms * n, "layer_norm_modulate_site": 2, "gated_residual_site": gated * n}
    for name, count in (("modulate_site", mod), ("rms_norm_site", norm), ("head_gate_site", head_gate)):
        if count:
            expected[name] = count * n
    assert _counts(records) == expected
    # every norm site call names its marked block
    names = {r[2] for r in records if r[0].endswith("norm_modulate_site")}
    assert None not in names
    assert names == {"head"} | {f"transformer_blocks.{i}" for i in range(n)}
    _assert_equal(out, ref)


@pytest.mark.parametrize(
    "variant,options,per_block",
    [
        ("2.0", {}, 4),
        ("2.3", {}, 4),
        ("2.0", {"isolate_modalities": True}, 2),
        ("2.3", {"stg_blocks": [0, 1], "perturbation_mask": torch.tensor([0.0, 1.0])}, 4),  # perturbed processor
    ],
)
def test_every_rope_goes_through_the_rotary_site(monkeypatch, variant, options, per_block):
    """Video and audio self-attention, a2v and v2a: each rotates its query and key
    through `rotary_site`; the processors keep their backend state and come back on restore."""
    model = _model(variant)
    kw = make_inputs(model, batch=2, **options)
    ref = _run(model, kw)
    processors = {id(m): m.processor for m in model.modules() if hasattr(m, "processor")}
    for p in processors.values():
        p._attention_backend = "native"  # diffusers' set_attention_backend sets this on the instance
    calls = []
    real = sites.rotary_site

    def counting(query, key, qf, kf, rope_type):
        calls.append(rope_type)
        return real(query, key, qf, kf, rope_type)

    monkeypatch.setattr(sites, "rotary_site", counting)
    with bitfuse.accelerate(model):
        assert all(type(p).__module__ == "bitfuse.models.ltx2" for p in processors.values())
        out = _run(model, kw)
    assert _is_stock(model)
    assert all(m.processor is processors[id(m)] and m.processor._attention_backend == "native"
               for m in model.modules() if hasattr(m, "processor"))
    assert len(calls) == per_block * len(model.transformer_blocks)
    assert set(calls) == {"split" if variant == "2.3" else "interleaved"}
    _assert_equal(out, ref)


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_block_parameters_reach_the_sites_folded(monkeypatch, variant):
    """Every block-level scale/shift/gate reaches its site as Folded(table row, temb view):
    diffusers' [B, T, n, D] sum `table + temb` is never materialised."""
    model = _model(variant)
    kw = make_inputs(model, batch=2, per_token=True)
    ref = _run(model, kw)
    kinds = []
    depth = threading.local()

    def recording(real, params):
        def site(*args, **kwargs):
            if getattr(depth, "n", 0) == 0:  # outermost: a site's fallback calls other sites
                kinds.extend(type(args[i]).__name__ for i in params)
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return real(*args, **kwargs)
            finally:
                depth.n -= 1
        return site

    monkeypatch.setattr(sites, "modulate_site", recording(sites.modulate_site, (1, 2)))
    monkeypatch.setattr(sites, "gated_residual_site", recording(sites.gated_residual_site, (2,)))
    monkeypatch.setattr(sites, "rms_norm_modulate_site", recording(sites.rms_norm_modulate_site, (3, 4)))
    # the head's parameters are diffusers' plain views (not block parameters): not recorded
    monkeypatch.setattr(sites, "layer_norm_modulate_site", recording(sites.layer_norm_modulate_site, ()))
    with bitfuse.accelerate(model):
        out = _run(model, kw)
    _assert_equal(out, ref)
    assert kinds and set(kinds) == {"Folded"}


def test_attention_forward_filters_kwargs_as_diffusers_does(monkeypatch):
    """The copied LTX2Attention.forward caches the processor's parameters: unexpected
    kwargs are still dropped with diffusers' warning, per processor class."""
    model = _model("2.3")
    attn = model.transformer_blocks[0].attn1
    x = torch.randn(1, 5, attn.query_dim)
    warned = []
    monkeypatch.setattr(ltx2._ltx2_module.logger, "warning", lambda msg: warned.append(msg))
    with torch.no_grad():
        ref = attn(x, bogus=1)
        with bitfuse.accelerate(model):
            assert "forward" in attn.__dict__
            for _ in range(2):
                assert same_bits(attn(x, bogus=1), ref)
            assert same_bits(attn(x, perturbation_mask=torch.zeros(1, 1, 1)), attn(x, all_perturbed=True))
    assert len(warned) == 3 and all("['bogus'] are not expected" in w for w in warned)


def test_other_processors_are_left_alone():
    model = _model("2.0")
    kw = make_inputs(model, batch=1)
    ref = _run(model, kw)
    block = model.transformer_blocks[0]

    class Mine(type(block.attn1.processor)):
        pass

    mine = Mine()
    block.attn1.set_processor(mine)
    with bitfuse.accelerate(model):
        assert type(block.attn1.processor) is Mine
        assert type(block.attn2.processor).__module__ == "bitfuse.models.ltx2"
        _assert_equal(_run(model, kw), ref)


def test_sites_change_the_output_when_they_change():
    """A control for the identity tests: perturb one site and the output moves."""
    model = _model("2.0")
    kw = make_inputs(model, batch=2)
    ref = _run(model, kw)
    real = sites.gated_residual_site
    with bitfuse.accelerate(model):
        try:
            sites.gated_residual_site = lambda x, y, gate: real(x, y, value(gate) * 1.5)
            out = _run(model, kw)
        finally:
            sites.gated_residual_site = real
    assert not same_bits(out[0], ref[0])


# ---------------------------------------------------------------- tiers


def test_quality_high_mounts_on_every_site(monkeypatch):
    model = _model("2.3", torch.bfloat16)
    kw = make_inputs(model, batch=2, per_token=True)
    ref = _run(model, kw)
    handle = bitfuse.accelerate(model, quality="high")
    try:
        assert handle.quality == "high"
        marked = sites.sites_of(model)
        assert len(marked) == len(model.transformer_blocks) + 1
        assert all(s.tier == "high" for s in marked)
        with _recording_sites(monkeypatch) as records:
            out = _run(model, kw)  # on CPU the kernels fall back: still stock bits
            with bitfuse.quality("lossless"):
                out_lossless = _run(model, kw)
        n = len(records) // 2
        tiers = [{r[1] for r in half if r[2] is not None} for half in (records[:n], records[n:])]
        assert n > 0 and tiers == [{"high"}, {"lossless"}]
        _assert_equal(out, ref)
        _assert_equal(out_lossless, ref)
    finally:
        handle.restore()
    assert _is_stock(model) and not sites.sites_of(model)


def test_quality_high_is_all_or_nothing():
    """Affine norms have no one-pass kernel: "high" is refused for the whole model and
    nothing is left installed."""
    model = _model("2.0", norm_elementwise_affine=True)
    with pytest.raises(bitfuse.MountError, match="affine"):
        bitfuse.accelerate(model, quality="high")
    assert _is_stock(model) and not sites.sites_of(model)
    assert "_bitfuse_handle" not in model.__dict__
    bitfuse.accelerate(model).restore()  # lossless is fine


def test_tiers_are_isolated_across_threads_and_models(monkeypatch):
    high_model, model = _model("2.0"), _model("2.0", seed=1)
    kw = make_inputs(model, batch=2, per_token=True)
    refs = {"high": _run(high_model, kw), "lossless": _run(model, kw), "request": _run(model, kw)}
    h1 = bitfuse.accelerate(high_model, quality="high")
    h2 = bitfuse.accelerate(model)
    barrier = threading.Barrier(3)
    outs, idents, errors = {}, {}, []

    def worker(key, m, requested):
        try:
            idents[key] = threading.get_ident()
            barrier.wait()
            for _ in range(3):
                ctx = bitfuse.quality(requested) if requested else contextlib.nullcontext()
                with ctx:
                    outs[key] = _run(m, kw)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        with _recording_sites(monkeypatch) as records:
            threads = [
                threading.Thread(target=worker, args=("high", high_model, None)),
                threading.Thread(target=worker, args=("lossless", model, None)),
                threading.Thread(target=worker, args=("request", model, "high")),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        h1.restore()
        h2.restore()
    assert not errors, errors
    seen = {key: {r[1] for r in records if r[3] == ident and r[2] is not None} for key, ident in idents.items()}
    assert seen == {"high": {"high"}, "lossless": {"lossless"}, "request": {"high"}}
    for key, ref in refs.items():
        _assert_equal(outs[key], ref)


# ---------------------------------------------------------------- torch.compile


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    model = _model("2.3", torch.bfloat16, num_layers=1)
    kw = make_inputs(model, batch=2, per_token=True, masks=True)
    ref = _run(model, kw)
    with bitfuse.accelerate(model):
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        _assert_equal(_run(compiled, kw), ref)
    torch._dynamo.reset()


def test_compile_repeated_blocks_equals_eager():
    torch._dynamo.reset()
    model = _model("2.0", torch.bfloat16)
    kw = make_inputs(model, batch=2, per_token=True)
    ref = _run(model, kw)
    with bitfuse.accelerate(model):
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        try:
            _assert_equal(_run(model, kw), ref)
            # the compiled regions run our forward, whose sites trace to the eager expressions
            assert all(b._compiled_call_impl is not None for b in model.transformer_blocks)
        finally:
            for b in model.transformer_blocks:
                b._compiled_call_impl = None
    torch._dynamo.reset()


# ---------------------------------------------------------------- installing and restoring


def test_forward_signatures_are_unchanged():
    """Pipelines and hooks read the forwards' signatures."""
    import inspect

    model = _model("2.3")
    stock = inspect.signature(model.forward), inspect.signature(model.transformer_blocks[0].forward)
    with bitfuse.accelerate(model):
        assert (inspect.signature(model.forward), inspect.signature(model.transformer_blocks[0].forward)) == stock


def test_accelerate_twice_returns_the_handle_or_refuses():
    model = _model("2.0")
    h = bitfuse.accelerate(model)
    try:
        assert bitfuse.accelerate(model) is h
        assert h.model is model and h.active
        with pytest.raises(AlreadyAcceleratedError, match="already accelerated"):
            bitfuse.accelerate(model, quality="high")
    finally:
        h.restore()
    h.restore()  # idempotent
    assert not h.active
    h2 = bitfuse.accelerate(model, quality="high")
    assert h2 is not h
    h2.restore()
    assert _is_stock(model)


def test_pipeline_and_compiled_wrappers_are_unwrapped():
    model = _model("2.0")
    kw = make_inputs(model, batch=1)
    ref = _run(model, kw)
    pipe = types.SimpleNamespace(transformer=model)  # diffusers pipelines are not nn.Modules
    with bitfuse.accelerate(pipe) as h:
        assert h.model is model and h.pipeline is pipe
        _assert_equal(_run(model, kw), ref)
    wrapped = torch.compile(model, backend="eager")
    with bitfuse.accelerate(wrapped) as h:
        assert h.model is model
    assert _is_stock(model)


def test_unsupported_models_are_refused():
    with pytest.raises(UnsupportedModelError, match="no support"):
        bitfuse.accelerate(torch.nn.Linear(2, 2))

    class Custom(diffusers.LTX2VideoTransformer3DModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    torch.manual_seed(0)
    model = Custom(**tiny_config("2.0"))
    with pytest.raises(UnsupportedModelError, match="overrides"):
        bitfuse.accelerate(model)
    assert _is_stock(model) and not sites.sites_of(model)
    with pytest.raises(TypeError, match="cuda_graphs"):
        bitfuse.accelerate(_model("2.0"), warmup=3)
    with pytest.raises(ValueError, match="quality"):
        bitfuse.accelerate(_model("2.0"), quality="fast")


def _register_diffusers_hook(module, hook_cls, name):
    from diffusers.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook_cls(), name)


def test_composes_with_hooks_installed_before():
    """Hooks already wrapping the forwards (diffusers' registry, with and without
    new_forward; HF accelerate's _old_forward pattern) keep running around ours."""
    from diffusers.hooks import ModelHook

    calls = []

    scopes = []

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(type(module).__name__)
            scopes.append(policy._background.get())
            return args, kwargs

    class Replacing(ModelHook):  # like diffusers' cache hooks: runs the original itself
        def new_forward(self, module, *args, **kwargs):
            calls.append("new_forward")
            return self.fn_ref.original_forward(*args, **kwargs)

    model = _model("2.3")
    kw = make_inputs(model, batch=2, per_token=True)
    ref = _run(model, kw)
    for block in model.transformer_blocks:
        _register_diffusers_hook(block, Replacing, "replacing")
        _register_diffusers_hook(block, Counting, "counting")
    # HF accelerate's add_hook_to_module on the top-level model
    old = model.forward
    model._old_forward = old

    def accelerate_style(module, *args, **kwargs):
        calls.append("accelerate")
        return module._old_forward(*args, **kwargs)

    model.forward = functools.update_wrapper(functools.partial(accelerate_style, model), old)
    wrappers = {"model": model.forward, "blocks": [b.forward for b in model.transformer_blocks]}
    assert _run(model, kw) is not None and len(calls) == 1 + 2 * len(model.transformer_blocks)

    handle = bitfuse.accelerate(model)
    calls.clear()
    counted = []
    real = sites.gated_residual_site
    sites.gated_residual_site = lambda *a, **k: counted.append(1) or real(*a, **k)
    try:
        out = _run(model, kw)
    finally:
        sites.gated_residual_site = real
    assert calls == ["accelerate"] + ["LTX2VideoTransformerBlock", "new_forward"] * len(model.transformer_blocks)
    # the first-call compile scope runs inside the top-level hook's wrapper, around the blocks
    assert scopes[-len(model.transformer_blocks):] == [True] * len(model.transformer_blocks)
    assert len(counted) == 8 * len(model.transformer_blocks)  # our block forward ran inside the hooks
    assert model.forward is wrappers["model"]
    assert [b.forward for b in model.transformer_blocks] == wrappers["blocks"]
    _assert_equal(out, ref)

    handle.restore()
    assert model._old_forward.__func__ is type(model).forward
    assert model.forward is wrappers["model"]
    calls.clear()
    _assert_equal(_run(model, kw), ref)
    assert len(calls) == 1 + 2 * len(model.transformer_blocks)
    # the registry can still remove its hooks cleanly: stock forwards come back
    for block in model.transformer_blocks:
        block._diffusers_hook.remove_hook("counting")
        block._diffusers_hook.remove_hook("replacing")
        assert block.forward.__func__ is type(block).forward


def test_hooks_registered_after_wrap_ours_and_restore_keeps_them():
    from diffusers.hooks import ModelHook

    calls = []

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    model = _model("2.0")
    kw = make_inputs(model, batch=2)
    ref = _run(model, kw)
    handle = bitfuse.accelerate(model)
    block = model.transformer_blocks[0]
    ours = block.forward
    _register_diffusers_hook(block, Counting, "counting")
    _assert_equal(_run(model, kw), ref)
    assert calls == [1]
    handle.restore()  # our forward is replaced inside the hook's chain, the hook stays
    assert block._diffusers_hook._fn_refs[0].forward is not ours
    calls.clear()
    _assert_equal(_run(model, kw), ref)
    assert calls == [1]
    block._diffusers_hook.remove_hook("counting")
    _assert_equal(_run(model, kw), ref)
    assert block.forward.__func__ is type(block).forward


# ---------------------------------------------------------------- versions


def test_refuses_unverified_diffusers_version(monkeypatch):
    model = _model("2.0")
    kw = make_inputs(model, batch=1)
    ref = _run(model, kw)
    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    with pytest.raises(UnsupportedVersionError, match=r"0\.43\.0 is outside the supported range 0\.42\.x"):
        bitfuse.accelerate(model)
    assert _is_stock(model) and not sites.sites_of(model)
    with pytest.warns(UserWarning, match="force=True"):
        handle = bitfuse.accelerate(model, force=True)
    _assert_equal(_run(model, kw), ref)
    handle.restore()


def test_refuses_a_changed_diffusers_source(monkeypatch):
    model = _model("2.0")
    monkeypatch.setitem(ltx2.VERIFIED_SOURCES, "LTX2VideoTransformerBlock.forward", "0" * 64)
    with pytest.raises(UnsupportedVersionError, match="LTX2VideoTransformerBlock.forward differs"):
        bitfuse.accelerate(model)
    assert _is_stock(model)
    with pytest.warns(UserWarning, match="differs"):
        bitfuse.accelerate(model, force=True).restore()



@pytest.mark.parametrize(
    "version,ok",
    [
        ("0.42.0", True),
        ("0.42.1", True),
        ("0.42.2.dev0", True),
        ("0.41.9", False),
        ("0.43.0", False),
        ("1.42.0", False),
    ],
)
def test_version_range(version, ok):
    assert _install.release_matches(version, ltx2.SOURCES.release) is ok


def test_policy_state_untouched_on_cpu():
    """On CPU no fast path is eligible, so no verdict is reached (the gate stays clean)."""
    model = _model("2.0")
    with bitfuse.accelerate(model):
        _run(model, make_inputs(model, batch=2))
    assert policy.verdicts() == []


def test_cuda_graphs_hook_wraps_and_restores():
    """accelerate(cuda_graphs=True) hands the handle to bitfuse.graphs with the graph
    options; restore() removes the graph wrapper, then the accelerated forwards."""
    graphs = pytest.importorskip("bitfuse.graphs")
    model = _model("2.0")
    kw = make_inputs(model, batch=2, per_token=True)
    ref = _run(model, kw)
    backend = graphs.EmulatedGraphBackend()
    handle = bitfuse.accelerate(model, cuda_graphs=True, backend=backend, warmup=1)
    try:
        assert handle.graphs is not None and graphs.graph_runner_of(model) is handle.graphs
        for _ in range(3):
            _assert_equal(_run(model, kw), ref)
        assert backend.captures == 1 and backend.replays >= 2
        assert bitfuse.accelerate(model, cuda_graphs=True) is handle  # already wrapped: same handle
    finally:
        handle.restore()
    assert handle.graphs is None and _is_stock(model) and not sites.sites_of(model)
    _assert_equal(_run(model, kw), ref)


# ---------------------------------------------------------------- the public entry point


@pytest.mark.parametrize("thing", [None, "ltx2", 3, types.SimpleNamespace(transformer="not a module")],
                         ids=["None", "str", "int", "pipeline-without-module"])
def test_non_modules_are_refused_with_the_supported_list(thing):
    with pytest.raises(UnsupportedModelError, match="LTX2VideoTransformer3DModel"):
        bitfuse.accelerate(thing)


def test_accelerate_shows_its_options_and_imports_models_lazily():
    import inspect
    import pydoc
    import subprocess
    import sys

    params = inspect.signature(bitfuse.accelerate).parameters
    assert [n for n in ("quality", "cuda_graphs", "force") if params[n].kind is inspect.Parameter.KEYWORD_ONLY] == [
        "quality", "cuda_graphs", "force"]
    assert params["quality"].default == "lossless" and params["cuda_graphs"].default is False
    text = pydoc.render_doc(bitfuse.accelerate)
    assert all(word in text for word in ("quality:", "cuda_graphs:", "force:", "restore()"))
    probe = ("import sys, bitfuse; print(sorted(m for m in sys.modules "
             "if m.startswith(('bitfuse.models', 'bitfuse.graphs', 'diffusers'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- spatio-temporal guidance


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that read a tensor's value on the host (a sync on the GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func._schema.name == "aten::_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def test_the_stg_branch_is_read_once_per_forward():
    """diffusers branches on `torch.all(mask == 0)` in every perturbed processor (a host
    sync each); the accelerated forward reads it once, the same bits."""
    model = _model("2.3")
    kw = make_inputs(model, batch=2, stg_blocks=[0, 1], perturbation_mask=torch.tensor([0.0, 1.0]))
    with torch.no_grad():
        with _HostReads() as stock:
            ref = model(**kw)
        with bitfuse.accelerate(model), _HostReads() as ours:
            out = model(**kw)
    assert stock.n == 2 * len(model.transformer_blocks)  # video and audio self-attention, per STG block
    assert ours.n == 1
    _assert_equal(out, ref)


def test_compile_with_a_perturbation_mask_equals_eager():
    """Under torch.compile the STG branch is diffusers' tensor, as in the stock forward."""
    torch._dynamo.reset()
    model = _model("2.3", torch.bfloat16, num_layers=1)
    kw = make_inputs(model, batch=2, stg_blocks=[0], perturbation_mask=torch.tensor([0.0, 1.0]))
    ref = _run(model, kw)
    with bitfuse.accelerate(model):
        compiled = torch.compile(model, backend="eager")
        _assert_equal(_run(compiled, kw), ref)
    torch._dynamo.reset()
