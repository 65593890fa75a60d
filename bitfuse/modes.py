"""The ways to run a model that `bitfuse run`, the benchmarks and the tests compare.

    from bitfuse import modes

    undo = modes.enter("lossless", pipe)     # a diffusers pipeline or its transformer
    video, audio = pipe(...)
    undo()                                   # stock diffusers again

    with modes.entered("graphs", pipe):
        video, audio = pipe(...)

- eager     stock diffusers: the reference.
- lossless  `bitfuse.accelerate(target)`: bit-identical to eager.
- high      `bitfuse.accelerate(target, quality="high")`: one-pass norm kernels,
            within the high tier's bound of eager, not bit-identical.
- graphs    lossless, with the forward replayed from CUDA graphs
            (`bitfuse.accelerate(target, cuda_graphs=True)`): bit-identical to eager.
- compile   regional `torch.compile` of the model's `_repeated_blocks`, as
            diffusers' `compile_repeated_blocks` does; no bitfuse.

`enter` checks the mode against the model's device first (graphs and compile
need a CUDA GPU) and raises `ModeError` with the reason; its undo puts the
model back exactly as it found it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__ = ["MODES", "BIT_IDENTICAL", "ModeError", "check", "enter", "entered", "model_of"]

MODES = ("eager", "lossless", "high", "graphs", "compile")
BIT_IDENTICAL = ("eager", "lossless", "graphs")  # the modes whose output must equal eager's, bit for bit

_NEEDS_CUDA = {
    "graphs": "CUDA graphs are captured on a CUDA device",
    "compile": "it is the GPU baseline bitfuse is measured against",
}


class ModeError(RuntimeError):
    """The mode cannot run on this target or device."""


def model_of(target) -> torch.nn.Module:
    """The model a mode acts on: a pipeline's `.transformer`, or `target` itself."""
    model = target if isinstance(target, torch.nn.Module) else getattr(target, "transformer", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a model or a pipeline with a .transformer, got {type(target).__name__}")
    return model


def check(mode: str, device: torch.device | str) -> None:
    """Raise ValueError for an unknown mode, ModeError for one that cannot run on `device`."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from: {', '.join(MODES)}")
    device = torch.device(device)
    if mode in _NEEDS_CUDA and device.type != "cuda":
        raise ModeError(f"mode {mode!r} needs a CUDA GPU ({_NEEDS_CUDA[mode]}); the model is on {device}")


def enter(mode: str, target) -> Callable[[], None]:
    """Set `target` (a model or a pipeline) up for `mode`; return the function that undoes it."""
    model = model_of(target)
    param = next(model.parameters(), None)
    check(mode, param.device if param is not None else "cpu")
    if mode == "eager":
        return lambda: None
    if mode == "compile":
        return _compile_repeated_blocks(model)
    import bitfuse  # through the package, so that a patched bitfuse.accelerate is the one used

    handle = bitfuse.accelerate(target, quality="high" if mode == "high" else "lossless",
                                cuda_graphs=mode == "graphs")
    return handle.restore


@contextlib.contextmanager
def entered(mode: str, target):
    """`enter(mode, target)` for the body of a with statement."""
    undo = enter(mode, target)
    try:
        yield
    finally:
        undo()


def _compile_repeated_blocks(model: torch.nn.Module) -> Callable[[], None]:
    # what ModelMixin.compile_repeated_blocks does (nn.Module.compile on every block whose class
    # is named in _repeated_blocks), keeping what each block had so that undo is exact
    names = getattr(model, "_repeated_blocks", None) or ()
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ModeError(f"mode 'compile': {type(model).__name__} has no repeated blocks to compile "
                        "(its _repeated_blocks names none of its modules)")
    missing = object()
    saved = [(b, b.__dict__.get("_compiled_call_impl", missing)) for b in blocks]
    for b in blocks:
        b.compile()  # with compile_repeated_blocks()'s defaults: graph breaks allowed

    def undo():
        for b, previous in saved:
            if previous is missing:
                b.__dict__.pop("_compiled_call_impl", None)
            else:
                b._compiled_call_impl = previous

    return undo
