"""Model support: `accelerate(model)` dispatches on the model's type.

Supported: diffusers' `LTX2VideoTransformer3DModel` (diffusers 0.42.x), see
`bitfuse.models.ltx2`. A diffusers pipeline is accepted too: its `.transformer`
is accelerated (the handle keeps the pipeline as `.pipeline`). A model wrapped
by `torch.compile` (an OptimizedModule) is accelerated through `_orig_mod`.

Model modules import diffusers only when a model of theirs is passed, so
`import bitfuse` costs nothing where diffusers is absent.
"""

from __future__ import annotations

import torch

from .. import policy

__all__ = ["accelerate", "supported_models", "UnsupportedModelError"]


class UnsupportedModelError(TypeError):
    """No bitfuse support for this model type."""


def _class_names(obj) -> set[tuple[str, str]]:
    return {(c.__module__, c.__name__) for c in type(obj).__mro__}


def _is_diffusers_class(obj, name: str) -> bool:
    return any(mod.startswith("diffusers.") and n == name for mod, n in _class_names(obj))


# (diffusers class name, loader of the model module); matched on the MRO by name so
# that diffusers is imported only when such a model is actually passed
_REGISTRY = [
    ("LTX2VideoTransformer3DModel", lambda: __import__("bitfuse.models.ltx2", fromlist=["accelerate"])),
]


def supported_models() -> list[str]:
    return [name for name, _ in _REGISTRY]


def _resolve(model):
    """(the module to accelerate, the pipeline it came from or None)."""
    pipeline = None
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "transformer", None), torch.nn.Module):
        pipeline, model = model, model.transformer
    orig = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(orig, torch.nn.Module):
        model = orig
    return model, pipeline


def accelerate(model, *, quality: str = "lossless", cuda_graphs: bool = False, force: bool = False, **graph_options):
    """Route a supported model's adaLN sites through bitfuse; returns a handle
    with `.model` and `.restore()`.

    quality: the tier mounted on every site ("lossless": torch.equal to eager;
        "high": within one ULP), all or nothing. `bitfuse.quality(...)` overrides
        it per call.
    cuda_graphs: also wrap the model for CUDA-graph replay (bitfuse.graphs),
        passing `graph_options` through.
    force: accelerate a diffusers version whose forwards bitfuse has not verified
        (warns; output may then differ from that version's model).
    """
    policy.check_tier(quality)
    if graph_options and not cuda_graphs:
        raise TypeError(f"graph options {sorted(graph_options)} given without cuda_graphs=True")
    target, pipeline = _resolve(model)
    previous = target.__dict__.get("_bitfuse_handle")
    for name, load in _REGISTRY:
        if _is_diffusers_class(target, name):
            handle = load().accelerate(target, quality=quality, force=force)
            if pipeline is not None:
                handle.pipeline = pipeline
            break
    else:
        raise UnsupportedModelError(
            f"bitfuse has no support for {type(target).__module__}.{type(target).__name__}; "
            f"supported: {', '.join(supported_models())} (diffusers 0.42.x)"
        )

    # ---- CUDA graphs (bitfuse.graphs, a separate module): wrap the accelerated model.
    #      Contract: wrap_model_for_graphs(handle, **graph_options) returns an object
    #      (stored as handle.graphs) whose optional .restore() undoes the wrapping;
    #      handle.restore() calls it before putting the stock forwards back.
    if cuda_graphs and handle.graphs is None:
        try:
            from ..graphs import wrap_model_for_graphs

            wrapped = wrap_model_for_graphs(handle, **graph_options)
            if wrapped is not None:
                handle.graphs = wrapped
        except BaseException:
            if handle is not previous:
                handle.restore()
            raise
    return handle
