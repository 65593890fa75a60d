"""Operands for checking and timing ops: one vocabulary for `bitfuse verify`,
the benchmarks, the fuzz run and the tests.

A `Case` names a shape, a dtype, a parameter layout and a data draw; each op's
`OpSpec.make_args(case)` turns it into the op's arguments. Data draws:

    randn     N(0, 1), times 2 for x
    outlier   randn with a few channels 64x larger (the outlier channels of
              real activations)
    zeros     randn with about a third of the elements exact zeros, of both signs
    subnormal randn with about a third of the elements subnormal for the dtype
    special   randn with NaN, +inf and -inf sprinkled in
    large     randn scaled near the dtype's largest values / 64
    tiny      randn scaled by 2**-10 (norms of nearly constant rows)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._params import Folded

DATA = ("randn", "outlier", "zeros", "subnormal", "special", "large", "tiny")

# parameter layouts: how diffusers hands adaLN parameters to a site
#   per-sample     [B, 1, D] dense
#   per-token      [B, S, D] dense
#   shared         [D]
#   unbind         [B, S, D] views of a [B, S, n, D] tensor (LTX-2's get_mod_params, per-token)
#   unbind-sample  [B, 1, D] views of a [B, 1, n, D] tensor (the same, per-sample)
#   chunk          [B, 1, D] views `emb.chunk(n, dim=1)[i][:, None]` of a [B, n*D] tensor (FLUX, SD3)
#   folded         Folded([D] table row, [B, 1, D] view of temb) (LTX-2, unmaterialised)
#   folded-token   Folded([D] table row, [B, S, D] view of temb)
PARAM_LAYOUTS = ("per-sample", "per-token", "shared", "unbind", "unbind-sample", "chunk", "folded", "folded-token")


@dataclass(frozen=True)
class Case:
    """One set of operands to build: x is [B, S, D] (`strided`: a view whose rows
    are `D + 64` apart) and parameters follow `layout`; values follow `data`."""

    B: int
    S: int
    D: int
    dtype: torch.dtype = torch.bfloat16
    layout: str = "per-sample"
    data: str = "randn"
    seed: int = 0
    device: str = "cuda"
    strided: bool = False

    def generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed)


def draw(shape, dtype, data: str, gen: torch.Generator, device, scale: float = 1.0) -> torch.Tensor:
    """A tensor of `shape` and `dtype` drawn as `data` says (see the module docstring)."""
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale
    return spoil(x, data, gen, dtype).to(dtype)


def spoil(x: torch.Tensor, data: str, gen: torch.Generator, dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp32 `x` with the pattern of `data` applied (outlier channels, signed zeros,
    subnormals of `dtype`, NaN/inf, a large or tiny scale); "randn" leaves it."""
    if data not in DATA:
        raise ValueError(f"unknown data draw {data!r}; choose one of {', '.join(DATA)}")
    dtype = dtype or x.dtype
    shape, device = x.shape, x.device
    if data == "outlier" and len(shape):
        n = shape[-1]
        cols = torch.randint(0, n, (max(1, n // 256),), generator=gen, device=device)
        x = x.clone()
        x[..., cols] *= 64
    elif data == "zeros":
        x = torch.where(torch.rand(shape, generator=gen, device=device) < 0.35, x * 0.0, x)  # keeps x's sign
    elif data == "subnormal":
        sub = x * (torch.finfo(dtype).tiny / 8)  # below the smallest normal of `dtype`
        x = torch.where(torch.rand(shape, generator=gen, device=device) < 0.35, sub, x)
    elif data == "special":
        u = torch.rand(shape, generator=gen, device=device)
        x = torch.where(u < 0.01, math.nan, x)
        x = torch.where((u >= 0.01) & (u < 0.015), math.inf, x)
        x = torch.where((u >= 0.015) & (u < 0.02), -math.inf, x)
    elif data == "large":
        x = x * (torch.finfo(dtype).max / 256)
    elif data == "tiny":
        x = x * 2.0**-10
    return x


def param(case: Case, gen: torch.Generator, n: int = 3, scale: float = 1.0) -> tuple:
    """`n` parameters (scale, shift, gate, ...) of x's width in `case.layout`."""
    B, S, D, dtype, device = case.B, case.S, case.D, case.dtype, case.device
    layout, data = case.layout, case.data

    def d(shape):
        return draw(shape, dtype, data, gen, device, scale)

    if layout == "per-sample":
        return tuple(d((B, 1, D)) for _ in range(n))
    if layout == "per-token":
        return tuple(d((B, S, D)) for _ in range(n))
    if layout == "shared":
        return tuple(d((D,)) for _ in range(n))
    if layout == "unbind":
        return d((B, S, n + 3, D)).unbind(2)[:n]
    if layout == "unbind-sample":
        return d((B, 1, n + 3, D)).unbind(2)[:n]
    if layout == "chunk":
        return tuple(c[:, None] for c in d((B, (n + 3) * D)).chunk(n + 3, dim=1)[:n])
    if layout == "folded":
        table, temb = d((n, D)), d((B, 1, n, D))
        return tuple(Folded(table[i], temb[:, :, i]) for i in range(n))
    if layout == "folded-token":
        table, temb = d((n, D)), d((B, S, n, D))
        return tuple(Folded(table[i], temb[:, :, i]) for i in range(n))
    raise ValueError(f"unknown parameter layout {layout!r}; choose one of {', '.join(PARAM_LAYOUTS)}")


# fp32 parameter layouts (Wan: parameters `scale_shift_table + temb.float()`, fp32, x bf16)
#   wan-sample     [B, 1, D] fp32 views `(table + temb.float()).chunk(6, dim=1)[i]` (Wan 2.1, 2.2 A14B)
#   wan-token      [B, S, D] fp32 views of the [B, S, 6, D] sum, chunked on dim 2 and squeezed (Wan 2.2 TI2V)
#   per-sample     [B, 1, D] fp32 dense
#   folded         Folded(fp32 [D] table row, [B, 1, D] view of temb in x's dtype): summed in fp32
#   folded-token   Folded(fp32 [D] table row, [B, S, D] view of temb in x's dtype)
F32_PARAM_LAYOUTS = ("wan-sample", "wan-token", "per-sample", "folded", "folded-token")


def param_f32(case: Case, gen: torch.Generator, n: int = 3, scale: float = 1.0) -> tuple:
    """`n` fp32 parameters of x's width in `case.layout` (F32_PARAM_LAYOUTS): what the
    fp32-compute ops take; temb in x's dtype."""
    B, S, D, dtype, device = case.B, case.S, case.D, case.dtype, case.device
    layout, data = case.layout, case.data

    def d(shape, dt=torch.float32):
        return draw(shape, dt, data, gen, device, scale)

    if layout == "wan-sample":
        return (d((1, 6, D)) + d((B, 6, D), dtype).float()).chunk(6, dim=1)[:n]
    if layout == "wan-token":
        return tuple(c.squeeze(2) for c in (d((1, 1, 6, D)) + d((B, S, 6, D), dtype).float()).chunk(6, dim=2)[:n])
    if layout == "per-sample":
        return tuple(d((B, 1, D)) for _ in range(n))
    if layout in ("folded", "folded-token"):
        table, temb = d((6, D)), d((B, S if layout == "folded-token" else 1, 6, D), dtype)
        return tuple(Folded(table[i], temb[:, :, i]) for i in range(n))
    raise ValueError(f"unknown fp32 parameter layout {layout!r}; choose one of {', '.join(F32_PARAM_LAYOUTS)}")


def activation(case: Case, gen: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    """x of `case`: [B, S, D], dense or (`case.strided`) a view with padded rows."""
    B, S, D = case.B, case.S, case.D
    if case.strided:
        return draw((B, S, D + 64), case.dtype, case.data, gen, case.device, scale)[..., :D]
    return draw((B, S, D), case.dtype, case.data, gen, case.device, scale)
