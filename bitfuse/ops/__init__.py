"""Kernels: one file per op holding the Triton kernel, its launcher, the
registered custom op and the eager reference. Each function here is guarded
but ungated: the kernel where the guard allows it, else the eager reference
(the sites add the first-sight gate and the tiers)."""

from .gated_residual import gated_residual, gated_residual_reference
from .layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_reference
from .modulate import modulate, modulate_reference
from .rms_norm_modulate import rms_norm_modulate, rms_norm_modulate_reference
from .rotary import rotary, rotary_reference

__all__ = [
    "modulate",
    "modulate_reference",
    "gated_residual",
    "gated_residual_reference",
    "rms_norm_modulate",
    "rms_norm_modulate_reference",
    "layer_norm_modulate",
    "layer_norm_modulate_reference",
    "rotary",
    "rotary_reference",
]
