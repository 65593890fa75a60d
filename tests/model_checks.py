"""Shared checks of the model-integration tests (tests/test_<model>.py): a forward
without autograd, the bitwise comparison of two outputs, whether a model is stock
again, and the stock -> accelerated -> restored identity.

Not a test module (no `test_` prefix); the test files import it as `model_checks`
(pytest puts tests/ on sys.path: the directory has a conftest.py and no __init__.py).
"""

from __future__ import annotations

import torch

import bitfuse
from bitfuse import sites
from bitfuse.numerics import differing, same_bits


def run(model, kwargs: dict):
    """`model(**kwargs)` without autograd."""
    with torch.no_grad():
        return model(**kwargs)


def outputs(model, kwargs: dict) -> tuple:
    """Every tensor `model(**kwargs)` returns, without autograd, as a tuple (LTX-2: video
    and audio; a diffusers output object: its `.sample`)."""
    out = run(model, kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out.sample,)


def assert_same(out, ref) -> None:
    """`out` and `ref` are the 1-tuples a diffusers model returns with return_dict=False
    (or `(output.sample,)`); their tensors must be bitwise equal (`same_bits`: signed
    zeros count, NaN == NaN). A stock output holding NaNs fails: the comparison would
    mean nothing."""
    assert isinstance(out, tuple) and len(out) == len(ref) == 1
    o, r = out[0], ref[0]
    assert not r.isnan().any(), "the stock output has NaNs: the comparison would mean nothing"
    assert same_bits(o, r), f"{differing(o, r)} of {r.numel()} elements differ"


def assert_all_same(out, ref) -> None:
    """Every tensor a forward returns (LTX-2: video and audio) bitwise stock's."""
    assert isinstance(out, tuple) and len(out) == len(ref) >= 1
    for o, r in zip(out, ref):
        assert not r.isnan().any(), "the stock output has NaNs: the comparison would mean nothing"
        assert same_bits(o, r), f"{differing(o, r)} of {r.numel()} elements differ"


#: each integration's small inputs on its tiny config (`<model>_configs.make_inputs` keywords)
TINY_INPUTS = {
    "ltx2": {},
    "flux": dict(height=64, width=64, text_tokens=8),
    "flux2": dict(height=64, width=64, text_tokens=8),
    "qwenimage": dict(height=64, width=64, text_tokens=8),
    "wan": dict(height=32, width=32, frames=5, text_tokens=8),
    "sana": dict(height=128, width=128, text_tokens=8),
}


def _processors(model) -> list:
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


def is_stock(model) -> bool:
    """Whether nothing of bitfuse is left on `model`: no instance forward, no site
    marks, no handle, no attention processor of a bitfuse class."""
    return (all("forward" not in m.__dict__ for m in model.modules()) and not sites.sites_of(model)
            and "_bitfuse_handle" not in model.__dict__
            and not any(type(p).__module__.startswith("bitfuse.") for p in _processors(model)))


def check_identity(model, kwargs_list, *, compare=assert_same, **accelerate_options) -> None:
    """Stock, then accelerated (the same bits, and the handle at the quality asked),
    then restored (stock again, the same bits again), for every call in `kwargs_list`
    (forward keyword arguments with return_dict=False). `compare(out, ref)` asserts
    that two outputs are the same (default `assert_same`); `accelerate_options` go to
    `bitfuse.accelerate`."""
    refs = [run(model, kw) for kw in kwargs_list]
    handle = bitfuse.accelerate(model, **accelerate_options)
    try:
        assert not is_stock(model) and handle.quality == accelerate_options.get("quality", "lossless")
        for kw, ref in zip(kwargs_list, refs):
            compare(run(model, kw), ref)
    finally:
        handle.restore()
    assert is_stock(model)
    for kw, ref in zip(kwargs_list, refs):
        compare(run(model, kw), ref)


def check_high_mount(model, kwargs: dict, recording) -> None:
    """`accelerate(quality="high")` mounts high on every marked site (the blocks and the
    head); inside `bitfuse.quality("lossless")` every site call resolves lossless
    instead; both outputs are stock's bits on CPU (every site falls back to eager there);
    restore leaves the model stock. `recording()` is the test file's context manager
    recording site calls as dicts with the keys "tier" and "name"."""
    ref = run(model, kwargs)
    handle = bitfuse.accelerate(model, quality="high")
    try:
        marked = sites.sites_of(model)
        assert len(marked) == len(model.transformer_blocks) + 1 and all(s.tier == "high" for s in marked)
        with recording() as records:
            out = run(model, kwargs)
            n = len(records)
            with bitfuse.quality("lossless"):
                out_lossless = run(model, kwargs)
        tiers = [{r["tier"] for r in part if r["name"]} for part in (records[:n], records[n:])]
        assert n > 0 and tiers == [{"high"}, {"lossless"}]
        assert_same(out, ref)
        assert_same(out_lossless, ref)
    finally:
        handle.restore()
    assert is_stock(model)
