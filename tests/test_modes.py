"""bitfuse.modes: each mode entered on a model or a pipeline, its output, and an exact undo."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from bitfuse import modes  # noqa: E402
from bitfuse.models.ltx2_configs import build_model, make_inputs, tiny_config  # noqa: E402
from bitfuse.numerics import same_bits  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.fixture
def model():
    return build_model(tiny_config())


def forward(model):
    with torch.no_grad():
        return model(**make_inputs(model, batch=2))


def test_check_names_and_devices():
    with pytest.raises(ValueError, match="unknown mode 'turbo'.*eager, lossless, high, graphs, compile"):
        modes.check("turbo", "cpu")
    for mode in ("graphs", "compile"):
        with pytest.raises(modes.ModeError, match=f"mode '{mode}' needs a CUDA GPU"):
            modes.check(mode, "cpu")
    for mode in ("eager", "lossless", "high"):
        modes.check(mode, "cpu")


@pytest.mark.parametrize("mode", ["eager", "lossless", "high"])
def test_cpu_modes_match_eager_and_undo(mode, model):
    ref = forward(model)
    forward_before = model.forward
    undo = modes.enter(mode, model)
    out = forward(model)
    undo()
    assert all(same_bits(a, b) for a, b in zip(out, ref))  # on a CPU every site takes the eager path
    assert model.forward == forward_before
    assert all(same_bits(a, b) for a, b in zip(forward(model), ref))


def test_accelerate_arguments_and_undo_on_error(model, monkeypatch):
    import bitfuse

    calls = []

    class Handle:
        def __init__(self, target, **kwargs):
            calls.append((target, kwargs))

        def restore(self):
            calls.append("restore")

    monkeypatch.setattr(bitfuse, "accelerate", Handle)

    class Pipeline:  # what modes needs of a pipeline: its .transformer
        transformer = model

    pipe = Pipeline()
    with pytest.raises(RuntimeError, match="inside"):
        with modes.entered("high", pipe):
            raise RuntimeError("inside")
    modes.enter("lossless", model)()
    assert calls == [(pipe, dict(quality="high", cuda_graphs=False)), "restore",
                     (model, dict(quality="lossless", cuda_graphs=False)), "restore"]
    with pytest.raises(TypeError, match="a pipeline with a .transformer"):
        modes.enter("eager", object())


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_gpu_modes_refused_on_a_cpu_model(model):
    for mode in ("graphs", "compile"):
        with pytest.raises(modes.ModeError, match="the model is on cpu"):
            modes.enter(mode, model)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's first import: torch.jit's notices
def test_compile_undo_is_exact(model):
    """Regional compile wraps each repeated block (lazily: nothing compiles until a call);
    undo leaves every block as it was, a block compiled before included."""
    blocks = list(model.transformer_blocks)
    marker = object()
    blocks[0]._compiled_call_impl = marker
    undo = modes._compile_repeated_blocks(model)
    assert all(b._compiled_call_impl is not None and b._compiled_call_impl is not marker for b in blocks)
    undo()
    assert blocks[0]._compiled_call_impl is marker
    assert all("_compiled_call_impl" not in b.__dict__ for b in blocks[1:])

    model.__class__ = type("NoBlocks", (type(model),), {"_repeated_blocks": []})
    with pytest.raises(modes.ModeError, match="no repeated blocks"):
        modes._compile_repeated_blocks(model)
