"""FLUX.1 and FLUX.2 at full width on the GPU: bitfuse lossless is torch.equal to
diffusers with every fast path verified; bitfuse high keeps its contract and stays as
close to an fp32 run as eager bf16 is.

Full width (FLUX.1-dev 3072, FLUX.2-dev 6144), 2 double + 2 single blocks, random
weights, bf16, 1024 x 1024 pixels: 4,096 image + 512 text tokens, inputs as the
pipelines pass them (bitfuse.models.flux_configs / flux2_configs)."""

from __future__ import annotations

import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import policy  # noqa: E402
from bitfuse.models import flux2_configs, flux_configs  # noqa: E402
from bitfuse.numerics import max_ulp  # noqa: E402

pytestmark = pytest.mark.gpu

CONFIGS = {"flux1": flux_configs, "flux2": flux2_configs}
DOUBLE, SINGLE = 2, 2
REF_TOKENS = 1024  # FLUX.2 KV extract: a 512 x 512 reference image, per-token modulation

_models: dict = {}


def _model(name: str):
    if name not in _models:
        _models.clear()  # one full-width model at a time
        torch.cuda.empty_cache()
        configs = CONFIGS[name]
        model = configs.build_model(configs.full_config(DOUBLE, SINGLE), device="cuda", dtype=torch.bfloat16, seed=0)
        if name == "flux2":
            configs.use_kv_processors(model)  # as Flux2KleinKVPipeline; without KV arguments: the default math
        _models[name] = model
    return _models[name]


def _inputs(name: str, model, batch: int, per_token: bool = False, seed: int = 0) -> dict:
    extra = {"ref_tokens": REF_TOKENS} if per_token else {}
    return CONFIGS[name].make_inputs(model, batch, 1024, 1024, 512, seed=seed, per_sample_t=batch > 1, **extra)


def _run(model, kw):
    with torch.no_grad():
        out = model(**kw)
    torch.cuda.synchronize()
    return out[0]


def _describe(out, ref) -> str:
    return f"{int((out != ref).sum())}/{ref.numel()} differ, max {max_ulp(out, ref)} ULP"


def _summary() -> str:
    return ", ".join(f"{v.signature}={v.status}" for v in policy.verdicts()) or "(none)"


CASES = [
    pytest.param("flux1", 1, False, id="flux1-B1"),
    pytest.param("flux1", 2, False, id="flux1-B2-per-sample"),
    pytest.param("flux2", 1, False, id="flux2-B1"),
    pytest.param("flux2", 2, True, id="flux2-B2-per-token"),
]


@pytest.mark.parametrize("name,batch,per_token", CASES)
def test_lossless_equals_diffusers(name, batch, per_token):
    model = _model(name)
    kw = _inputs(name, model, batch, per_token)
    ref = _run(model, kw)
    assert torch.isfinite(ref).all()
    with bitfuse.accelerate(model) as handle:
        first = _run(model, kw)  # first call: kernels compile in the background (eager's bits meanwhile)
        steady = _run(model, kw)  # first sights verified here, then the kernels run
        print(f"\n[{name} B={batch} per_token={per_token}] {handle!r}\n  verdicts: {_summary()}")
    verdicts = policy.verdicts()
    bad = [v for v in verdicts if not v.active]
    assert not bad, "fast paths disagreed with eager on this GPU: " + "; ".join(
        f"{v.signature}: {v.status} {v.detail}" for v in bad)
    ops = {v.op for v in verdicts}
    assert {"layer_norm_modulate", "gated_residual"} <= ops, f"expected the kernels to run, saw {sorted(ops)}"
    for out in (first, steady):
        assert torch.equal(out, ref), _describe(out, ref)
    assert torch.equal(_run(model, kw), ref)  # restored


def _rms(a, b) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt())


@pytest.mark.parametrize("name,per_token", [("flux1", False), ("flux2", True)], ids=["flux1", "flux2-per-token"])
def test_high_keeps_its_contract(name, per_token):
    """Every high verdict is "verified" (the gate's float64 contract held on these
    operands), and the output's distance to an fp32 run of the same weights and inputs
    stays within 1.25x of eager bf16's own distance. Max ULP against eager is printed."""
    model = _model(name)
    kw = _inputs(name, model, 2, per_token)
    ref = _run(model, kw)
    with bitfuse.accelerate(model, quality="high"):
        _run(model, kw)
        high = _run(model, kw)
    verdicts = policy.verdicts()
    bad = [v for v in verdicts if not v.active]
    assert not bad, "; ".join(f"{v.signature}: {v.status} {v.detail}" for v in bad)
    assert any(v.op == "layer_norm_modulate" and v.tier == "high" for v in verdicts), _summary()

    exact_model = copy.deepcopy(model).float()
    kw32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    exact = _run(exact_model, kw32)
    del exact_model
    torch.cuda.empty_cache()
    err_high, err_eager = _rms(high, exact), _rms(ref, exact)
    print(f"\n[{name} high] vs eager: {_describe(high, ref)}; rms error vs fp32: high {err_high:.3e}, "
          f"eager bf16 {err_eager:.3e}; verdicts: {_summary()}")
    assert torch.isfinite(high).all() and err_high <= 1.25 * err_eager


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_graphs_equal_diffusers(name):
    """accelerate(cuda_graphs=True): the whole forward captures in one graph, and every
    replay (new inputs each call) is torch.equal to stock diffusers."""
    model = _model(name)
    inputs = [_inputs(name, model, 1, seed=s) for s in range(3)]
    refs = [_run(model, kw) for kw in inputs]
    with bitfuse.accelerate(model, cuda_graphs=True) as handle:
        for kw, ref in zip(inputs, refs):
            out = _run(model, kw)
            assert torch.equal(out, ref), _describe(out, ref)
        report = handle.graphs.report()
    print(f"\n[{name} graphs] {[(r['segments'], r['hits']) for r in report['signatures']]}")
    assert report["capture_failures"] == 0 and report["graphs"] == 1
    assert report["signatures"][0]["segments"] == 1
