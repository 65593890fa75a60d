"""Sites: the entry points a model block calls where it computes adaLN, gated
residuals, norms and RoPE.

A site picks a path per call:
- inside torch.compile tracing it returns the plain eager expression, so
  Inductor sees ordinary ops and fuses them (an opaque op would block that);
- with BITFUSE_DISABLE=1, or inside an autocast context (where eager runs a
  norm in fp32 and a convolution in the lower precision), likewise the eager
  expression;
- otherwise the tier in force picks the kernel, and the first-sight gate
  (`policy.gated`) decides whether the fast path may run here; once it has,
  the site keeps the launch bound to the call's metadata (see "bound
  launches" below), and later calls like it skip the planner and the gate.

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

import functools
from dataclasses import dataclass

import torch
from torch.nn.modules import module as _nn_module

from . import policy
from .numerics import differing, same_bits
from .ops import (
    act_cat,
    conv_epilogue,
    gated_residual,
    head_gate,
    layer_norm_modulate,
    linear_attention,
    modulate,
    projections,
    qk_norm_rope,
    rms_norm_modulate,
    rotary,
)
from .ops._params import Folded, common_device_dtype, value, value32
from .ops._settings import cudnn_settings, gemm_settings

_MODULATE = modulate.SPEC
_GATED_RESIDUAL = gated_residual.SPEC
_HEAD_GATE = head_gate.SPEC
_RMS_NORM_MODULATE = rms_norm_modulate.SPECS
_RMS_NORM = rms_norm_modulate.RMS_NORM_SPEC
_LAYER_NORM_MODULATE = layer_norm_modulate.SPEC
_LAYER_NORM_MODULATE_F32 = layer_norm_modulate.F32_SPEC
_LAYER_NORM_F32 = layer_norm_modulate.AFFINE_SPEC
_GATED_RESIDUAL_F32 = gated_residual.F32_SPEC
_ROTARY = rotary.SPECS
_QK_NORM_ROPE = qk_norm_rope.SPEC
_CONV_BIAS_SILU = conv_epilogue.SPECS["conv_bias_silu"]
_CONV_BIAS_GLU = conv_epilogue.SPECS["conv_bias_glu"]
_LINEAR_ATTENTION = linear_attention.SPEC
_ACT_CAT = act_cat.BY_ACT
_PROJECTIONS = projections.SPEC

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


# autocast changes what eager computes (a norm in fp32, a convolution in the lower
# precision): under any autocast context the sites take the plain expression
_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or torch.is_autocast_enabled


def _plain() -> bool:
    return policy.DISABLED or torch.compiler.is_compiling() or _autocast()


# ---------------------------------------------------------------- bound launches
#
# A site's call key holds everything the op's guard reads from the call (operands'
# shapes, strides, dtypes and devices, Folded or not, the tier and the site's scalars),
# so a verified call's launch can be kept under it (`policy.bound`) and a later call
# with the same key skips the planner and the gate. Autograd-recording calls are not
# keyed (the guard reads requires_grad there): they always take the planner.


def _meta(t):
    """An operand's metadata for a call key, or None (no key: not a tensor)."""
    if isinstance(t, torch.Tensor):
        return (t.shape, t.stride(), t.dtype, t.get_device())
    if t.__class__ is Folded and isinstance(t.table, torch.Tensor) and isinstance(t.temb, torch.Tensor):
        if t.meta is not None:
            return t.meta
        a, b = t.table, t.temb
        return (Folded, a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device())
    return None


def tensor_meta(t: torch.Tensor) -> tuple:
    """What a call key reads of a tensor: (shape, strides, dtype, device index)."""
    return (t.shape, t.stride(), t.dtype, t.get_device())


def folded_with_meta(table: torch.Tensor, temb: torch.Tensor, table_meta: tuple, temb_meta: tuple) -> Folded:
    """`Folded(table, temb)` carrying its call-key metadata, from `tensor_meta` of each
    made once by a caller whose tensors are its own views (no one else holds them, so
    their shapes and strides cannot change) and share it (Sana: the table rows of every
    block, the timestep's six views of a forward): the sites' keys do not read it again."""
    return Folded(table, temb, (Folded, *table_meta, *temb_meta))


def _metas(obj):
    """`_meta` through nested tuples and lists (None stays None as "-", strings and
    numbers as they are), or None where a leaf has no metadata."""
    if obj is None:
        return "-"
    if obj.__class__ in (tuple, list):
        out = tuple(_metas(o) for o in obj)
        return None if None in out else out
    if obj.__class__ in (str, float, int, bool):
        return obj
    return _meta(obj)


def _call_key(*parts):
    """A call key of `parts` (scalars and `_meta`s), or None where a part has no metadata
    or autograd is recording."""
    if torch.is_grad_enabled() or None in parts:
        return None
    return parts


def _bound(site_key, args):
    """The result of the launch bound to `site_key`, or None (none bound, or this call
    needs the planner). A bound launch that raises is dropped; the gate then decides."""
    run = policy.bound(site_key) if site_key is not None else None
    if run is None:
        return None
    try:
        return run(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 - the planner's path records and handles it
        policy.forget(site_key)
        return None


# ---------------------------------------------------------------- pointwise sites


def modulate_site(x, scale, shift):
    """`x * (1 + scale) + shift`, bit-exact in every tier.

    x: [B, S, D] or [N, D]; scale, shift: tensors broadcasting to x, or Folded.
    Returns a tensor of x's shape and dtype (eager's type promotion when dtypes mix)."""
    if _plain():
        return x * (1 + value(scale)) + value(shift)
    args = (x, scale, shift)
    site_key = _call_key("modulate", _meta(x), _meta(scale), _meta(shift))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = modulate.plan_modulate(x, scale, shift)
    if plan.__class__ is str:
        return modulate.modulate_reference(x, scale, shift)
    return policy.gated(_MODULATE, "lossless", plan, args, site_key=site_key)


def gated_residual_site(x, y, gate):
    """`x + y * gate` (also `x + gate * y`: the product commutes bitwise), bit-exact
    in every tier. x, y: the same shape [B, S, D] or [N, D]; gate broadcasts to it
    (or Folded); y may be Folded too (a layer's output and the bias eager adds
    after it: `linear_bias_split`). Returns a tensor of x's shape and dtype, laid
    out as eager's (a permuted x, whose eager result keeps its layout, takes eager)."""
    if _plain():
        return x + value(y) * value(gate)
    args = (x, y, gate)
    site_key = _call_key("gated_residual", _meta(x), _meta(y), _meta(gate))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = gated_residual.plan_gated_residual(x, y, gate)
    if plan.__class__ is str:
        return gated_residual.gated_residual_reference(x, y, gate)
    return policy.gated(_GATED_RESIDUAL, "lossless", plan, args, site_key=site_key)


def head_gate_site(y, gate, heads: int):
    """`(y.unflatten(-1, (heads, -1)) * gate.unsqueeze(-1)).flatten(-2)`: each head of y
    scaled by its gate (LTX-2.3's gated attention), bit-exact in every tier.

    y: [B, S, C] or [N, C]; gate: [B, S, heads] or broadcasting to it. Returns a
    tensor of y's shape and dtype (eager's type promotion when dtypes mix)."""
    if _plain() or not isinstance(gate, torch.Tensor) or gate.dim() == 0 or gate.shape[-1] != heads:
        return (y.unflatten(-1, (heads, -1)) * gate.unsqueeze(-1)).flatten(-2)
    args = (y, gate)
    site_key = _call_key("head_gate", _meta(y), _meta(gate))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = head_gate.plan_head_gate(y, gate)
    if plan.__class__ is str:
        return head_gate.head_gate_reference(y, gate)
    return policy.gated(_HEAD_GATE, "lossless", plan, args, site_key=site_key)


# ---------------------------------------------------------------- fp32-compute sites (Wan)
#
# Wan computes its adaLN in fp32 on bf16 activations: parameters `table + temb.float()`
# (fp32), `x.float()` through FP32LayerNorm, one rounding at `.type_as(x)`. These sites
# take fp32 parameters (or Folded ones, summed in fp32: `value32`) and are exact in
# every tier (one rounding already: nothing for a high tier to gain).


def gated_residual_f32_site(x, y, gate):
    """`(x.float() + y * gate).type_as(x)` (Wan; `y.float() * gate` is the same), bit-exact
    in every tier. x, y: [B, S, D] or [N, D] of one dtype; gate fp32 broadcasting to x,
    or Folded (`table + temb.float()`). Returns a tensor of x's shape and dtype."""
    if _plain():
        return (x.float() + y * value32(gate)).type_as(x)
    args = (x, y, gate)
    site_key = _call_key("gated_residual_f32", _meta(x), _meta(y), _meta(gate))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = gated_residual.plan_gated_residual_f32(x, y, gate)
    if plan.__class__ is str:
        return gated_residual.gated_residual_f32_reference(x, y, gate)
    return policy.gated(_GATED_RESIDUAL_F32, "lossless", plan, args, site_key=site_key)


def fp32_layer_norm_kind(norm) -> str | None:
    """"plain" for diffusers' FP32LayerNorm without affine, "affine" with weight and bias,
    when the kernels can stand in for its call on `x.float()`; None for anything else
    (another class or a subclass, one of weight/bias, hooks, an instance forward)."""
    cls = type(norm)
    if not (isinstance(norm, torch.nn.Module) and cls.__name__ == "FP32LayerNorm"
            and cls.__module__ == "diffusers.models.normalization" and _plain_module(norm)):
        return None
    if len(norm.normalized_shape) != 1:
        return None
    if norm.weight is None and norm.bias is None:
        return "plain"
    if norm.weight is not None and norm.bias is not None:
        return "affine"
    return None


def layer_norm_modulate_f32_site(norm, x, scale, shift):
    """`(norm(x.float()) * (1 + scale) + shift).type_as(x)` for diffusers' FP32LayerNorm
    without affine (Wan's norm1/norm3/norm_out), bit-exact in every tier. x: [B, S, D] or
    [N, D], last dimension contiguous; scale, shift fp32 broadcasting to x, or Folded.
    Any other norm module is called as it is."""
    if _plain() or fp32_layer_norm_kind(norm) != "plain":
        return (norm(x.float()) * (1 + value32(scale)) + value32(shift)).type_as(x)
    args = (x, scale, shift, norm.eps)
    site_key = _call_key("layer_norm_modulate_f32", norm.eps, _meta(x), _meta(scale), _meta(shift))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = layer_norm_modulate.plan_layer_norm_modulate_f32(*args)
    if plan.__class__ is str:
        return layer_norm_modulate.layer_norm_modulate_f32_reference(*args)
    return policy.gated(_LAYER_NORM_MODULATE_F32, "lossless", plan, args, site_key=site_key)


def layer_norm_f32_site(norm, x):
    """`norm(x.float()).type_as(x)` for diffusers' FP32LayerNorm with weight and bias
    (Wan's norm2 with cross_attn_norm), bit-exact in every tier. x: [B, S, D] or [N, D],
    last dimension contiguous. Any other module is called as it is."""
    if _plain() or fp32_layer_norm_kind(norm) != "affine":
        return norm(x.float()).type_as(x)
    args = (x, norm.weight, norm.bias, norm.eps)
    site_key = _call_key("layer_norm_f32", norm.eps, _meta(x), _meta(norm.weight), _meta(norm.bias))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = layer_norm_modulate.plan_layer_norm_f32(*args)
    if plan.__class__ is str:
        return layer_norm_modulate.layer_norm_f32_reference(*args)
    return policy.gated(_LAYER_NORM_F32, "lossless", plan, args, site_key=site_key)


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


# ---------------------------------------------------------------- query/key norms + RoPE


def qk_norm_kind(norm, width: int) -> str | None:
    """Which reference a query/key norm module computes over rows of `width`, when the
    fused kernel can stand in for its call: "aten" (torch.nn.RMSNorm over the last
    dimension), "diffusers" (diffusers' RMSNorm without bias); None for anything else
    (another class or a subclass, hooks, an instance forward, another shape)."""
    cls = type(norm)
    if not isinstance(norm, torch.nn.Module) or not _plain_module(norm):
        return None
    if cls is torch.nn.RMSNorm:
        return "aten" if tuple(norm.normalized_shape) == (width,) else None
    if cls.__name__ == "RMSNorm" and cls.__module__ == "diffusers.models.normalization":
        return "diffusers" if getattr(norm, "bias", None) is None else None
    return None


def _qk_norms(norms, width):
    """(kind, eps, weight pairs) for (norm_q, norm_k) pairs sharing one reference and one
    eps, or None (the fused kernel can't stand in for them)."""
    kinds = {qk_norm_kind(n, width) for pair in norms for n in pair}
    epss = {n.eps for pair in norms for n in pair}
    if len(kinds) != 1 or None in kinds or len(epss) != 1:
        return None
    weights = tuple((q.weight, k.weight) for q, k in norms)
    return kinds.pop(), epss.pop(), None if weights[0][0] is None else weights


def qk_norm_rope_site(norm_q, norm_k, query, key, query_freqs, key_freqs, rope_type):
    """`norm_q(query)`, `norm_k(key)`, then both rotated as LTX-2's attention rotates
    them, in one launch, bit-exact in every tier. Returns (query, key).

    norm_q, norm_k: the attention's norm modules, torch.nn.RMSNorm over the last
        dimension (LTX-2) or diffusers' RMSNorm, with or without weight (anything else:
        the modules are called as they are).
    query, key: [B, S_q, C] and [B, S_k, C] (lengths may differ: cross-attention), one
        dtype, last dimension contiguous (views of a fused projection are read in place).
    query_freqs, key_freqs: (cos, sin) pairs of fp32 tensors, or None for no RoPE
        (`key_freqs` None: the query's); rope_type: "interleaved" (cos/sin [B|1, S, C])
        or "split" (cos/sin [B, H, S, C / 2H]), None with no frequencies; or "wan"
        (Wan's `apply_rotary_emb` on the [B, S, H, Dh] view of x, cos/sin fp32 (or
        float64) [1, S, 1, Dh] as WanRotaryPosEmbed returns them; the result stays [B, S, C]).
        Interleaved tables whose columns 2i and 2i + 1 are equal may carry their
        halves as an attribute, `freqs.pairs = (cos[..., ::2], sin[..., ::2])`
        contiguous (LTX-2.0's, `models.ltx2_host.paired`): where query's and key's
        both do, the kernel reads those (half the bytes; the op's rope_type "pairs")
        and any fallback the full tables."""
    if query_freqs is not None:
        _check_freqs("query_freqs", query_freqs)
        if key_freqs is None:
            key_freqs = query_freqs
        else:
            _check_freqs("key_freqs", key_freqs)
        halves = _halves(query_freqs, key_freqs) if rope_type == "interleaved" else None
        query_freqs, key_freqs = tuple(query_freqs), tuple(key_freqs)
        if rope_type not in _ROTARY and rope_type != "wan":
            raise ValueError(f"unknown rope_type {rope_type!r}; choose one of {', '.join([*_ROTARY, 'wan'])}")
    elif key_freqs is not None:
        raise ValueError("qk_norm_rope_site: key_freqs given without query_freqs")
    else:
        rope_type, halves = None, None
    if not _plain():
        norms = _qk_norms(((norm_q, norm_k),), query.shape[-1])
        if norms is not None:
            kind, eps, weights = norms
            if halves is not None:
                args = ((query,), (key,), weights, eps, (halves,), "pairs", kind)
            else:
                args = ((query,), (key,), weights, eps, None if rope_type is None else ((query_freqs, key_freqs),),
                        rope_type, kind)
            site_key = _call_key("qk_norm_rope", _metas(args))
            out = _bound(site_key, args)
            if out is not None:
                return out
            plan = qk_norm_rope.plan_qk_norm_rope(*args)
            if plan.__class__ is not str:
                return policy.gated(_QK_NORM_ROPE, "lossless", plan, args, site_key=site_key)
    query, key = norm_q(query), norm_k(key)
    if rope_type is None:
        return query, key
    if rope_type == "wan":
        return (qk_norm_rope.rope_reference(query, query_freqs, "wan"),
                qk_norm_rope.rope_reference(key, key_freqs, "wan"))
    return rotary_site(query, key, query_freqs, key_freqs, rope_type)


def _halves(query_freqs, key_freqs):
    """The compact halves both interleaved tables carry (`pairs`), or None."""
    q, k = getattr(query_freqs, "pairs", None), getattr(key_freqs, "pairs", None)
    return None if q is None or k is None else (q, k)


def joint_qk_norm_rope_site(sources, freqs, rope_type):
    """Per-head query/key norms, the sources concatenated along the sequence, and RoPE,
    as FLUX.1's and Qwen-Image's joint attention compute them, in one launch, bit-exact
    in every tier. Returns (query, key), each [B, sum S_i, H, D].

    sources: a sequence of one or two (norm_q, norm_k, query, key), in concatenation
        order (text first, as both models concatenate); query and key [B, S_i, H, D], one
        dtype, last dimension contiguous; the norms torch.nn.RMSNorm(D) (FLUX) or
        diffusers' RMSNorm(D) (Qwen-Image), all four of one class and eps.
    freqs, rope_type:
        None, None: no RoPE;
        (cos, sin), "interleaved": FLUX's `image_rotary_emb`, fp32 [sum S_i, D] over the
            concatenated sequence (rotated as `apply_rotary_emb(x, freqs, sequence_dim=1)`);
        a sequence of complex64 [S_i, D / 2], "complex": Qwen-Image's frequencies, one
            per source in the sources' order (rotated as `apply_rotary_emb_qwen(x, f,
            use_real=False)`, before the concatenation)."""
    sources = [tuple(s) for s in sources]
    if not sources or any(len(s) != 4 for s in sources):
        raise ValueError("joint_qk_norm_rope_site: sources must be (norm_q, norm_k, query, key) tuples")
    if rope_type not in (None, "interleaved", "complex"):
        raise ValueError(f"unknown rope_type {rope_type!r}; choose None, 'interleaved' or 'complex'")
    if (freqs is None) != (rope_type is None):
        raise ValueError("joint_qk_norm_rope_site: freqs and rope_type go together")
    if rope_type == "interleaved":
        _check_freqs("freqs", freqs)
        freqs = tuple(freqs)
    elif rope_type == "complex":
        freqs = tuple(freqs)
        if len(freqs) != len(sources):
            raise ValueError("joint_qk_norm_rope_site: complex freqs are one tensor per source")
    if not _plain() and len(sources) <= 2:
        norms = _qk_norms([s[:2] for s in sources], sources[0][2].shape[-1])
        per_source = None if rope_type is None else _joint_freqs(sources, freqs, rope_type)
        if norms is not None and (rope_type is None or per_source is not None):
            kind, eps, weights = norms
            args = (tuple(s[2] for s in sources), tuple(s[3] for s in sources), weights, eps, per_source,
                    rope_type, kind)
            site_key = _call_key("qk_norm_rope", _metas(args))
            out = _bound(site_key, args)
            if out is not None:
                return out
            plan = qk_norm_rope.plan_qk_norm_rope(*args)
            if plan.__class__ is not str:
                return policy.gated(_QK_NORM_ROPE, "lossless", plan, args, site_key=site_key)
    queries = [nq(q) for nq, _, q, _ in sources]
    keys = [nk(k) for _, nk, _, k in sources]
    if rope_type == "complex":  # Qwen-Image: each source rotated, then concatenated
        queries = [qk_norm_rope.rope_reference(q, f, "complex") for q, f in zip(queries, freqs)]
        keys = [qk_norm_rope.rope_reference(k, f, "complex") for k, f in zip(keys, freqs)]
    query, key = (queries[0], keys[0]) if len(sources) == 1 else (torch.cat(queries, dim=1), torch.cat(keys, dim=1))
    if rope_type == "interleaved":  # FLUX: concatenated, then rotated
        query = qk_norm_rope.rope_reference(query, freqs, "interleaved")
        key = qk_norm_rope.rope_reference(key, freqs, "interleaved")
    return query, key


def _joint_freqs(sources, freqs, rope_type):
    """Per-source (query freqs, key freqs) for the op, or None where eager would not
    broadcast them (the eager path then raises what eager raises)."""
    if rope_type == "complex":
        return tuple((f, f) for f in freqs)
    cos, sin = freqs
    lengths = [s[2].shape[1] for s in sources]
    if cos.dim() != 2 or cos.shape[0] != sum(lengths) or any(s[3].shape[1] != n for s, n in zip(sources, lengths)):
        return None
    out, start = [], 0
    for n in lengths:
        pair = (cos[start:start + n], sin[start:start + n])
        out.append((pair, pair))
        start += n
    return tuple(out)


# ---------------------------------------------------------------- norms


def unhooked(module) -> bool:
    """Nothing steps into a call of `module`: no hooks (its own or global: torch's
    `register_module_forward_hook` and kin) and no `module.compile()`'d call."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks or module._compiled_call_impl is not None)


def _plain_module(module) -> bool:
    """Calling `module` is just its class's forward: `unhooked`, no instance forward."""
    return "forward" not in module.__dict__ and unhooked(module)


def norm_kind(norm) -> str | None:
    """Which reference a weightless norm module computes, when the kernels can stand
    in for its call: "diffusers" (diffusers' RMSNorm), "aten" (torch.nn.RMSNorm,
    i.e. F.rms_norm), "layer_norm" (nn.LayerNorm without affine); None for anything
    else (a weight, a subclass such as FP32LayerNorm, hooks, an instance forward)."""
    cls = type(norm)
    if not isinstance(norm, torch.nn.Module) or not _plain_module(norm):
        return None
    if cls is torch.nn.LayerNorm:  # (its weight and bias are registered parameters, None without affine)
        p = norm._parameters
        return "layer_norm" if p.get("weight", 0) is None and p.get("bias", 0) is None else None
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
    tier = _norm_tier(block, x)
    site_key = _call_key("rms_norm_modulate", kind, tier, norm.eps, _meta(x), _meta(scale), _meta(shift))
    out = _bound(site_key, args)
    if out is not None:
        return out
    if tier == "high":
        plan = rms_norm_modulate.plan_rms_norm_modulate(*args, tier="high")
        if plan.__class__ is not str:
            return policy.gated(_RMS_NORM_MODULATE[kind], "high", plan, args, site_key=site_key,
                                fallback=functools.partial(_rms_lossless, site_key=site_key))
    return _rms_lossless(*args, site_key=site_key)


def _rms_lossless(x, scale, shift, eps, kind, site_key=None):
    plan = rms_norm_modulate.plan_rms_norm_modulate(x, scale, shift, eps, kind)
    if plan.__class__ is str:  # (norm_kind made sure the functional norm is the module's)
        return modulate_site(rms_norm_modulate.rms_norm_reference(x, eps, kind), scale, shift)
    return policy.gated(_RMS_NORM_MODULATE[kind], "lossless", plan, (x, scale, shift, eps, kind), site_key=site_key)


def layer_norm_modulate_site(block, norm, x, scale, shift):
    """`norm(x) * (1 + scale) + shift` for `nn.LayerNorm` without affine; shapes and
    tiers as for `rms_norm_modulate_site`."""
    if _plain():
        return norm(x) * (1 + value(scale)) + value(shift)
    if norm_kind(norm) != "layer_norm":
        return modulate_site(norm(x), scale, shift)
    args = (x, scale, shift, norm.eps)
    tier = _norm_tier(block, x)
    site_key = _call_key("layer_norm_modulate", tier, norm.eps, _meta(x), _meta(scale), _meta(shift))
    out = _bound(site_key, args)
    if out is not None:
        return out
    if tier == "high":
        plan = layer_norm_modulate.plan_layer_norm_modulate(*args, tier="high")
        if plan.__class__ is not str:
            return policy.gated(_LAYER_NORM_MODULATE, "high", plan, args, site_key=site_key,
                                fallback=functools.partial(_ln_lossless, site_key=site_key))
    return _ln_lossless(*args, site_key=site_key)


def _ln_lossless(x, scale, shift, eps, site_key=None):
    plan = layer_norm_modulate.plan_layer_norm_modulate(x, scale, shift, eps)
    if plan.__class__ is str:
        return modulate_site(torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps), scale, shift)
    return policy.gated(_LAYER_NORM_MODULATE, "lossless", plan, (x, scale, shift, eps), site_key=site_key)


def rms_norm_site(norm, x):
    """`norm(x)` for a weightless RMSNorm whose output is not modulated once (LTX-2's
    a2v/v2a norms, modulated twice; LTX-2.0's norm2, not at all): the exact kernel
    without its modulate, bit-exact in every tier. x: [B, S, D] or [N, D], contiguous last dimension."""
    if _plain():
        return norm(x)
    kind = norm_kind(norm)
    if kind not in _RMS_NORM_MODULATE:
        return norm(x)
    args = (x, norm.eps, kind)
    site_key = _call_key("rms_norm", kind, norm.eps, _meta(x))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = rms_norm_modulate.plan_rms_norm(*args)
    if plan.__class__ is str:
        return norm(x)
    return policy.gated(_RMS_NORM, "lossless", plan, args, site_key=site_key)


# ---------------------------------------------------------------- convolution epilogues
#
# Routed by models.sana (GLUMBConv); the outputs keep eager's channels-last strides.


def _conv_args(conv, act, x):
    """(x, weight, bias, stride, padding, dilation, groups) when calling `conv` then `act`
    is `F.conv2d(x, ...)` then `F.silu`: `conv` an `nn.Conv2d` (the class itself) with
    zero padding given as numbers, `act` an `nn.SiLU`, neither with hooks nor an
    instance forward; else None (the modules are called as they are)."""
    if type(conv) is not torch.nn.Conv2d or type(act) is not torch.nn.SiLU:
        return None
    if not (_plain_module(conv) and _plain_module(act)) or conv.padding_mode != "zeros":
        return None
    if isinstance(conv.padding, str):
        return None
    p = conv._parameters  # (conv.weight and conv.bias, without nn.Module's attribute fallback)
    return (x, p["weight"], p["bias"], tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation), conv.groups)


def _conv_key(name, args):
    x, weight, bias = args[:3]
    bias_meta = "no bias" if bias is None else _meta(bias)
    return _call_key(name, _meta(x), _meta(weight), bias_meta, *args[3:], cudnn_settings(weight.dtype))


def conv_bias_silu_site(conv, act, x):
    """`act(conv(x))` for an `nn.Conv2d` `conv` and an `nn.SiLU` `act` (the shape of Sana's
    GLUMBConv `conv_inverted` and its nonlinearity), bit-exact in every tier: where
    eager's convolution adds its bias as a separate op (cuDNN), the convolution without
    it, then bias + SiLU in one kernel (`ops.conv_epilogue`), verified here at first
    sight against the stock expression. x: [B, C_in, H, W] (Sana: a channels-last
    view). Returns what `act(conv(x))` returns."""
    if _plain():
        return act(conv(x))
    args = _conv_args(conv, act, x)
    if args is None:
        return act(conv(x))
    site_key = _conv_key("conv_bias_silu", args)
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = conv_epilogue.plan_conv_bias_silu(*args)
    if plan.__class__ is str:
        return act(conv(x))
    return policy.gated(_CONV_BIAS_SILU, "lossless", plan, args, site_key=site_key)


def conv_bias_glu_site(conv, act, x):
    """`hidden * act(gate)` for `hidden, gate = torch.chunk(conv(x), 2, dim=1)`, an
    `nn.Conv2d` `conv` and an `nn.SiLU` `act` (the shape of Sana's GLUMBConv `conv_depth`,
    the chunk and the gated nonlinearity), bit-exact in every tier: eager's convolution
    (without its bias where eager adds it separately), then bias, SiLU of the gate half
    and the product in one kernel, verified here at first sight against the stock
    expression. x: [B, C_in, H, W]; conv's output channels even. Returns
    [B, C_out / 2, H_out, W_out]."""
    if not _plain():
        args = _conv_args(conv, act, x)
        if args is not None:
            site_key = _conv_key("conv_bias_glu", args)
            out = _bound(site_key, args)
            if out is not None:
                return out
            plan = conv_epilogue.plan_conv_bias_glu(*args)
            if plan.__class__ is not str:
                return policy.gated(_CONV_BIAS_GLU, "lossless", plan, args, site_key=site_key)
    hidden, gate = torch.chunk(conv(x), 2, dim=1)
    return hidden * act(gate)


# ---------------------------------------------------------------- an activation into a concatenation
#
# Routed by models.flux (FLUX.1's single blocks: the tanh GELU) and models.flux2 (the
# single blocks' and feed-forwards' SwiGLU).

ACT_REFERENCES = {"gelu_tanh": act_cat.gelu_tanh_reference, "swiglu": act_cat.swiglu_reference}


def plain_gelu_tanh(module) -> bool:
    """Whether calling `module` is `F.gelu(x, approximate="tanh")` and nothing else: an
    `nn.GELU(approximate="tanh")` (the class itself), no hooks, no instance forward."""
    return type(module) is torch.nn.GELU and module.approximate == "tanh" and _plain_module(module)


def plain_silu(module) -> bool:
    """Whether calling `module` is `F.silu(x)` and nothing else: an `nn.SiLU` (the class
    itself, not in place), no hooks, no instance forward."""
    return type(module) is torch.nn.SiLU and not module.inplace and _plain_module(module)


def cat_act_site(a, m, act: str | None, dim: int = -1):
    """`torch.cat([a, act(m)], dim)` (a None: `act(m)`; act None: `m`), bit-exact in every
    tier: the activation and the concatenation in one kernel (`ops.act_cat`) where act
    is "gelu_tanh" (`F.gelu(m, approximate="tanh")`) or "swiglu" (diffusers'
    `Flux2SwiGLU`: `F.silu(m[..., :h]) * m[..., h:]`, h = m.shape[-1] // 2), dim is the
    last axis and the gate has verified the signature; else the eager expression.

    a: [B, S, Da] or [N, Da], or None; m: [B, S, Dm] or [N, Dm] (the SwiGLU: 2 Dm), of a's
    leading sizes, dtype and device. Returns [.., Da + Dm], contiguous, as eager's."""
    spec = _ACT_CAT.get(act)
    if spec is None or _plain() or not isinstance(m, torch.Tensor) or dim not in (-1, m.dim() - 1):
        y = m if act is None else ACT_REFERENCES[act](m)
        return y if a is None else torch.cat([a, y], dim=dim)
    args = (a, m)
    site_key = _call_key(spec.name, "-" if a is None else _meta(a), _meta(m))
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = spec.plan(a, m)
    if plan.__class__ is str:
        return spec.reference(a, m)
    return policy.gated(spec, "lossless", plan, args, site_key=site_key)


# ---------------------------------------------------------------- a layer's bias left to its consumer
#
# Where eager adds a layer's bias as an elementwise op of its own after the product, the
# product and the bias go on as `Folded(bias, product)`, whose `value()` is eager's
# tensor bit for bit, to a consumer that adds the bias in its own kernel with eager's
# rounding (the gated residual's y): the add never runs as an op. Which aten path adds
# the bias separately is a fact of the running build, checked at first sight per
# geometry against the module's own call (`policy.fact`); elsewhere the module's call.

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _split_holds(ref, bias, product):
    """None where `bias + product` is `ref` bit for bit (values and layout), else why not."""
    value_ = bias + product
    if not same_bits(value_, ref):
        return f"{differing(value_, ref)} of {ref.numel()} elements differ from the layer's own call"
    if value_.stride() != ref.stride():
        return f"the sum's strides {value_.stride()} are not the layer's {ref.stride()}"
    return None


def linear_bias_split(linear, x):
    """`linear(x)` for an `nn.Linear` with a bias, as `Folded(bias, torch.matmul(x,
    weight.t()))` where eager's `F.linear` is that matmul followed by `add_(bias)` (aten's
    `linear` for an x that is neither 2-D nor contiguous: Sana's `to_out` reads the
    linear attention's transposed output), checked at first sight per geometry; else
    `linear(x)` itself. x: [B, N, K], the weight's dtype and device. Returns a Folded
    or a tensor; `value()` of the Folded is the layer's output, bit for bit."""
    if _plain() or type(linear) is not torch.nn.Linear or not _plain_module(linear) or torch.is_grad_enabled():
        return linear(x)
    p = linear._parameters
    w, b = p["weight"], p["bias"]
    if b is None or x.__class__ is not torch.Tensor or x.dim() != 3 or x.is_contiguous() \
            or w.__class__ not in _PLAIN_TENSORS or b.__class__ not in _PLAIN_TENSORS \
            or common_device_dtype(x, w, b):
        return torch.nn.functional.linear(x, w, b)
    sig = ("3-D x, not contiguous", x.dtype, x.get_device(), tuple(x.shape), x.stride(), tuple(w.shape), w.stride(),
           b.stride())
    if not policy.fact("linear_bias_split", sig,
                       lambda: _split_holds(torch.nn.functional.linear(x, w, b), b, torch.matmul(x, w.t()))):
        return torch.nn.functional.linear(x, w, b)
    return Folded(b, torch.matmul(x, w.t()))


# ---------------------------------------------------------------- linear attention (Sana)


def linear_attention_site(query, key, value, heads: int, dtype: torch.dtype):
    """Sana's linear attention from the projections (after their norms) to `to_out`'s
    input, as `SanaLinearAttnProcessor2_0` computes it (relu feature maps, fp32, the
    padded value's row of ones, two matmuls, the guarded division, the cast to
    `dtype`, its `original_dtype`), bit-exact in every tier: the matmuls as eager runs
    them, the elementwise work around them in two kernels (`ops.linear_attention`),
    verified at first sight against the stock lines. query, key, value: [B, N, C];
    heads dividing C. Returns [B, N, C] in `dtype` with eager's strides."""
    if _plain() or query.dtype != dtype:
        return linear_attention.linear_attention_reference(query, key, value, heads, dtype)
    args = (query, key, value, heads)
    site_key = _call_key("linear_attention", _meta(query), _meta(key), _meta(value), heads)
    out = _bound(site_key, args)
    if out is not None:
        return out
    plan = linear_attention.plan_linear_attention(*args)
    if plan.__class__ is str:
        return linear_attention.linear_attention_reference(*args)
    return policy.gated(_LINEAR_ATTENTION, "lossless", plan, args, site_key=site_key)


# ---------------------------------------------------------------- projections
#
# Routed by models.sana (the attentions' q, k, v and the caption's k, v); the model
# integration packs the weights when it installs (`pack_linears`).


def _linear_params(linears):
    """(weights, biases) of `linears` when each is an `nn.Linear` (the class itself) whose
    call is its forward (`_plain_module`), else None."""
    weights, biases = [], []
    for m in linears:
        if type(m) is not torch.nn.Linear or not _plain_module(m):
            return None
        p = m._parameters
        weight, bias = p["weight"], p["bias"]
        if not isinstance(weight, torch.Tensor) or not (bias is None or isinstance(bias, torch.Tensor)):
            return None
        weights.append(weight)
        biases.append(bias)
    return tuple(weights), tuple(biases)


def _parts(params):
    """Each parameter's shape, strides and dtype (None as None), and the first one's
    pointer alignment: what the projections' guard reads of them beyond the pointers
    its bound launch checks on every call."""
    first = params[0]
    if first is None:
        return ("-",) * len(params) if all(p is None for p in params) else (None,)
    return (first.data_ptr() % 256, *((p.shape, p.stride(), p.dtype) if p is not None else None for p in params))


def linear_projections_site(x, *linears, call=None):
    """`tuple(linear(x) for linear in linears)` for `nn.Linear` modules reading the same
    x (an attention's q, k, v), bit-exact in every tier: one GEMM where their weights
    lie packed (`pack_linears`), verified here at first sight against the separate
    calls (`ops.projections`). x: [..., K]; each linear K -> N_i. Returns [..., N_i]
    each: views of one [..., R] output (R: the rows the packed parts span), or the
    separate results (each `call(linear, x)`: default the module call)."""
    if not _plain() and not torch._C._get_tracing_state():
        params = _linear_params(linears)
        if params is not None:
            weights, biases = params
            args = (x, weights, biases)
            site_key = _call_key("projections", _meta(x), x.data_ptr() % 256, weights[0].get_device(),
                                 *_parts(weights), *_parts(biases),
                                 gemm_settings(x.dtype)) if isinstance(x, torch.Tensor) else None
            out = _bound(site_key, args)
            if out is not None:
                return out
            plan = projections.plan_projections(*args)
            if plan.__class__ is not str:
                return policy.gated(_PROJECTIONS, "lossless", plan, args, site_key=site_key)
    return tuple(m(x) for m in linears) if call is None else tuple(call(m, x) for m in linears)


def pack_linears(*linears) -> bool:
    """Pack the weights of `linears` (`nn.Linear`, one dtype, device and K) into one
    buffer and their biases into another (`ops.projections.pack`: the same Parameters
    and values, each one's alignment kept), so that `linear_projections_site` makes one
    GEMM of them. True if packed. Undo with `unpack_linears`."""
    if len(linears) < 2 or any(type(m) is not torch.nn.Linear for m in linears):
        return False
    return projections.pack([m.weight for m in linears], [m.bias for m in linears])


def linears_packed(*linears) -> bool:
    """Whether the weights (and biases) of `linears` lie packed, so that
    `linear_projections_site` can make one GEMM of them (its gate aside)."""
    params = _linear_params(linears)
    if params is None or len(linears) < 2:
        return False
    weights, biases = params
    where = projections.layout(weights)
    if where is None:
        return False
    return biases[0] is None and all(b is None for b in biases) or \
        all(b is not None for b in biases) and projections.layout(biases) == where


def unpack_linears(*linears) -> None:
    """Give each weight and bias of `linears` its own storage again where they lie packed."""
    projections.unpack([m.weight for m in linears], [m.bias for m in linears])


__all__ = [
    "Folded",
    "folded_with_meta",
    "tensor_meta",
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
    "gated_residual_f32_site",
    "layer_norm_modulate_f32_site",
    "layer_norm_f32_site",
    "fp32_layer_norm_kind",
    "rotary_site",
    "qk_norm_rope_site",
    "joint_qk_norm_rope_site",
    "qk_norm_kind",
    "norm_kind",
    "unhooked",
    "conv_bias_silu_site",
    "conv_bias_glu_site",
    "linear_attention_site",
    "linear_bias_split",
    "linear_projections_site",
    "pack_linears",
    "linears_packed",
    "unpack_linears",
]
