"""Weightless RMSNorm + adaLN modulation (placeholder: kernels land with the norm issue)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .modulate import modulate_reference


def plan_rms_norm_modulate(x, scale, shift, eps: float, reference: str, exact: bool = True):
    return "fused RMSNorm + modulate kernel not built yet"


def launch_rms_norm_modulate(plan, exact: bool = True) -> torch.Tensor:
    raise NotImplementedError


def rms_norm_reference(x, eps: float, reference: str) -> torch.Tensor:
    if reference == "aten":
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_modulate_reference(x, scale, shift, eps: float, reference: str) -> torch.Tensor:
    return modulate_reference(rms_norm_reference(x, eps, reference), scale, shift)
