"""Qwen-Image at full width on the GPU: bitfuse lossless is bitwise diffusers'
output, every fast path verified (the attention's fused q/k RMSNorm + complex RoPE
included, and counted: it must run once per block in a steady forward); bitfuse high
keeps its contract.

Full width (24 heads x 128 = 3072, text width 3584), 2 layers, random weights,
bf16, 1328 x 1328 (83 x 83 = 6889 image tokens) with 128 text tokens, as
QwenImagePipeline calls the transformer; Qwen-Image-Edit-2511 (zero_cond_t,
per-token modulation) at 1024 x 1024 with one 1024 x 1024 condition image."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import policy  # noqa: E402
from bitfuse.models.qwenimage_configs import build_model, full_config, make_inputs  # noqa: E402
from bitfuse.numerics import differing, max_ulp, same_bits  # noqa: E402
from bitfuse.ops import qk_norm_rope as Q  # noqa: E402

pytestmark = pytest.mark.gpu

LAYERS = 2
SIZE = 1328
TEXT = 128
EDIT = dict(height=1024, width=1024, condition_images=[(1024, 1024)])

_models: dict = {}


def _model(variant: str, stressed: bool = False):
    key = (variant, stressed)
    if key not in _models:
        _models.clear()  # one full-width model at a time
        torch.cuda.empty_cache()
        model = build_model(full_config(LAYERS, variant), device="cuda", dtype=torch.bfloat16, seed=int(stressed))
        _random_qk_weights(model, seed=int(stressed))
        if stressed:
            _stress(model)
        _models[key] = model
    return _models[key]


def _random_qk_weights(model, seed: int):
    """The attention's q/k RMSNorm weights (they init to ones) drawn around 1, as a
    checkpoint's are: a dropped or misplaced weight would show."""
    from diffusers.models.normalization import RMSNorm

    gen = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm) and m.weight is not None:
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen))


def _stress(model):
    """Outlier channels in both streams' inputs (x100), and block 0's modulation rows
    with exact zeros: on some channels 1 + scale == 0 and gate == 0."""
    D = model.inner_dim
    with torch.no_grad():
        for linear in (model.img_in, model.txt_in):
            linear.weight[:8] *= 100.0
            linear.bias[:8] *= 100.0
        block = model.transformer_blocks[0]
        for mod in (block.img_mod[1], block.txt_mod[1]):
            for chunk in (0, 3):  # shift, scale, gate of norm1 (0) and norm2 (3)
                scale, gate = slice((chunk + 1) * D, (chunk + 1) * D + 16), slice((chunk + 2) * D, (chunk + 2) * D + 16)
                mod.weight[scale], mod.bias[scale] = 0.0, -1.0
                mod.weight[gate], mod.bias[gate] = 0.0, 0.0


def _run(model, kw):
    with torch.no_grad():
        out = model(**kw)
    torch.cuda.synchronize()
    return out


def _describe(o, r) -> str:
    return f"{differing(o, r)}/{r.numel()} differ, max {max_ulp(o, r)} ULP"


def _verdicts() -> str:
    return ", ".join(f"{v.signature}={v.status}" for v in policy.verdicts()) or "(none)"


def _assert_all_verified():
    bad = [v for v in policy.verdicts() if not v.active]
    assert not bad, "fast paths broke their contract on this GPU: " + "; ".join(
        f"{v.signature}: {v.status} {v.detail}" for v in bad)


def _verified(op: str, layout: str) -> bool:
    return any(v.op == op and v.active and layout in v.signature for v in policy.verdicts())


@contextlib.contextmanager
def _counting_qk_launches():
    """Counts launches of the fused q/k norm + RoPE kernel (every path to it, the
    planner's and a site's bound launch, goes through `_launch_kernel.launch`)."""
    kernel = Q._launch_kernel
    real = kernel.launch
    count = {"n": 0}

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    kernel.launch = counting
    try:
        yield count
    finally:
        del kernel.launch


def _qk_ready():
    """The probes the Qwen layout's plan needs (eager's complex multiply form, the
    128-wide diffusers mean order); without them the processor stays on eager."""
    device = torch.cuda.current_device()
    form, order = Q.complex_mul_form(device), Q.mean_order_128(device)
    print(f"\n[probes] complex multiply form {form}; 128-wide diffusers mean order {order}")
    assert form is not None and order is not None, (
        "this build's complex multiply or 128-wide mean matched no known form: Qwen-Image's q/k norm + RoPE "
        "stays on eager (see tests/gpu/test_qk_norm_rope_gpu.py)")


def _check_lossless(model, calls):
    _qk_ready()
    refs = [_run(model, kw)[0] for kw in calls]
    assert all(torch.isfinite(r).all() for r in refs)
    with bitfuse.accelerate(model), _counting_qk_launches() as qk:
        assert all(type(m.processor).__module__ == "bitfuse.models.qwenimage"
                   for m in model.modules() if hasattr(m, "processor"))
        for kw, ref in zip(calls, refs):
            first = _run(model, kw)[0]  # first call: new kernels compile in the background (eager's bits meanwhile)
            second = _run(model, kw)[0]  # their first sights, verified against eager
            qk["n"] = 0
            steady = _run(model, kw)[0]  # verified fast paths only
            assert same_bits(second, ref), _describe(second, ref)
            assert qk["n"] == LAYERS, f"the fused q/k norm + RoPE ran {qk['n']} times in a {LAYERS}-block forward"
            assert same_bits(first, ref), _describe(first, ref)
            assert same_bits(steady, ref), _describe(steady, ref)
    print(f"\nverdicts: {_verdicts()}")
    _assert_all_verified()
    assert {v.op for v in policy.verdicts()} >= {"layer_norm_modulate", "gated_residual", "qk_norm_rope"}
    assert _verified("qk_norm_rope", "diffusers complex"), _verdicts()
    for kw, ref in zip(calls, refs):
        assert same_bits(_run(model, kw)[0], ref)  # restored


def test_lossless_cfg_pair_at_1328():
    """The conditional and the unconditional pass: batch 1 each, prompts of 128 and
    12 tokens, no mask (the pipeline drops an all-ones mask)."""
    model = _model("image")
    _check_lossless(model, [make_inputs(model, 1, SIZE, SIZE, TEXT, seed=0),
                            make_inputs(model, 1, SIZE, SIZE, 12, seed=1)])
    # batch 1: one parameter row for every token (the gate's signature says "shared")
    assert _verified("layer_norm_modulate", "shared") and _verified("gated_residual", "shared")


def test_lossless_batch_with_a_text_mask():
    """Batch 2: the parameters are [B, 1, D] views with samples 6D apart, read in place."""
    model = _model("image")
    _check_lossless(model, [make_inputs(model, 2, SIZE, SIZE, TEXT, text_lengths=[TEXT, 40], seed=2)])
    assert _verified("layer_norm_modulate", "per-sample/strided") and _verified("gated_residual", "per-sample/strided")


def test_lossless_zero_cond_t_per_token_modulation():
    """Qwen-Image-Edit-2511: the image stream's parameters are the per-token [B, S, D]
    tensors of eager's torch.where; the kernels are verified on that layout."""
    model = _model("edit-2511")
    _check_lossless(model, [make_inputs(model, 1, text_tokens=TEXT, seed=3, **EDIT),
                            make_inputs(model, 2, text_tokens=TEXT, text_lengths=[TEXT, 17], seed=4, **EDIT)])
    assert _verified("layer_norm_modulate", "per-token") and _verified("gated_residual", "per-token")


def test_lossless_outlier_channels_and_exact_zero_parameters():
    model = _model("image", stressed=True)
    _check_lossless(model, [make_inputs(model, 1, SIZE, SIZE, TEXT, seed=5)])


def _rms(a, b) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt())


@pytest.mark.parametrize("variant", ["image", "edit-2511"])
def test_high_keeps_its_contract(variant):
    """Each high-tier norm site is verified against its contract at first sight (a miss
    would show as a non-verified verdict). The whole forward: its distance to an fp32
    run of the same weights and inputs stays within 1.25x of eager bf16's own (it
    should be about equal or smaller). Restored, the model is stock again."""
    model = _model(variant)
    kw = (make_inputs(model, 1, text_tokens=TEXT, seed=6, **EDIT) if variant == "edit-2511"
          else make_inputs(model, 1, SIZE, SIZE, TEXT, seed=6))
    ref = _run(model, kw)[0]
    with bitfuse.accelerate(model, quality="high"):
        _run(model, kw)
        high = _run(model, kw)[0]
    _assert_all_verified()
    assert any(v.op == "layer_norm_modulate" and v.tier == "high" for v in policy.verdicts()), _verdicts()
    assert same_bits(_run(model, kw)[0], ref)  # restored

    exact_model = copy.deepcopy(model).float()
    kw32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    exact = _run(exact_model, kw32)[0]
    del exact_model
    torch.cuda.empty_cache()
    err_high, err_eager = _rms(high, exact), _rms(ref, exact)
    print(f"\n[high {variant}] vs eager: {_describe(high, ref)}; rms vs fp32: high {err_high:.3e}, "
          f"eager {err_eager:.3e}; verdicts: {_verdicts()}")
    assert torch.isfinite(high).all() and err_high <= 1.25 * err_eager
