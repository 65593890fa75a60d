"""bitfuse: faster diffusion-transformer inference without changing an output bit.

    handle = bitfuse.accelerate(transformer)     # lossless by default
    with bitfuse.quality("high"):                # per request
        ...
    handle.restore()
"""

from .policy import (
    FallbackWarning,
    Verdict,
    background_compiles,
    quality,
    requested_quality,
    reset_verdicts,
    verdicts,
)
from .sites import MountError, mark_site, mount, unmount

__version__ = "0.1.0"


def accelerate(model, *, quality: str = "lossless", cuda_graphs: bool = False, force: bool = False, **graph_options):
    """Route a supported model's adaLN sites through bitfuse; returns a handle.

    model: a diffusers transformer bitfuse supports (`bitfuse.models.supported_models()`),
        a pipeline (its `.transformer` is accelerated) or a `torch.compile` wrapper of one.
    quality: the tier mounted on every site, all or nothing: "lossless" (torch.equal
        to stock diffusers) or "high" (at least as accurate as eager: each site's output
        within one ULP of the float64 value of its expression, mean error no larger than
        eager's). `bitfuse.quality(...)` overrides it per call.
    cuda_graphs: also replay the forward from CUDA graphs, one per call signature
        (bitfuse.graphs); `graph_options` go to its GraphRunner (max_graphs, warmup, ...).
    force: accelerate even a diffusers whose copied code bitfuse has not verified
        (warns; the output may then differ from that diffusers' model).

    The first call compiles the kernels it meets on a thread pool, returning eager's
    bits at those sites meanwhile, and waits for them before it returns; the second
    verifies each against eager once (`bitfuse.background_compiles`).

    The handle has `.model`, `.quality`, `.graphs` (the runner, or None), `.pipeline`,
    `.sites` and `.restore()` (idempotent; also a context manager). Called again on an
    accelerated model with the same quality, returns the same handle.

    Raises UnsupportedModelError (not a supported model), UnsupportedVersionError
    (unverified diffusers, without force), AlreadyAcceleratedError (accelerated with
    another quality), MountError (a site cannot take the quality: nothing installed).
    """
    from .models import accelerate as _accelerate

    return _accelerate(model, quality=quality, cuda_graphs=cuda_graphs, force=force, **graph_options)


__all__ = [
    "accelerate",
    "quality",
    "background_compiles",
    "requested_quality",
    "verdicts",
    "reset_verdicts",
    "Verdict",
    "FallbackWarning",
    "mark_site",
    "mount",
    "unmount",
    "MountError",
]
