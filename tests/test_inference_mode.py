"""Every integration under `torch.inference_mode()`, the context many callers run
inference in (diffusers' pipelines use `torch.no_grad()`).

Tensors made there are inference tensors: they have no version counter (reading
`_version` raises) and their in-place changes leave no trace, so the host caches
that check versions must not trust them (`_install.version_of`). Here each tiny
model, accelerated, is called in both grad modes, alternating on one handle (so
caches filled in one mode meet calls in the other), and every output is bitwise
stock's in the same mode. On CPU every site falls back to its eager expression
(the forward copies and their caches); on a GPU the kernels run, in bf16, with and
without CUDA graphs."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse.models import _install  # noqa: E402
from model_checks import TINY_INPUTS, assert_all_same, is_stock  # noqa: E402


def _run(model, kwargs, mode):
    with (torch.inference_mode() if mode == "inference" else torch.no_grad()):
        return model(**kwargs)


@pytest.mark.parametrize("setup", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu),
                                   pytest.param("cuda-graphs", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(TINY_INPUTS))
def test_accelerated_forward_in_inference_mode_is_stock(name, setup):
    C = importlib.import_module(f"bitfuse.models.{name}_configs")
    if setup == "cpu":
        model = C.build_model(C.tiny_config())
    else:
        model = C.build_model(C.tiny_config(), device="cuda", dtype=torch.bfloat16)
    kwargs = C.make_inputs(model, **TINY_INPUTS[name])
    refs = {mode: _run(model, kwargs, mode) for mode in ("inference", "no_grad")}
    handle = bitfuse.accelerate(model, cuda_graphs=setup == "cuda-graphs")
    try:
        for mode in ("inference", "inference", "no_grad", "inference", "no_grad"):
            assert_all_same(_run(model, kwargs, mode), refs[mode])
    finally:
        handle.restore()
    assert is_stock(model)
    assert_all_same(_run(model, kwargs, "inference"), refs["inference"])


def test_version_of_an_inference_tensor_equals_nothing():
    t = torch.zeros(3)
    v = _install.version_of(t)
    assert v == _install.version_of(t)
    t.add_(1)
    assert _install.version_of(t) != v
    with torch.inference_mode():
        i = torch.zeros(3)
    assert i.is_inference()
    assert _install.version_of(i) != _install.version_of(i)


@pytest.mark.parametrize("name", ["sana", "ltx2"])
def test_a_model_made_in_inference_mode_accelerates(name):
    """A model built (or loaded) under inference_mode has inference-tensor parameters:
    the projections are not packed (a Parameter's data can't move into a buffer of
    normal tensors: `projections.packable` says so), and the forward is stock's."""
    C = importlib.import_module(f"bitfuse.models.{name}_configs")
    with torch.inference_mode():
        model = C.build_model(C.tiny_config())
        kwargs = C.make_inputs(model, **TINY_INPUTS[name])
        ref = model(**kwargs)
        handle = bitfuse.accelerate(model)
        try:
            assert_all_same(model(**kwargs), ref)
            assert_all_same(model(**kwargs), ref)
        finally:
            handle.restore()
    assert is_stock(model)


def test_inference_parameters_are_not_packed():
    from bitfuse.ops import projections as P

    with torch.inference_mode():
        mods = [torch.nn.Linear(64, 64) for _ in range(3)]
    w, b = tuple(m.weight for m in mods), tuple(m.bias for m in mods)
    assert "inference tensors" in P.packable(w, b)
    assert P.pack(w, b) is False and all(m.weight.is_inference() for m in mods)
