"""Sites: the entry points a model block calls where it computes adaLN, gated
residuals, norms and RoPE.

A site picks a path per call:
- inside torch.compile tracing it returns the plain eager expression, so
  Inductor sees ordinary ops and fuses them (an opaque op would block that);
- with BITFUSE_DISABLE=1, likewise the eager expression;
- otherwise the tier in force picks the kernel, and the first-sight gate
  (`policy.gated`) decides whether the fast path may run here.

Parameters (`scale`, `shift`, `gate`) are tensors that broadcast against x
(per-sample [B, 1, D], per-token [B, S, D], shared [D], or strided views such
as diffusers' `unbind` and `chunk` results, read in place), or
`Folded(table_row, temb)`: diffusers' `table + temb` not yet added, which the
kernels add on the fly with eager's rounding (every other path materialises it
first).

The tier in force is the one requested by an enclosing `bitfuse.quality(...)`,
else the one mounted on the block's site, else "lossless". Pointwise ops and
RoPE are exact in every tier (memory-bound: fewer roundings buy nothing); the
norm + modulate sites have a one-pass "high" kernel for bf16/fp16 (fp32 stays
exact). Blocks are marked as sites so that a tier can be mounted on a whole
model, all or nothing (`mount`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import policy
from .ops import (
    gated_residual,
    layer_norm_modulate,
    modulate,
    rms_norm_modulate,
    rotary,
)
from .ops._params import Folded, value

_MODULATE = modulate.SPEC
_GATED_RESIDUAL = gated_residual.SPEC
_RMS_NORM_MODULATE = rms_norm_modulate.SPECS
_RMS_NORM = rms_norm_modulate.RMS_NORM_SPEC
_LAYER_NORM_MODULATE = layer_norm_modulate.SPEC
_ROTARY = rotary.SPECS

# ---------------------------------------------------------------- marking and mounting


@dataclass
class Site:
    """A block's adaLN sites: its name, the norms it feeds to norm + modulate sites,
    and the tier mounted on it."""

    name: str
    norms: tuple = ()
    tier: str | None = None

    def rejects(self, tier: str) -> str | None:
        """Why this site can't take `tier`, or None if it can."""
        policy.check_tier(tier)
        if tier == "high":
            for norm in self.norms:
                if norm_kind(norm) is None:
                    return f"{self.name}: no one-pass kernel for {type(norm).__name__} (affine or unrecognised norm)"
        return None


class MountError(RuntimeError):
    """A tier could not be mounted on every site; none was mounted."""


def mark_site(block: torch.nn.Module, name: str | None = None, norms=()) -> Site:
    """Mark `block` as an adaLN site (idempotent) and return its Site."""
    site = getattr(block, "_bitfuse_site", None)
    if site is None:
        site = Site(name or type(block).__name__, tuple(norms))
        block._bitfuse_site = site
    return site


def unmark_site(block: torch.nn.Module) -> None:
    block.__dict__.pop("_bitfuse_site", None)


def sites_of(model: torch.nn.Module) -> list[Site]:
    """The Sites marked on `model` and its submodules."""
    return [m._bitfuse_site for m in model.modules() if getattr(m, "_bitfuse_site", None) is not None]


def mount(model: torch.nn.Module, tier: str) -> list[Site]:
    """Mount `tier` on every marked site of `model`, or on none: if any site
    rejects it, raise MountError with every reason and change nothing."""
    policy.check_tier(tier)
    sites = sites_of(model)
    if not sites:
        raise MountError("no bitfuse sites are marked in this model")
    reasons = [r for r in (s.rejects(tier) for s in sites) if r]
    if reasons:
        raise MountError(f"cannot mount quality {tier!r}: " + "; ".join(reasons))
    for s in sites:
        s.tier = tier
    return sites


def unmount(model: torch.nn.Module) -> None:
    for s in sites_of(model):
        s.tier = None


def _tier(block) -> str:
    requested = policy.requested_quality()
    if requested is not None:
        return requested
    site = getattr(block, "_bitfuse_site", None) if isinstance(block, torch.nn.Module) else block
    if site is not None and site.tier is not None:
        return site.tier
    return "lossless"


def _plain() -> bool:
    return policy.DISABLED or torch.compiler.is_compiling()


# ---------------------------------------------------------------- pointwise sites


def modulate_site(x, scale, shift):
    """`x * (1 + scale) + shift`, bit-exact in every tier.

    x: [B, S, D] or [N, D]; scale, shift: tensors broadcasting to x, or Folded.
    Returns a tensor of x's shape and dtype (eager's type promotion when dtypes mix)."""
    if _plain():
        return x * (1 + value(scale)) + value(shift)
    plan = modulate.plan_modulate(x, scale, shift)
    if plan.__class__ is str:
        return modulate.modulate_reference(x, scale, shift)
    return policy.gated(_MODULATE, "lossless", plan, (x, scale, shift))


def gated_residual_site(x, y, gate):
    """`x + y * gate` (also `x + gate * y`: the product commutes bitwise), bit-exact
    in every tier. x, y: the same shape [B, S, D] or [N, D]; gate broadcasts to it
    (or Folded). Returns a tensor of x's shape and dtype."""
    if _plain():
        return x + y * value(gate)
    plan = gated_residual.plan_gated_residual(x, y, gate)
    if plan.__class__ is str:
        return gated_residual.gated_residual_reference(x, y, gate)
    return policy.gated(_GATED_RESIDUAL, "lossless", plan, (x, y, gate))


# ---------------------------------------------------------------- RoPE


def _check_freqs(name: str, freqs) -> None:
    if not (isinstance(freqs, (tuple, list)) and len(freqs) == 2
            and all(isinstance(f, torch.Tensor) for f in freqs)):
        raise TypeError(f"rotary_site: {name} must be a (cos, sin) pair of tensors, got {type(freqs).__name__}")


def rotary_site(query, key, query_freqs, key_freqs, rope_type):
    """Query and key rotated as diffusers' LTX-2 attention rotates them, bit-exact in
    every tier. Returns (query, key).

    query, key: [B, S, C]; query_freqs, key_freqs: (cos, sin) pairs of fp32 tensors
    (`key_freqs` None: the query's); rope_type: "interleaved" (cos/sin [B, S, C] or
    broadcast to it) or "split" (cos/sin [B, H, S, C / 2H]). Sharing the
    frequencies (self-attention), both rotate in one launch that reads cos/sin once."""
    _check_freqs("query_freqs", query_freqs)
    if key_freqs is None:
        key_freqs = query_freqs
    else:
        _check_freqs("key_freqs", key_freqs)
    query_freqs, key_freqs = tuple(query_freqs), tuple(key_freqs)
    if _plain():
        return (rotary.rotary_reference(query, query_freqs, rope_type),
                rotary.rotary_reference(key, key_freqs, rope_type))
    spec = _ROTARY.get(rope_type)
    if spec is None:
        raise ValueError(f"unknown rope_type {rope_type!r}; choose one of {', '.join(_ROTARY)}")
    if key_freqs[0] is query_freqs[0] and key_freqs[1] is query_freqs[1] and key.shape == query.shape:
        plan = rotary.plan_rotary(query, query_freqs, rope_type, key)
        if plan.__class__ is not str:
            return policy.gated(spec, "lossless", plan, (query, query_freqs, rope_type, key))
    return _rotary_one(spec, query, query_freqs, rope_type), _rotary_one(spec, key, key_freqs, rope_type)


def _rotary_one(spec, x, freqs, rope_type):
    plan = rotary.plan_rotary(x, freqs, rope_type)
    if plan.__class__ is str:
        return rotary.rotary_reference(x, freqs, rope_type)
    return policy.gated(spec, "lossless", plan, (x, freqs, rope_type))


# ---------------------------------------------------------------- norms


def _plain_module(module) -> bool:
    """Calling `module` is just its class's forward: no hooks, no instance forward."""
    return "forward" not in module.__dict__ and not (module._forward_hooks or module._forward_pre_hooks)


def norm_kind(norm) -> str | None:
    """Which reference a weightless norm module computes, when the kernels can stand
    in for its call: "diffusers" (diffusers' RMSNorm), "aten" (torch.nn.RMSNorm,
    i.e. F.rms_norm), "layer_norm" (nn.LayerNorm without affine); None for anything
    else (a weight, a subclass such as FP32LayerNorm, hooks, an instance forward)."""
    cls = type(norm)
    if not isinstance(norm, torch.nn.Module) or not _plain_module(norm):
        return None
    if cls is torch.nn.LayerNorm:
        return "layer_norm" if norm.weight is None and norm.bias is None else None
    if cls is torch.nn.RMSNorm:
        return "aten" if norm.weight is None and norm.eps is not None else None
    if cls.__name__ == "RMSNorm" and cls.__module__ == "diffusers.models.normalization":
        return "diffusers" if getattr(norm, "weight", None) is None else None
    return None


def _norm_tier(block, x) -> str:
    """The kernel tier of a norm site: "high" (one pass) when requested, except for
    fp32: there n is not rounded to a narrower type, so the one-pass kernel's other
    summation order shows as fp32 ULPs of n; fp32 takes the lossless kernel."""
    return "high" if _tier(block) == "high" and x.dtype is not torch.float32 else "lossless"


def rms_norm_modulate_site(block, norm, x, scale, shift):
    """`norm(x) * (1 + scale) + shift` for a weightless RMSNorm `norm` (diffusers'
    or torch's). x: [B, S, D] or [N, D], contiguous last dimension; parameters as
    for `modulate_site`. lossless: the fused kernel reproducing the norm's own
    reduction order, once verified here, else the norm then the exact modulate.
    high: the one-pass kernel (`ops.rms_norm_modulate`), under the high contract."""
    if _plain():
        return norm(x) * (1 + value(scale)) + value(shift)
    kind = norm_kind(norm)
    if kind not in _RMS_NORM_MODULATE:
        return modulate_site(norm(x), scale, shift)
    args = (x, scale, shift, norm.eps, kind)
    if _norm_tier(block, x) == "high":
        plan = rms_norm_modulate.plan_rms_norm_modulate(*args, tier="high")
        if plan.__class__ is not str:
            return policy.gated(_RMS_NORM_MODULATE[kind], "high", plan, args, fallback=_rms_lossless)
    return _rms_lossless(*args)


def _rms_lossless(x, scale, shift, eps, kind):
    plan = rms_norm_modulate.plan_rms_norm_modulate(x, scale, shift, eps, kind)
    if plan.__class__ is str:  # (norm_kind made sure the functional norm is the module's)
        return modulate_site(rms_norm_modulate.rms_norm_reference(x, eps, kind), scale, shift)
    return policy.gated(_RMS_NORM_MODULATE[kind], "lossless", plan, (x, scale, shift, eps, kind))


def layer_norm_modulate_site(block, norm, x, scale, shift):
    """`norm(x) * (1 + scale) + shift` for `nn.LayerNorm` without affine; shapes and
    tiers as for `rms_norm_modulate_site`."""
    if _plain():
        return norm(x) * (1 + value(scale)) + value(shift)
    if norm_kind(norm) != "layer_norm":
        return modulate_site(norm(x), scale, shift)
    args = (x, scale, shift, norm.eps)
    if _norm_tier(block, x) == "high":
        plan = layer_norm_modulate.plan_layer_norm_modulate(*args, tier="high")
        if plan.__class__ is not str:
            return policy.gated(_LAYER_NORM_MODULATE, "high", plan, args, fallback=_ln_lossless)
    return _ln_lossless(*args)


def _ln_lossless(x, scale, shift, eps):
    plan = layer_norm_modulate.plan_layer_norm_modulate(x, scale, shift, eps)
    if plan.__class__ is str:
        return modulate_site(torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps), scale, shift)
    return policy.gated(_LAYER_NORM_MODULATE, "lossless", plan, (x, scale, shift, eps))


def rms_norm_site(norm, x):
    """`norm(x)` for a weightless RMSNorm whose output is modulated more than once
    (LTX-2's a2v/v2a norms): the exact kernel without its modulate, bit-exact in
    every tier. x: [B, S, D] or [N, D], contiguous last dimension."""
    if _plain():
        return norm(x)
    kind = norm_kind(norm)
    if kind not in _RMS_NORM_MODULATE:
        return norm(x)
    plan = rms_norm_modulate.plan_rms_norm(x, norm.eps, kind)
    if plan.__class__ is str:
        return norm(x)
    return policy.gated(_RMS_NORM, "lossless", plan, (x, norm.eps, kind))


__all__ = [
    "Folded",
    "Site",
    "MountError",
    "mark_site",
    "unmark_site",
    "sites_of",
    "mount",
    "unmount",
    "modulate_site",
    "gated_residual_site",
    "rms_norm_modulate_site",
    "rms_norm_site",
    "layer_norm_modulate_site",
    "rotary_site",
    "norm_kind",
]
