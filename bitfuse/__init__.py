"""bitfuse: faster diffusion-transformer inference without changing an output bit.

    handle = bitfuse.accelerate(transformer)     # lossless by default
    with bitfuse.quality("high"):                # per request
        ...
    handle.restore()
"""

from .policy import FallbackWarning, Verdict, quality, requested_quality, reset_verdicts, verdicts
from .sites import MountError, mark_site, mount, unmount

__version__ = "0.1.0"


def accelerate(model, **kwargs):
    """Route a supported model's adaLN sites through bitfuse (see bitfuse.models)."""
    from .models import accelerate as _accelerate

    return _accelerate(model, **kwargs)


__all__ = [
    "accelerate",
    "quality",
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
