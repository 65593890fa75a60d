"""diffusers' caching hooks (`model.enable_cache(...)`: First Block Cache, TaylorSeer,
Pyramid Attention Broadcast, MagCache) beside an accelerated model.

The hooks wrap the blocks' forwards (diffusers' hook registry, one of the slots the
install machinery writes through) and decide from the blocks' outputs which blocks
to skip or extrapolate on later calls. With the lossless forwards every block output
is stock's, so every decision is, and every output is bitwise the stock model's with
the same cache over the same sequence of calls; the cache enabled before and after
accelerate. Each case checks that its cache changed some output (it skipped or
extrapolated work in these calls) and that the accelerated forwards ran under the
hooks (bitfuse's sites were called). On CPU the sites fall back to their eager
expressions; on a GPU the kernels run, in bf16."""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import sites  # noqa: E402
from bitfuse.numerics import same_bits  # noqa: E402
from model_checks import TINY_INPUTS, assert_all_same  # noqa: E402

# each cache and the integrations whose blocks diffusers registers for it (0.42.1)
_CACHES = {
    "first-block": (lambda: diffusers.FirstBlockCacheConfig(threshold=2.0), ("flux", "qwenimage", "wan")),
    # (TaylorSeer hooks no module of Wan's here)
    "taylorseer": (lambda: diffusers.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
                   ("ltx2", "flux", "flux2", "qwenimage")),
    "pab": (lambda: diffusers.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 800),
        current_timestep_callback=lambda: 500), ("ltx2", "flux", "flux2", "qwenimage", "wan")),
    "magcache": (lambda: diffusers.MagCacheConfig(mag_ratios=[1.0] + [0.98] * 5, num_inference_steps=6),
                 ("flux", "flux2", "qwenimage", "wan")),
}
_CASES = [(cache, name) for cache, (_, names) in _CACHES.items() for name in names]


def _outputs(model, kwargs) -> tuple:
    context = model.cache_context("cond") if hasattr(model, "cache_context") else contextlib.nullcontext()
    with torch.no_grad(), context:
        out = model(**kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out.sample,)


@pytest.mark.parametrize("setup", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("order", ["cache first", "accelerate first"])
@pytest.mark.parametrize("cache, name", _CASES)
def test_an_accelerated_model_with_a_diffusers_cache_is_stock(cache, name, order, setup, monkeypatch):
    site_calls = []
    for attr in dir(sites):
        if attr.endswith("_site") and callable(getattr(sites, attr)):
            def counted(*args, _real=getattr(sites, attr), **kwargs):
                site_calls.append(1)
                return _real(*args, **kwargs)
            monkeypatch.setattr(sites, attr, counted)
    C = importlib.import_module(f"bitfuse.models.{name}_configs")
    model = C.build_model(C.tiny_config(), device="cuda", dtype=torch.bfloat16) if setup == "cuda" \
        else C.build_model(C.tiny_config())
    stock, plain = copy.deepcopy(model), copy.deepcopy(model)  # plain: no cache
    # the same inputs twice, then others: hits and misses of the caches' thresholds
    calls = [C.make_inputs(model, seed=s, **TINY_INPUTS[name]) for s in (0, 0, 1, 1, 2, 0)]
    config = _CACHES[cache][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (diffusers announces some caches as experimental)
        stock.enable_cache(config())
        if order == "cache first":
            model.enable_cache(config())
        handle = bitfuse.accelerate(model)
        if order == "accelerate first":
            model.enable_cache(config())
        cached = False
        try:
            for kwargs in calls:
                ref = _outputs(stock, kwargs)
                assert_all_same(_outputs(model, kwargs), ref)
                cached |= not all(same_bits(r, p) for r, p in zip(ref, _outputs(plain, kwargs)))
        finally:
            handle.restore()
        assert cached, "the cache skipped nothing in these calls: the test would mean nothing"
        assert site_calls, "no site was called: the accelerated forwards did not run under the hooks"
        assert_all_same(_outputs(model, calls[2]), _outputs(stock, calls[2]))  # restored under the hooks
    model.disable_cache()
    stock.disable_cache()
    assert _as_stock(model, stock)


def _instance_forwards(model) -> dict:
    """name -> the function of each module's instance forward (diffusers' hooks leave
    the class's forward bound there after `disable_cache`)."""
    return {name: getattr(m.__dict__["forward"], "__func__", m.__dict__["forward"])
            for name, m in model.named_modules() if "forward" in m.__dict__}


def _as_stock(model, stock) -> bool:
    """`model_checks.is_stock` where diffusers' hooks have been: no site marks, no
    handle, no bitfuse processor, and the instance forwards the stock model has after
    the same hooks came and went."""
    return (_instance_forwards(model) == _instance_forwards(stock) and not sites.sites_of(model)
            and "_bitfuse_handle" not in model.__dict__
            and not any(type(getattr(m, "processor", None)).__module__.startswith("bitfuse.")
                        for m in model.modules()))
