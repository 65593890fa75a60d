"""Kernels: one file per op holding the Triton kernel, its launcher, the
registered custom op and the eager reference."""

from .gated_residual import gated_residual, gated_residual_reference
from .modulate import modulate, modulate_reference

__all__ = ["modulate", "modulate_reference", "gated_residual", "gated_residual_reference"]
