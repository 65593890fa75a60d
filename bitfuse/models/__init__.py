"""Model support: `accelerate(model)` dispatches on the model's type.

Supported (diffusers 0.42.x): `LTX2VideoTransformer3DModel` (`models.ltx2`),
`FluxTransformer2DModel` (`models.flux`), `Flux2Transformer2DModel`
(`models.flux2`), `QwenImageTransformer2DModel` (`models.qwenimage`),
`WanTransformer3DModel` (`models.wan`), `SanaTransformer2DModel`
(`models.sana`: its adaLN sites only), and any other diffusers model through the shared adaLN modules it holds
(`AdaLayerNormZero`, `AdaLayerNormZeroSingle`, `AdaLayerNormContinuous`,
`SD35AdaLayerNormZeroX`: `models.adaln`; a model with none is refused). A
diffusers pipeline is accepted too: its `.transformer`
is accelerated (the handle keeps the pipeline as `.pipeline`). A model wrapped
by `torch.compile` (an OptimizedModule) is accelerated through `_orig_mod`.

A model file joins with one line in `_REGISTRY` (diffusers class name -> module)
and provides, built on `_install`:
- `accelerate(model, *, quality, force) -> Handle` (one `_install.accelerate` call);
- `SOURCES`, an `_install.CopiedSources`: the pinned diffusers functions and its
  line-for-line copies, which tests/test_copies.py then checks;
- a Handle subclass whose `graph_options()` adds what graph capture needs (a
  `hoist` for host syncs), and optionally `stock_graph_options(model)` for graphing
  the stock model.
Model modules import diffusers only when a model of theirs is passed, so
`import bitfuse` costs nothing where diffusers is absent.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ._install import (
    AlreadyAcceleratedError,
    Handle,
    UnsupportedModelError,
    UnsupportedVersionError,
)

__all__ = [
    "accelerate",
    "supported_models",
    "integration_for",
    "Handle",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "AlreadyAcceleratedError",
]

#: diffusers class name -> the module supporting it; matched on the model's MRO by
#: name, so that diffusers is imported only when such a model is actually passed
_REGISTRY = {
    "LTX2VideoTransformer3DModel": "bitfuse.models.ltx2",
    "QwenImageTransformer2DModel": "bitfuse.models.qwenimage",
    "FluxTransformer2DModel": "bitfuse.models.flux",
    "Flux2Transformer2DModel": "bitfuse.models.flux2",
    "WanTransformer3DModel": "bitfuse.models.wan",
    "SanaTransformer2DModel": "bitfuse.models.sana",
    "ModelMixin": "bitfuse.models.adaln",  # any other diffusers model: its shared adaLN modules (last)
}


def supported_models() -> list[str]:
    """The diffusers model classes bitfuse supports, by name (and the generic layer)."""
    return [name for name in _REGISTRY if name != "ModelMixin"] + [
        "other diffusers models with AdaLayerNormZero/-Single/-Continuous or SD35AdaLayerNormZeroX modules"]


def integration_for(model) -> ModuleType | None:
    """The model module (e.g. `bitfuse.models.ltx2`) supporting `model`'s class, or None."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("diffusers.") and cls.__name__ in _REGISTRY:
            return importlib.import_module(_REGISTRY[cls.__name__])
    return None


def _resolve(model) -> tuple[torch.nn.Module, object]:
    """(the module to accelerate, the pipeline it came from or None)."""
    pipeline = None
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "transformer", None), torch.nn.Module):
        pipeline, model = model, model.transformer
    orig = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(orig, torch.nn.Module):
        model = orig
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(
            f"bitfuse.accelerate takes a diffusers transformer (a torch.nn.Module) or a pipeline with a "
            f".transformer, got {type(model).__name__}; supported: {', '.join(supported_models())}"
        )
    return model, pipeline


def accelerate(model, *, quality: str = "lossless", cuda_graphs: bool = False, force: bool = False, **graph_options):
    """`bitfuse.accelerate` (see its docstring): returns the model's Handle."""
    if graph_options and not cuda_graphs:
        raise TypeError(f"graph options {sorted(graph_options)} given without cuda_graphs=True")
    target, pipeline = _resolve(model)
    integration = integration_for(target)
    if integration is None:
        raise UnsupportedModelError(
            f"bitfuse has no support for {type(target).__module__}.{type(target).__name__}; "
            f"supported: {', '.join(supported_models())} (diffusers 0.42.x)"
        )
    previous = target.__dict__.get("_bitfuse_handle")
    handle = integration.accelerate(target, quality=quality, force=force)
    if pipeline is not None:
        handle.pipeline = pipeline
    if cuda_graphs and handle.graphs is None:
        try:
            handle.enable_graphs(**graph_options)
        except BaseException:
            if handle is not previous:
                handle.restore()
            raise
    return handle
