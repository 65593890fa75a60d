"""LTX-2 / LTX-2.3 context parallelism through diffusers' own engine, with a correct plan.

diffusers 0.42 shards a model's sequences across GPUs with
`model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N | ring_degree=N))`:
hooks (diffusers.hooks.context_parallel) split the tensors a `_cp_plan` names and
gather the outputs, and every attention call with a parallel config runs as
Ulysses (all-to-all over heads) or ring attention (attention_dispatch.py). The
`_cp_plan` diffusers 0.42.1 ships for LTX-2 is LTX-1's (transformer_ltx2.py:1125;
diffusers issue #14316, PR #14317 open): it crashes on per-token timesteps, and
it never shards the audio stream, the text of the audio cross-attention, or three
of the four RoPE modules, so every audio, a2v and v2a attention would be wrong.

    from diffusers.models._modeling_parallel import ContextParallelConfig
    from bitfuse.models import ltx2_parallel

    ltx2_parallel.enable_context_parallel(transformer, ContextParallelConfig(ulysses_degree=2))
    bitfuse.accelerate(transformer)     # before or after: the order does not matter

`enable_context_parallel` passes `context_parallel_plan(model)` to diffusers'
`enable_parallelism` (nothing of diffusers is patched, no collective is written
here) and puts one more diffusers `ModelHook` in front of the split hook,
`CallCheck`, which checks each call and raises a clear error where diffusers
would crash or be silently wrong (see `check_call`). Every token-wise tensor is
split along its sequence: the video and audio latents, both text streams (every
attention's K/V must be sharded: Ulysses and ring gather them), per-token
timesteps, the keyframe marker, the cos/sin tables of all four RoPE modules
(split after computing them from the full coordinates), and both outputs are
gathered. adaLN, gates and RoPE are row-local, so bitfuse's sites see the same
rows either way: accelerated + CP equals stock + the same CP bit for bit.

What CP changes against one GPU (the same model, unsharded): the GEMMs run with
1/N of the rows (cuBLAS may pick another algorithm for another M), Ulysses runs
attention on H/N heads, and ring attention merges N partial softmaxes in fp32.
Attention masks: only masks that mask nothing (the LTX-2 pipelines' connector
mask is all ones) are accepted, and dropped (see `check_call`): diffusers 0.42.1
cannot shard a real one for LTX-2.
"""

from __future__ import annotations

import weakref

import torch
from diffusers.hooks.hooks import HookRegistry, ModelHook
from diffusers.models._modeling_parallel import (
    ContextParallelConfig,
    ContextParallelInput,
    ContextParallelOutput,
    ParallelConfig,
)
from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel

from ._install import UnsupportedModelError, version_of

__all__ = [
    "CHECK_HOOK",
    "CallCheck",
    "ContextParallelError",
    "attention_heads",
    "check_call",
    "check_sizes",
    "context_parallel_plan",
    "enable_context_parallel",
    "shard_count",
]

#: the name of bitfuse's call check in the model's diffusers HookRegistry
CHECK_HOOK = "bitfuse_cp_check"

# where diffusers 0.42.1 cannot shard an LTX-2 attention mask (cited in the errors)
_MASK_LIMITS = (
    "diffusers 0.42.1 cannot shard a real attention mask for LTX-2: the LTX-2 processor expands the mask to "
    "[B, heads, 1, S_kv] (transformer_ltx2.py, LTX2AudioVideoAttnProcessor.__call__), Ulysses all-gathers it on "
    "the key axis but keeps all heads while q/k/v carry heads/N (attention_dispatch.py:2573, "
    "TemplatedUlyssesAttention: a shape error), ring attention applies the local mask to every rotated K/V chunk "
    "(attention_dispatch.py:2415-2443, TemplatedRingAttention: silently wrong) and ring-anything refuses masks "
    "(attention_dispatch.py:2658); fixed upstream by diffusers PR #14317"
)


class ContextParallelError(ValueError):
    """A call or a configuration that diffusers' context parallelism cannot run correctly for LTX-2."""


# ---------------------------------------------------------------- the plan


def _rope_split(model) -> ContextParallelInput:
    """How a RoPE table splits: interleaved cos/sin are [B, S, D]; split ones are
    [B, H, S, D/2H] (LTX2AudioVideoRotaryPosEmbed.forward swaps the head axis in)."""
    if model.config.rope_type == "split":
        return ContextParallelInput(split_dim=2, expected_dims=4, split_output=True)
    return ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)


def context_parallel_plan(model: LTX2VideoTransformer3DModel) -> dict:
    """The context-parallel plan of an `LTX2VideoTransformer3DModel` (LTX-2.0 and 2.3), in
    diffusers' `_cp_plan` format, for `model.enable_parallelism(config=..., cp_plan=...)`.

    Split at the model's input, on the sequence axis (dim 1): `hidden_states`
    [B, S_video, C], `audio_hidden_states` [B, S_audio, C], `encoder_hidden_states`
    and `audio_encoder_hidden_states` [B, S_text, C] (the K/V of the text
    cross-attentions), per-token `timestep` [B, S_video] and `audio_timestep`
    [B, S_audio] (a per-sample [B] timestep is left whole: diffusers skips a tensor
    of another rank, with a one-time log line), `video_keyframes_mask` [B, S_video, 1].
    Split at the output of each RoPE module (`rope`, `audio_rope`, `cross_attn_rope`,
    `cross_attn_audio_rope`): cos and sin, on the sequence axis of the model's
    `rope_type`. Gathered: `proj_out` [B, S_video, C] and `audio_proj_out` [B, S_audio, C].
    Masks are not in the plan: `CallCheck` drops the ones that mask nothing and
    refuses the others. The RoPE coordinates stay whole (the tables are split)."""
    if not isinstance(model, LTX2VideoTransformer3DModel):
        raise UnsupportedModelError(f"expected diffusers' LTX2VideoTransformer3DModel, got {type(model).__name__}")

    def seq(dims: int) -> ContextParallelInput:
        return ContextParallelInput(split_dim=1, expected_dims=dims, split_output=False)

    rope = _rope_split(model)
    return {
        "": {
            "hidden_states": seq(3),
            "audio_hidden_states": seq(3),
            "encoder_hidden_states": seq(3),
            "audio_encoder_hidden_states": seq(3),
            "timestep": seq(2),
            "audio_timestep": seq(2),
            "video_keyframes_mask": seq(3),
        },
        "rope": {0: rope, 1: rope},
        "audio_rope": {0: rope, 1: rope},
        "cross_attn_rope": {0: rope, 1: rope},
        "cross_attn_audio_rope": {0: rope, 1: rope},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        "audio_proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


# ---------------------------------------------------------------- sizes


def _cp(config) -> ContextParallelConfig:
    return config.context_parallel_config if isinstance(config, ParallelConfig) else config


def shard_count(config: ContextParallelConfig | ParallelConfig) -> int:
    """How many pieces each sequence is split into: ring_degree x ulysses_degree."""
    cp = _cp(config)
    return (cp.ring_degree or 1) * (cp.ulysses_degree or 1)


def attention_heads(model_config) -> dict:
    """{attention: heads} of an LTX-2 model config (a diffusers config or a dict):
    the video self and text attentions use the video heads; audio self, audio text,
    a2v and v2a use the audio heads (transformer_ltx2.py, LTX2VideoTransformerBlock)."""
    get = model_config.get if isinstance(model_config, dict) else lambda k, d=None: getattr(model_config, k, d)
    video, audio = get("num_attention_heads", 32), get("audio_num_attention_heads", 32)
    return {"video self/text attention": video, "audio self/text, a2v and v2a attention": audio}


def check_sizes(model_config, config: ContextParallelConfig | ParallelConfig, *, video_tokens: int | None = None,
                audio_tokens: int | None = None, text_tokens: int | None = None,
                audio_text_tokens: int | None = None) -> None:
    """Raise ContextParallelError, naming the size and the fix, when `config` cannot
    split these sizes evenly: every sequence (tokens given, None: not checked) must
    divide by ring x ulysses degree, and every attention's head count by the Ulysses
    degree (its all-to-all trades sequence for heads). diffusers' `ulysses_anything` /
    `ring_anything` modes take uneven sizes (they still need at least one token a GPU)."""
    cp = _cp(config)
    n = shard_count(cp)
    anything = bool(cp.ulysses_anything or cp.ring_anything)
    problems = []
    sizes = {"video": video_tokens, "audio": audio_tokens, "text": text_tokens, "audio text": audio_text_tokens}
    for name, size in sizes.items():
        if size is None:
            continue
        if anything and size < n:
            problems.append(f"{size} {name} tokens cannot be split over {n} GPUs (fewer tokens than GPUs)")
        elif not anything and size % n:
            problems.append(f"{size} {name} tokens do not divide by {n} (ring x ulysses degree)")
    if (cp.ulysses_degree or 1) > 1 and not cp.ulysses_anything:
        for name, heads in attention_heads(model_config).items():
            if heads % cp.ulysses_degree:
                problems.append(f"the {name} has {heads} heads, which do not divide by the Ulysses degree "
                                f"{cp.ulysses_degree}")
    if problems:
        fix = "" if anything else (
            "; use sizes that divide, fewer GPUs, or diffusers' uneven modes (ContextParallelConfig("
            "ulysses_anything=True: any sizes and heads; ring_anything=True: any sizes; bitfuse run: --cp-anything)")
        raise ContextParallelError("context parallelism cannot split this LTX-2 call: " + "; ".join(problems) + fix)


# ---------------------------------------------------------------- the call check

_FORWARD_PARAMETERS = None


def _bind(args: tuple, kwargs: dict) -> dict:
    """The forward's arguments, every one by keyword (diffusers' split hook finds a
    planned parameter that was not passed only among the keywords: passed as None,
    it is skipped; not passed at all, it raises)."""
    global _FORWARD_PARAMETERS
    if _FORWARD_PARAMETERS is None:
        import inspect

        _FORWARD_PARAMETERS = inspect.signature(LTX2VideoTransformer3DModel.forward).parameters
    names = list(_FORWARD_PARAMETERS)[1:]
    if len(args) > len(names):
        raise TypeError(f"LTX2VideoTransformer3DModel.forward takes {len(names)} arguments, got {len(args)}")
    bound = {n: p.default for n, p in _FORWARD_PARAMETERS.items() if n != "self" and p.default is not p.empty}
    for name, value in zip(names, args):
        if name in kwargs:
            raise TypeError(f"LTX2VideoTransformer3DModel.forward got multiple values for argument {name!r}")
        bound[name] = value
    bound.update(kwargs)
    return bound


class _MaskVerdicts:
    """Whether a mask masks nothing, kept for the last tensors seen (the pipelines pass
    the same mask every step): one host sync per new mask, not per call."""

    def __init__(self):
        self.seen: list = []  # (weakref, version, verdict)

    def masks_nothing(self, mask: torch.Tensor, additive: bool) -> bool:
        for ref, version, add, verdict in self.seen:
            if ref() is mask and version == version_of(mask) and add == additive:
                return verdict
        verdict = bool((mask == 0).all()) if additive else bool((mask != 0).all())
        self.seen = [e for e in self.seen if e[0]() is not None][-3:] + [
            (weakref.ref(mask), version_of(mask), additive, verdict)]
        return verdict


def _per_sample(name: str, value, batch: int) -> None:
    if isinstance(value, torch.Tensor) and value.numel() != batch:
        raise ContextParallelError(
            f"{name} of shape {tuple(value.shape)} is not per sample ({batch} values): context parallelism "
            f"shards the token axes, and LTX-2 applies {name} to streams of different lengths")


def _timestep(name: str, value, batch: int, tokens: int):
    """A timestep as [B] (per sample) or [B, S] (per token): the forward reads it only
    through `.flatten()`, so this view changes no value; the plan then splits [B, S]."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() == batch:
        return value.reshape(batch)
    if value.numel() == batch * tokens:
        return value.reshape(batch, tokens)
    raise ContextParallelError(
        f"{name} of shape {tuple(value.shape)} is neither per sample ({batch}) nor per token ({batch} x {tokens})")


def check_call(model, config, kwargs: dict, masks: _MaskVerdicts | None = None) -> dict:
    """Check one forward call (its arguments by keyword) for context parallelism
    under `config`; return the arguments to run with. Raises ContextParallelError:

    - sizes that do not split (`check_sizes`: video, audio and both text lengths);
    - a `video_self_attention_mask` (a [B, S, S] mask would need its query rows
      split and its keys whole; the processor pads it to the local length instead);
    - an `encoder_attention_mask` / `audio_encoder_attention_mask` that masks some
      token (`_MASK_LIMITS`). One that masks nothing (2-D 0/1 all ones, as the
      LTX-2 pipelines pass their connector mask, or an additive bias of zeros) is
      dropped: the same attention, computed without the all-zero bias;
    - `sigma`, `audio_sigma` or a `perturbation_mask` that is not per sample;
    - timesteps neither per sample nor per token, a `video_keyframes_mask` not [B, S_video, 1].
    Timesteps are passed as [B] or [B, S] views of the same values (`_timestep`)."""
    kw = dict(kwargs)
    hidden, audio = kw.get("hidden_states"), kw.get("audio_hidden_states")
    if not isinstance(hidden, torch.Tensor) or not isinstance(audio, torch.Tensor):
        return kw  # the forward raises its own error
    batch, video_tokens, audio_tokens = hidden.size(0), hidden.size(1), audio.size(1)
    text, audio_text = kw.get("encoder_hidden_states"), kw.get("audio_encoder_hidden_states")
    check_sizes(model.config, config, video_tokens=video_tokens, audio_tokens=audio_tokens,
                text_tokens=text.size(1) if isinstance(text, torch.Tensor) else None,
                audio_text_tokens=audio_text.size(1) if isinstance(audio_text, torch.Tensor) else None)

    if kw.get("video_self_attention_mask") is not None:
        raise ContextParallelError(
            "video_self_attention_mask is not supported with context parallelism: a [B, S, S] mask needs its "
            "query rows split and its keys whole, which diffusers' plan format cannot express (the LTX-2 "
            "processor would pad it to the local sequence length)")
    masks = masks or _MaskVerdicts()
    for name in ("encoder_attention_mask", "audio_encoder_attention_mask"):
        mask = kw.get(name)
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor):
            raise ContextParallelError(f"{name} must be a tensor or None, got {type(mask).__name__}")
        if not masks.masks_nothing(mask, additive=mask.ndim != 2):
            raise ContextParallelError(
                f"{name} masks some tokens; {_MASK_LIMITS}. Pass no mask, or one that masks nothing")
        kw[name] = None  # masks nothing: the same attention without the all-zero bias

    for name in ("sigma", "audio_sigma"):
        _per_sample(name, kw.get(name), batch)
    mask = kw.get("perturbation_mask")
    if isinstance(mask, torch.Tensor):
        _per_sample("perturbation_mask", mask, batch)
    kw["timestep"] = _timestep("timestep", kw.get("timestep"), batch, video_tokens)
    kw["audio_timestep"] = _timestep("audio_timestep", kw.get("audio_timestep"), batch, audio_tokens)
    keyframes = kw.get("video_keyframes_mask")
    if isinstance(keyframes, torch.Tensor) and tuple(keyframes.shape) != (batch, video_tokens, 1):
        raise ContextParallelError(f"video_keyframes_mask of shape {tuple(keyframes.shape)}: expected "
                                   f"[{batch}, {video_tokens}, 1] (it marks video tokens)")
    return kw


class CallCheck(ModelHook):
    """A diffusers ModelHook run before the context-parallel split hook: the call by
    keyword, checked and normalised by `check_call`."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.masks = _MaskVerdicts()

    def pre_forward(self, module, *args, **kwargs):
        return (), check_call(module, self.config, _bind(args, kwargs), self.masks)


# ---------------------------------------------------------------- enable


def _backend(model):
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
    )

    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            name = processor._attention_backend
            return AttentionBackendName(name) if name is not None else _AttentionBackendRegistry.get_active_backend()[0]
    return _AttentionBackendRegistry.get_active_backend()[0]


def enable_context_parallel(model, config: ContextParallelConfig | ParallelConfig) -> ParallelConfig:
    """Shard `model` (an `LTX2VideoTransformer3DModel`, or a pipeline holding one as
    `.transformer`) across the ranks of the initialised torch.distributed group with
    diffusers' `enable_parallelism`, using `context_parallel_plan(model)`, and put
    `CallCheck` in front. Every rank then calls the model with the same full inputs
    and gets the same full outputs ([B, S_video, C], [B, S_audio, C]).

    Composes with `bitfuse.accelerate` in either order (the accelerated forward goes
    where diffusers' hooks keep the stock one; the processors keep diffusers' parallel
    config). Not with CUDA graphs (`accelerate(cuda_graphs=True)`): refused both ways.
    Returns diffusers' ParallelConfig (also `model._parallel_config`).

    Raises UnsupportedModelError (not LTX-2), ContextParallelError (heads that the
    Ulysses degree does not divide; ring attention with the `native` backend, which
    returns no log-sum-exp), RuntimeError (torch.distributed not initialised, no
    accelerator, already parallel, CUDA graphs on) and diffusers' own errors (a
    backend without context parallelism)."""
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "transformer", None), torch.nn.Module):
        model = model.transformer
    if not isinstance(model, LTX2VideoTransformer3DModel):
        raise UnsupportedModelError(f"expected diffusers' LTX2VideoTransformer3DModel, got {type(model).__name__}")
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError("context parallelism needs torch.distributed initialised (launch with torchrun and call "
                           "torch.distributed.init_process_group first)")
    if torch.accelerator.device_count() == 0:
        raise RuntimeError("diffusers' enable_parallelism needs an accelerator: it picks the device as rank % "
                           "torch.accelerator.device_count() (modeling_utils.py:1719), and this host has none")
    if getattr(model, "_parallel_config", None) is not None:
        raise RuntimeError("parallelism is already enabled on this model (diffusers' enable_parallelism runs once)")
    handle = model.__dict__.get("_bitfuse_handle")
    if handle is not None and handle.active and handle.graphs is not None:
        raise RuntimeError("this model replays CUDA graphs (accelerate(cuda_graphs=True)); context parallelism "
                           "runs collectives inside the forward: restore the handle first")
    cp = _cp(config)
    check_sizes(model.config, cp)  # heads, before anything is installed
    if (cp.ring_degree or 1) > 1 and _backend(model).value == "native":
        raise ContextParallelError(
            "ring attention needs an attention backend that returns the log-sum-exp, and diffusers' 'native' "
            "(SDPA) does not (attention_dispatch.py:876); call model.set_attention_backend('_native_cudnn') (or "
            "'_native_flash', 'flash') first")
    model.enable_parallelism(config=config, cp_plan=context_parallel_plan(model))
    registry = HookRegistry.check_if_exists_or_initialize(model)
    registry.register_hook(CallCheck(model._parallel_config), CHECK_HOOK)  # last registered: runs first
    if handle is not None:
        handle.rope_cache.clear()  # tables of whole sequences; with the hooks the cache steps aside anyway
    return model._parallel_config
