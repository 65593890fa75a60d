"""Sites: the adaLN entry points a model block calls.

A site picks a path per call:
- inside torch.compile tracing it returns the plain eager expression, so
  Inductor sees ordinary ops and fuses them (an opaque op would block that);
- with BITFUSE_DISABLE=1, likewise the eager expression;
- otherwise the tier in force picks the kernel mode, and the first-sight gate
  decides whether the fast path may run here.

Parameters (`scale`, `shift`, `gate`) are tensors, or `Folded(table_row, temb)`:
diffusers' `table + temb` not yet added, which the kernels add on the fly with
eager's rounding (and every other path materialises first).

The tier in force is the one requested by an enclosing `bitfuse.quality(...)`,
else the one mounted on the site, else "lossless".

Blocks are marked as sites so that a tier can be mounted on a whole model,
all or nothing (`mount`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import policy
from .ops._pointwise import Folded, value
from .ops.gated_residual import gated_residual_reference, launch_gated_residual, plan_gated_residual
from .ops.layer_norm_modulate import launch_layer_norm_modulate, plan_layer_norm_modulate
from .ops.modulate import launch_modulate, modulate_reference, plan_modulate
from .ops.rms_norm_modulate import launch_rms_norm_modulate, plan_rms_norm, plan_rms_norm_modulate
from .ops.rotary import launch_rotary, plan_rotary, rotary_reference

# ---------------------------------------------------------------- marking and mounting


@dataclass
class Site:
    """A block's adaLN sites: its name, the norms it uses, and the tier mounted on it."""

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


def _tier(site) -> str:
    requested = policy.requested_quality()
    if requested is not None:
        return requested
    if site is not None:
        if isinstance(site, torch.nn.Module):
            site = getattr(site, "_bitfuse_site", None)
        if site is not None and site.tier is not None:
            return site.tier
    return "lossless"


def _plain() -> bool:
    return policy.DISABLED or torch.compiler.is_compiling()


# ---------------------------------------------------------------- pointwise sites


def modulate_site(x, scale, shift, *, site=None):
    """`x * (1 + scale) + shift`, bit-exact in every tier (a memory-bound op gains
    nothing from fewer roundings). `site` is accepted for symmetry with the norm sites."""
    if _plain():
        return x * (1 + value(scale)) + value(shift)
    plan = plan_modulate(x, scale, shift)
    if plan.__class__ is str:
        return modulate_reference(x, scale, shift)
    return policy.gated("modulate", "exact", plan, launch_modulate, modulate_reference, (x, scale, shift))


def gated_residual_site(x, y, gate, *, site=None):
    """`x + y * gate`, bit-exact in every tier."""
    if _plain():
        return x + y * value(gate)
    plan = plan_gated_residual(x, y, gate)
    if plan.__class__ is str:
        return gated_residual_reference(x, y, gate)
    return policy.gated("gated_residual", "exact", plan, launch_gated_residual, gated_residual_reference, (x, y, gate))


def rotary_site(query, key, query_freqs, key_freqs, rope_type):
    """Query and key rotated as diffusers' LTX-2 attention rotates them (`key_freqs`
    None: the query's), bit-exact in every tier. Returns (query, key). Sharing the
    frequencies (self-attention), both rotate in one launch that reads cos/sin once."""
    if key_freqs is None:
        key_freqs = query_freqs
    if _plain():
        return rotary_reference(query, query_freqs, rope_type), rotary_reference(key, key_freqs, rope_type)
    if key_freqs[0] is query_freqs[0] and key_freqs[1] is query_freqs[1] and key.shape == query.shape:
        plan = plan_rotary(query, *query_freqs, rope_type, y=key)
        if plan.__class__ is not str:
            return policy.gated("rotary", "exact", plan, launch_rotary, _rotary_pair,
                                (query, key, query_freqs, key_freqs, rope_type))
    return _rotary_one(query, query_freqs, rope_type), _rotary_one(key, key_freqs, rope_type)


def _rotary_one(x, freqs, rope_type):
    plan = plan_rotary(x, *freqs, rope_type)
    if plan.__class__ is str:
        return rotary_reference(x, freqs, rope_type)
    return policy.gated("rotary", "exact", plan, launch_rotary, rotary_reference, (x, freqs, rope_type))


def _rotary_pair(query, key, query_freqs, key_freqs, rope_type):
    return rotary_reference(query, query_freqs, rope_type), rotary_reference(key, key_freqs, rope_type)


def _modulate_terms(x, scale, shift):
    """Largest term magnitude of `x * (1 + scale) + shift` (the high tier's ULP scale)."""
    return (x.float() * (1 + value(scale).float())).abs().maximum(value(shift).float().abs())


def _norm_modulate_terms(norm, x, scale, shift, site):
    return _modulate_terms(norm(x), scale, shift)


# The norm sites' high contract: the one-pass kernel sums in another order, so its
# normalised row n is within one ULP of eager's (a last-bit flip on a few elements
# a million); it then applies eager's modulate roundings, through which a flipped
# n moves n * t, and the result, by up to two ULPs at the scale of the terms.
NORM_HIGH_ULPS = 2


# ---------------------------------------------------------------- norm + modulate sites


def norm_kind(norm) -> str | None:
    """Which reference a weightless norm module computes: "diffusers" (diffusers'
    RMSNorm), "aten" (torch.nn.RMSNorm, i.e. F.rms_norm), "layer_norm"
    (nn.LayerNorm without affine), or None for anything else."""
    if isinstance(norm, torch.nn.LayerNorm):
        return "layer_norm" if norm.weight is None and norm.bias is None else None
    if isinstance(norm, torch.nn.RMSNorm):
        return "aten" if norm.weight is None and norm.eps is not None else None
    cls = type(norm)
    if cls.__name__ == "RMSNorm" and cls.__module__.startswith("diffusers."):
        return "diffusers" if getattr(norm, "weight", None) is None else None
    return None


def _norm_mode(block, x) -> str:
    """The norm kernel a call takes: "high" (one pass) or "exact". fp32 always takes
    the exact kernel: there n is not rounded to a narrower type, so another
    summation order shows as several fp32 ULPs of n, outside the high contract."""
    return "high" if _tier(block) == "high" and x.dtype is not torch.float32 else "exact"


def _norm_then_modulate(norm, x, scale, shift, site):
    return modulate_site(norm(x), scale, shift, site=site)


def rms_norm_modulate_site(block, norm, x, scale, shift, eps=None):
    """`norm(x) * (1 + scale) + shift` for a weightless RMSNorm `norm`.

    lossless: the fused kernel that reproduces the norm's reduction, once
    verified here, else `norm(x)` then the exact modulate. high: the one-pass
    kernel (see NORM_HIGH_ULPS)."""
    if _plain():
        return norm(x) * (1 + value(scale)) + value(shift)
    kind = norm_kind(norm)
    if kind not in ("diffusers", "aten"):
        return _norm_then_modulate(norm, x, scale, shift, block)
    return _fused_norm_site("rms_norm_modulate", plan_rms_norm_modulate, _launch_rms, (kind,),
                            block, norm, x, scale, shift, eps)


def rms_norm_site(norm, x, *, site=None):
    """`norm(x)` for a weightless RMSNorm whose output is modulated more than once
    (LTX-2's a2v/v2a norms): the exact kernel without its modulate, bit-exact in
    every tier."""
    if _plain():
        return norm(x)
    kind = norm_kind(norm)
    if kind not in ("diffusers", "aten"):
        return norm(x)
    plan = plan_rms_norm(x, norm.eps, kind)
    if plan.__class__ is str:
        return norm(x)
    return policy.gated("rms_norm", "exact", plan, launch_rms_norm_modulate, norm, (x,))


def layer_norm_modulate_site(block, norm, x, scale, shift, eps=None):
    """`norm(x) * (1 + scale) + shift` for LayerNorm without affine; tiers as above."""
    if _plain():
        return norm(x) * (1 + value(scale)) + value(shift)
    if norm_kind(norm) != "layer_norm":
        return _norm_then_modulate(norm, x, scale, shift, block)
    return _fused_norm_site("layer_norm_modulate", plan_layer_norm_modulate, _launch_ln, (),
                            block, norm, x, scale, shift, eps)


def _fused_norm_site(op, plan_fn, launchers, extra, block, norm, x, scale, shift, eps):
    eps = norm.eps if eps is None else eps
    mode = _norm_mode(block, x)
    plan = plan_fn(x, scale, shift, eps, *extra, exact=mode == "exact")
    if plan.__class__ is str and mode == "high":  # no one-pass kernel here: the exact one serves
        mode = "exact"
        plan = plan_fn(x, scale, shift, eps, *extra, exact=True)
    if plan.__class__ is str:
        return _norm_then_modulate(norm, x, scale, shift, block)
    return policy.gated(op, mode, plan, launchers[mode], _norm_then_modulate, (norm, x, scale, shift, block),
                        _norm_modulate_terms, NORM_HIGH_ULPS)


_launch_rms = {
    "exact": lambda plan: launch_rms_norm_modulate(plan, exact=True),
    "high": lambda plan: launch_rms_norm_modulate(plan, exact=False),
}
_launch_ln = {
    "exact": lambda plan: launch_layer_norm_modulate(plan, exact=True),
    "high": lambda plan: launch_layer_norm_modulate(plan, exact=False),
}

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
