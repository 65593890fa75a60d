"""diffusers' shared adaLN modules (`models/normalization.py`) routed through bitfuse,
for any diffusers transformer built from them, and as the building block of the
FLUX integrations.

Each module below computes a weightless norm followed by `* (1 + scale) + shift`;
its forward is copied line for line from diffusers 0.42.1 with that expression
replaced by the norm + modulate site (tests/test_copies.py checks the copies):

    AdaLayerNormZero        norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    AdaLayerNormZeroSingle  the same, three parameters
    AdaLayerNormContinuous  norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
                            (LayerNorm or diffusers' RMSNorm; `(1 + scale)[:, None, :]`
                            rounds element for element as `1 + scale[:, None, :]`)
    SD35AdaLayerNormZeroX   one norm, modulated twice: two fused kernels, each reading x
                            (the normed tensor is never written; the same bits)

    -> sites.layer_norm_modulate_site / sites.rms_norm_modulate_site(module, norm, x, scale, shift)

The parameters reach the kernels as diffusers' `chunk` views ([B, 1, D], strided),
read in place. Every module is a site of its own (named by its path in the model):
the tier in force is looked up on it. A module whose norm has no fused kernel (an
affine LayerNorm, FP32LayerNorm, ...) runs the same copy; there the site calls the
norm module as is and then the exact modulate kernel (stock bits), and the module's
site refuses the "high" tier, for the whole model (all or nothing).

`accelerate(model)` is the generic integration: `bitfuse.accelerate` takes it for a
diffusers model without an integration of its own (the registry matches classes
along the MRO, so a model's own class comes before `ModelMixin`). It routes these
modules only; blocks that write their modulation inline (SD3's `norm2`, PixArt's
blocks) keep diffusers' code. A model with no module whose norm the kernels
reproduce is refused (UnsupportedModelError).
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    RMSNorm,
    SD35AdaLayerNormZeroX,
)

from .. import sites as _sites
from . import _install

__all__ = [
    "VERIFIED_SOURCES",
    "COPIES",
    "FORWARDS",
    "SOURCES",
    "AdaLNHandle",
    "accelerate",
    "adaln_sites",
    "stock_functions",
]

#: sha256 of `inspect.getsource` of each diffusers function copied here, as shipped in 0.42.1
VERIFIED_SOURCES = {
    "AdaLayerNormZero.forward": "93374820c014f8127713d1ba0a6be6bba27e7040238781fd56e42e87bb5366cb",
    "AdaLayerNormZeroSingle.forward": "d48dfb2b1e75e64f48dbe314db50f716acbd81946ad08387b858d08f47bba077",
    "AdaLayerNormContinuous.forward": "da3e50ebcd024fc2040e7e4afc211c8717142198b743486e507c0770fa4b2909",
    "SD35AdaLayerNormZeroX.forward": "447682c6b939c97a4fa005a9bd0fcb9f83c06e19532778a16403d600d0cce0e0",
}


def stock_functions() -> dict:
    """The installed diffusers function behind each name of VERIFIED_SOURCES."""
    return {
        "AdaLayerNormZero.forward": AdaLayerNormZero.forward,
        "AdaLayerNormZeroSingle.forward": AdaLayerNormZeroSingle.forward,
        "AdaLayerNormContinuous.forward": AdaLayerNormContinuous.forward,
        "SD35AdaLayerNormZeroX.forward": SD35AdaLayerNormZeroX.forward,
    }


# ---------------------------------------------------------------- the copies


def _norm_modulate(module, norm, x, scale, shift):
    """`norm(x) * (1 + scale) + shift` through the site of `norm`'s family."""
    if isinstance(norm, (RMSNorm, torch.nn.RMSNorm)):
        return _sites.rms_norm_modulate_site(module, norm, x, scale, shift)
    return _sites.layer_norm_modulate_site(module, norm, x, scale, shift)


def _zero_forward(
    self,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    class_labels: torch.LongTensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1 `AdaLayerNormZero.forward`, the modulation through bitfuse."""
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    # diffusers: x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    x = _norm_modulate(self, self.norm, x, scale_msa[:, None], shift_msa[:, None])
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _zero_single_forward(
    self,
    x: torch.Tensor,
    emb: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1 `AdaLayerNormZeroSingle.forward`, the modulation through bitfuse."""
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    # diffusers: x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    x = _norm_modulate(self, self.norm, x, scale_msa[:, None], shift_msa[:, None])
    return x, gate_msa


def _continuous_forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 `AdaLayerNormContinuous.forward`, the modulation through bitfuse."""
    # convert back to the original dtype in case `conditioning_embedding`` is upcasted to float32 (needed for hunyuanDiT)
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    # diffusers: x = self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]
    # bitfuse: `1 + scale` rounds element for element the same before or after the [:, None, :] view
    x = _norm_modulate(self, self.norm, x, scale[:, None, :], shift[:, None, :])
    return x


def _sd35_zero_x_forward(
    self,
    hidden_states: torch.Tensor,
    emb: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """diffusers 0.42.1 `SD35AdaLayerNormZeroX.forward`, both modulations through bitfuse."""
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = emb.chunk(
        9, dim=1
    )
    # diffusers: norm_hidden_states = self.norm(hidden_states)
    # diffusers: hidden_states = norm_hidden_states * (1 + scale_msa[:, None]) + shift_msa[:, None]
    # diffusers: norm_hidden_states2 = norm_hidden_states * (1 + scale_msa2[:, None]) + shift_msa2[:, None]
    # bitfuse: each fused kernel normalises x itself (the norm is deterministic: the same bits twice)
    norm_hidden_states2 = _norm_modulate(self, self.norm, hidden_states, scale_msa2[:, None], shift_msa2[:, None])
    hidden_states = _norm_modulate(self, self.norm, hidden_states, scale_msa[:, None], shift_msa[:, None])
    return hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2


#: stock class -> our copy of its forward (the FLUX integrations install these too)
FORWARDS = {
    AdaLayerNormZero: _zero_forward,
    AdaLayerNormZeroSingle: _zero_single_forward,
    AdaLayerNormContinuous: _continuous_forward,
    SD35AdaLayerNormZeroX: _sd35_zero_x_forward,
}

#: our line-for-line copies, by the stock name they copy (tests/test_copies.py diffs them)
COPIES = {f"{cls.__name__}.forward": fn for cls, fn in FORWARDS.items()}

SOURCES = _install.CopiedSources(
    "adaLN", release="0.42", copied_from="0.42.1", sha256=VERIFIED_SOURCES, stock=stock_functions,
    copies=lambda: COPIES,
)


# ---------------------------------------------------------------- sites and the handle


def adaln_sites(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, tuple]]:
    """(path, module, (its norm,)) for every module of `model` that runs one of
    FORWARDS' stock forwards as is (a subclass overriding it keeps its own)."""
    stock = {cls.forward for cls in FORWARDS}
    return [(name, m, (m.norm,)) for name, m in model.named_modules() if type(m).forward in stock]


class AdaLNHandle(_install.Handle):
    """What `accelerate` installed (see `_install.Handle`); `routed` says where.

    Sites are named by their module's path in the model (`model.get_submodule(name)`)."""

    @property
    def routed(self) -> dict[str, int]:
        """Class name of each marked module -> how many (empty once restored)."""
        counts: dict[str, int] = {}
        for site in self.sites:
            name = type(self.model.get_submodule(site.name)).__name__
            counts[name] = counts.get(name, 0) + 1
        return counts

    def __repr__(self) -> str:
        routed = ", ".join(f"{name} x{n}" for name, n in self.routed.items()) or "nothing"
        return f"{super().__repr__()[:-1]}, routed: {routed}>"


def _recognised_sites(model):
    marks = adaln_sites(model)
    if not any(_sites.norm_kind(norm) is not None for _, _, norms in marks for norm in norms):
        found = ", ".join(f"{name} ({type(m).__name__} with {type(m.norm).__name__})" for name, m, _ in marks)
        raise _install.UnsupportedModelError(
            f"bitfuse has no support for {type(model).__name__}: it has no adaLN module whose norm bitfuse "
            f"reproduces ({', '.join(c.__name__ for c in FORWARDS)} with a weightless LayerNorm or RMSNorm); "
            f"found: {found or 'none'}"
        )
    return marks


def accelerate(model, *, quality: str = "lossless", force: bool = False) -> AdaLNHandle:
    """Route the shared adaLN modules of a diffusers model (`FORWARDS`) through bitfuse;
    mark each as a site and mount `quality` (all or nothing). Returns the handle;
    called again with the same quality, the existing one. Raises UnsupportedModelError
    for a model with no such module whose norm the kernels reproduce; see
    `_install.accelerate` for the other errors."""
    return _install.accelerate(
        model,
        AdaLNHandle,
        quality=quality,
        force=force,
        sources=SOURCES,
        model_class=ModelMixin,
        forwards=FORWARDS,
        sites=_recognised_sites,
    )
