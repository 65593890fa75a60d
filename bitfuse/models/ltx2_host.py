"""LTX-2 host-time caches and compact RoPE tables: the same bits as diffusers computes.

At full width a forward is launched faster than the GPU runs it only if the host
work between launches stays small; two pieces of the LTX-2 forward are pure
functions of small inputs and are shared or kept here:

- `TimestepEmbeddings`: the forward embeds the same timestep values with up to six
  `LTX2AdaLayerNormSingle` modules; each starts with the same parameter-free
  sinusoidal projection. Computed once per distinct input, within one forward.
- `RopeCache`: the RoPE cos/sin tables of coordinates the forward builds itself
  from integers, kept between forwards while those integers hold.
- `paired`: LTX-2.0's interleaved tables store every value twice; their compact
  halves, made once a forward, let the q/k kernel read half the table bytes.

All three rely on diffusers functions pinned by `ltx2.VERIFIED_SOURCES` (their results
depend on their arguments and settings only), and step aside (compute as diffusers
does) while compiling, while capturing a CUDA graph, and for modules with hooks or
instance forwards.
"""

from __future__ import annotations

import torch
import torch.nn.modules.module as _module_hooks
from diffusers.models.embeddings import (
    PixArtAlphaCombinedTimestepSizeEmbeddings,
    Timesteps,
)
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2AdaLayerNormSingle,
    LTX2AudioVideoRotaryPosEmbed,
)

from .. import policy
from ._install import version_of

__all__ = ["TimestepEmbeddings", "RopeCache", "PairedTables", "paired"]


class TimestepEmbeddings:
    """`embed(m, t, batch_size=, hidden_dtype=)` is `m(t, ...)` for diffusers'
    `LTX2AdaLayerNormSingle` modules, within one forward.

    The forward embeds the same timestep values with up to six of these modules
    (video, audio, both cross-attention scale/shift; the two gates embed the same
    product twice), and each starts with the same parameter-free sinusoidal
    projection (`Timesteps`: about ten small ops, run by the host while the GPU
    waits). Here a projection, and the gates' product, are computed once per
    distinct input: the same tensor (storage, offset, shape, strides, version;
    held, so its memory is not reused within the forward) and the same settings,
    so the same ops on the same values. Modules of other classes, with hooks or
    instance forwards, run as they are; so does everything while compiling."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and not (_module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks)
        self.memo: dict = {}

    @staticmethod
    def _id(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, version_of(t))

    def product(self, t, factor):
        """`t * factor`."""
        if not self.enabled:
            return t * factor
        key = ("product", self._id(t), type(factor), factor)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = (t, t * factor)
        return hit[1]

    def __call__(self, module, timestep, *, batch_size=None, hidden_dtype=None):
        emb = getattr(module, "emb", None)
        proj = getattr(emb, "time_proj", None)
        if not (self.enabled and _plain_module(module, LTX2AdaLayerNormSingle)
                and _plain_module(emb, PixArtAlphaCombinedTimestepSizeEmbeddings)
                and not emb.use_additional_conditions and _plain_module(proj, Timesteps)):
            return module(timestep, batch_size=batch_size, hidden_dtype=hidden_dtype)
        key = ("proj", self._id(timestep), proj.num_channels, proj.flip_sin_to_cos, proj.downscale_freq_shift,
               proj.scale)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = (timestep, proj(timestep))
        # diffusers: LTX2AdaLayerNormSingle.forward -> PixArtAlphaCombinedTimestepSizeEmbeddings.forward
        embedded_timestep = emb.timestep_embedder(hit[1].to(dtype=hidden_dtype))
        return module.linear(module.silu(embedded_timestep)), embedded_timestep


def _plain_module(module, cls) -> bool:
    """`module` is a `cls` whose call is just `cls.forward`: no hooks, no instance forward."""
    return (type(module) is cls and "forward" not in module.__dict__ and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks))


class RopeCache:
    """The RoPE frequencies of the last coordinates the forward built itself, per modality.

    When the caller passes no `video_coords` / `audio_coords`, the forward builds
    them from integers (batch size, frames, height, width, fps) and turns them into
    cos/sin tables with some forty small ops, which run on the host while the GPU
    waits: 2.3 ms of a 32 ms forward at full width on the H200 (bench/timeline.py).
    Those tables are a pure function of the integers, the device and the RoPE
    modules' settings (diffusers' code, sha-checked), so the last tables per
    modality are kept and returned while that key holds: the same tensors the
    computation gives, bit for bit. Coordinates passed by the caller (the
    pipelines pass them) are not cached: their values could change unseen.

    Not used (computed as diffusers does) while compiling, while capturing a CUDA
    graph, when a RoPE module has hooks or another forward, or after anything
    wrote to the kept tables in place (their version counters). Memory: the kept
    tables (video cos + sin: 2 x S x D fp32, 200 MB at 6144 x 4096) stay
    allocated between forwards; `clear()` or `handle.restore()` frees them."""

    def __init__(self):
        self.entries: dict = {}  # modality -> (key, value, versions)

    def get(self, modality: str, args: tuple, modules: tuple, compute):
        if torch.compiler.is_compiling() or policy.capturing():
            return compute()
        settings = []
        for m in modules:
            if type(m).forward is not LTX2AudioVideoRotaryPosEmbed.forward or "forward" in m.__dict__ or (
                m._forward_hooks or m._forward_pre_hooks
            ):
                return compute()
            settings.append(_settings_of(m))
        device = args[-1]
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        key = (args, tuple(settings), stream, torch.get_default_dtype(), torch.is_grad_enabled(),
               torch.is_inference_mode_enabled())
        try:
            hash(key)
        except TypeError:  # a setting that can't be keyed: no caching
            return compute()
        entry = self.entries.get(modality)
        if entry is not None and entry[0] == key and _versions(entry[1]) == entry[2]:
            return entry[1]
        value = compute()
        if not any(t.is_inference() for pair in value for t in pair):  # (inference tensors: no versions, not kept)
            self.entries[modality] = (key, value, _versions(value))
        return value

    def clear(self) -> None:
        self.entries.clear()


def _settings_of(module) -> tuple:
    return (type(module),) + tuple(
        (k, v) for k, v in vars(module).items()
        if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, type(None)))
    )


def _versions(value) -> tuple:
    return tuple(t._version for pair in value for t in pair)


class PairedTables(tuple):
    """(cos, sin) as `LTX2AudioVideoRotaryPosEmbed` returns them for rope_type
    "interleaved" (fp32 [B, S, C]), with `pairs`: (cos[..., ::2], sin[..., ::2]) made
    contiguous, [B, S, C / 2]. Code reading the tuple sees the stock tables;
    `sites.qk_norm_rope_site` reads `pairs` in its kernel (the op's rope_type "pairs")."""

    pairs: tuple


def paired(module, tables):
    """`tables` with their compact halves (`PairedTables`) where `module` is a plain
    `LTX2AudioVideoRotaryPosEmbed` (no hooks, no instance forward) of rope_type
    "interleaved", outside compile and with the sites enabled (not BITFUSE_DISABLE);
    else `tables` as they are.

    Why the halves hold every value: the stock forward (source pinned by
    `ltx2.VERIFIED_SOURCES`) builds `freqs.cos().repeat_interleave(2, dim=-1)` (and the
    sine likewise), then prepends `dim % (2 * pos dims)` columns of ones (cos) and
    zeros (sin): an even count for an even dim, so columns 2i and 2i + 1 are copies.
    Cost: one strided read and a half-size write a table, once a forward (or once
    while `RopeCache` keeps the tables), and the halves' memory (LTX-2.0 at B = 2,
    6,144 video tokens: 0.28 GiB more peak memory, measured)."""
    if policy.DISABLED or policy.compiling() or not _plain_module(module, LTX2AudioVideoRotaryPosEmbed) \
            or module.rope_type != "interleaved":
        return tables
    cos, sin = tables
    if cos.dim() != 3 or cos.shape[-1] % 2 or sin.shape != cos.shape:
        return tables
    out = PairedTables(tables)
    out.pairs = (cos[..., ::2].contiguous(), sin[..., ::2].contiguous())
    return out
