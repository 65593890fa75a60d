"""LTX-2 at full width on the GPU: bitfuse lossless is torch.equal to diffusers,
bitfuse high stays as close to the exact result as eager bf16 is.

Full width (video 32 x 128 = 4096, audio 32 x 64 = 2048), 2 layers, random
weights, 3072 video + 126 audio + 128 text tokens, bf16."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import graphs, policy  # noqa: E402
from bitfuse.models.ltx2_configs import build_model, full_config, make_inputs  # noqa: E402
from bitfuse.numerics import max_ulp, same_bits  # noqa: E402

pytestmark = pytest.mark.gpu

VIDEO = (4, 16, 48)  # 3072 tokens
AUDIO = 126
TEXT = 128
LAYERS = 2

_models: dict = {}


def _model(variant: str):
    if variant not in _models:
        _models.clear()  # one full-width model at a time
        torch.cuda.empty_cache()
        _models[variant] = build_model(full_config(LAYERS, variant), device="cuda", dtype=torch.bfloat16, seed=0)
    return _models[variant]


def _inputs(model, batch, per_token, masks=False, seed=0):
    return make_inputs(
        model, batch, VIDEO, AUDIO, TEXT, per_token=per_token, seed=seed, masks=masks,
        use_cross_timestep=bool(model.config.cross_attn_mod),
    )


def _run(model, kw):
    with torch.no_grad():
        out = model(**kw)
    torch.cuda.synchronize()
    return out


def _describe(out, ref) -> str:
    parts = []
    for name, o, r in zip(("video", "audio"), out, ref):
        parts.append(f"{name}: {int((o != r).sum())}/{r.numel()} differ, max {max_ulp(o, r)} ULP")
    return "; ".join(parts)


def _verdict_summary() -> str:
    return ", ".join(f"{v.signature}={v.status}" for v in policy.verdicts()) or "(none)"


CASES = [
    pytest.param("2.0", 1, False, False, id="2.0-B1-per-sample"),
    pytest.param("2.0", 2, True, False, id="2.0-B2-per-token"),
    pytest.param("2.0", 2, False, True, id="2.0-B2-per-sample-masks"),
    pytest.param("2.3", 1, False, False, id="2.3-B1-per-sample"),
    pytest.param("2.3", 2, True, True, id="2.3-B2-per-token-masks"),
]


@pytest.mark.parametrize("variant,batch,per_token,masks", CASES)
def test_lossless_equals_diffusers(variant, batch, per_token, masks):
    model = _model(variant)
    kw = _inputs(model, batch, per_token, masks)
    ref = _run(model, kw)
    for r in ref:
        assert torch.isfinite(r).all()
    with bitfuse.accelerate(model):
        first = _run(model, kw)  # first call: kernels compile in the background (eager's bits meanwhile)
        steady = _run(model, kw)  # first sights verified here, then the kernels run
    print(f"\n[{variant} B={batch} per_token={per_token} masks={masks}] verdicts: {_verdict_summary()}")
    verdicts = policy.verdicts()
    bad = [v for v in verdicts if not v.active]
    assert not bad, "fast paths disagreed with eager on this GPU: " + "; ".join(
        f"{v.signature}: {v.status} {v.detail}" for v in bad
    )
    ops = {v.op for v in verdicts}
    assert {"modulate", "gated_residual"} <= ops, f"expected the pointwise kernels to run, saw {sorted(ops)}"
    if variant == "2.3":
        assert "head_gate" in ops, f"expected the gated attention's per-head gate to run, saw {sorted(ops)}"
    for out in (first, steady):
        assert all(same_bits(o, r) for o, r in zip(out, ref)), _describe(out, ref)
    assert all(same_bits(o, r) for o, r in zip(_run(model, kw), ref))  # restored


def _rms(a, b) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt())


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_high_is_as_accurate_as_eager(per_token):
    """The high tier rounds once per site instead of two or three times. Bound: its
    distance to an fp32 run of the same weights and inputs stays within 1.25x of
    eager bf16's own distance (it should be about equal or smaller: everything
    else in the forward rounds identically). Max ULP against eager is printed."""
    model = _model("2.0")
    kw = _inputs(model, 2, per_token)
    ref = _run(model, kw)
    with bitfuse.accelerate(model, quality="high"):
        high = _run(model, kw)
        high = _run(model, kw)
    bad = [v for v in policy.verdicts() if not v.active]
    assert not bad, "; ".join(f"{v.signature}: {v.status} {v.detail}" for v in bad)

    exact_model = copy.deepcopy(model).float()
    kw32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    exact = _run(exact_model, kw32)
    del exact_model
    torch.cuda.empty_cache()

    print(f"\n[high, per_token={per_token}] vs eager: {_describe(high, ref)}; verdicts: {_verdict_summary()}")
    for name, h, r, e in zip(("video", "audio"), high, ref, exact):
        assert torch.isfinite(h).all()
        err_high, err_eager = _rms(h, e), _rms(r, e)
        print(f"  {name}: rms error vs fp32: high {err_high:.3e}, eager bf16 {err_eager:.3e}")
        assert err_high <= 1.25 * err_eager


def test_whole_forward_captures_in_a_cuda_graph():
    """The accelerated forward builds its RoPE coordinates on the device, so the whole
    forward (coordinates computed inside, as when the caller passes none) captures
    in one torch.cuda.CUDAGraph; replays equal eager on the captured and on new inputs."""
    model = _model("2.0")
    kw = _inputs(model, 1, False, seed=0)
    kw_new = _inputs(model, 1, False, seed=1)
    ref, ref_new = _run(model, kw), _run(model, kw_new)
    with bitfuse.accelerate(model):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):  # first sight (verification) happens here, outside capture
                model(**kw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            static_out = model(**kw)
        graph.replay()
        torch.cuda.synchronize()
        assert all(same_bits(o, r) for o, r in zip(static_out, ref)), _describe(static_out, ref)
        for name, value in kw_new.items():
            if torch.is_tensor(value):
                kw[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert all(same_bits(o, r) for o, r in zip(static_out, ref_new)), _describe(static_out, ref_new)
        del graph


# ---------------------------------------------------------------- CUDA graphs, with and without STG

STG = {  # spatio-temporal guidance: (blocks, mask per sample)
    "off": (None, None),
    "mixed": ([1], [0.0, 1.0]),
    "all-perturbed": ([0, 1], [0.0, 0.0]),
}


def _stg_inputs(model, stg, seed):
    blocks, mask = STG[stg]
    return make_inputs(
        model, 2, VIDEO, AUDIO, TEXT, seed=seed, use_cross_timestep=True, stg_blocks=blocks,
        perturbation_mask=None if mask is None else torch.tensor(mask),
    )


def _same(out, ref) -> bool:
    return all(same_bits(o, r) for o, r in zip(out, ref))


@pytest.mark.parametrize("stg", list(STG))
def test_graphs_with_and_without_a_mask_equal_eager(stg):
    """LTX-2.3 at full width through accelerate(cuda_graphs=True): with a perturbation
    mask too, the forward captures whole (the STG branch is computed before the graph),
    and every replay is torch.equal to the eager accelerated forward and to stock
    diffusers; new inputs each call."""
    model = _model("2.3")
    inputs = [_stg_inputs(model, stg, seed) for seed in range(3)]
    refs = [_run(model, kw) for kw in inputs]
    with bitfuse.accelerate(model, cuda_graphs=True) as handle:
        eager = handle.graphs.fn
        with warnings.catch_warnings():
            warnings.simplefilter("error", graphs.GraphCaptureWarning)
            for kw, ref in zip(inputs, refs):
                out = _run(model, kw)
                with torch.no_grad():
                    eager_out = eager(**kw)
                assert _same(out, eager_out), f"graph replay differs from eager: {_describe(out, eager_out)}"
                assert _same(out, ref), f"lossless graph differs from diffusers: {_describe(out, ref)}"
        report = handle.graphs.report()
    print(f"\n[graphs stg={stg}] {[(r['segments'], r['hits']) for r in report['signatures']]}")
    assert report["capture_failures"] == 0 and report["eager"] == 0 and report["graphs"] == 1
    assert report["signatures"][0]["segments"] == 1 and report["signatures"][0]["hits"] == 2


def test_graph_break_at_the_mask_at_full_width():
    """Without the integration's hoist (a plain runner around the accelerated forward),
    the forward breaks its graph at the STG branch: two segments, still torch.equal to
    diffusers, and a mask whose truth flips takes its own path."""
    model = _model("2.3")
    cases = [("mixed", 0), ("mixed", 1)]
    flip = make_inputs(model, 2, VIDEO, AUDIO, TEXT, seed=2, use_cross_timestep=True, stg_blocks=[1],
                       perturbation_mask=torch.tensor([0.0, 0.0]))
    inputs = [_stg_inputs(model, stg, seed) for stg, seed in cases] + [flip]
    refs = [_run(model, kw) for kw in inputs]
    with bitfuse.accelerate(model):
        runner = graphs.GraphRunner(model.forward)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", graphs.GraphCaptureWarning)
                for kw, ref in zip(inputs, refs):
                    with torch.no_grad():
                        out = runner(**kw)
                    assert _same(out, ref), _describe(out, ref)
            report = runner.report()
        finally:
            runner.close()
    (row,) = report["signatures"]
    print(f"\n[graph break] paths {row['paths']}")
    assert row["segments"] == 2 and len(row["paths"]) == 2 and report["eager"] == 0
