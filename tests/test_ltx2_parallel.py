"""LTX-2 context parallelism (bitfuse.models.ltx2_parallel) on the CPU.

The plan, the size and call checks, and one end-to-end run over two gloo
processes: diffusers' `native` attention backend supports Ulysses context
parallelism on the CPU (its ring needs a backend returning the log-sum-exp, none
of which runs on a CPU: ring is checked in tests/gpu/test_parallel_gpu.py).
diffusers picks the device as `rank % torch.accelerator.device_count()`, which
is 0 on a CPU-only host: the worker reports one device (cpu:0)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.models._modeling_parallel import ContextParallelConfig

import bitfuse
from bitfuse.models import UnsupportedModelError
from bitfuse.models import ltx2_parallel as P
from bitfuse.models.ltx2_configs import (
    build_model,
    full_config,
    make_inputs,
    tiny_config,
)
from bitfuse.numerics import differing

VIDEO = (2, 4, 4)  # 32 video tokens
AUDIO, TEXT = 6, 6


def _ulysses(n=2, **kw):
    return ContextParallelConfig(ulysses_degree=n, **kw)


# ---------------------------------------------------------------- the plan


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_plan_splits_every_token_axis_and_gathers_both_outputs(variant):
    model = build_model(tiny_config(variant))
    plan = P.context_parallel_plan(model)
    inputs = plan[""]
    # every forward input with a token axis, and nothing else (masks: CallCheck)
    assert set(inputs) == {"hidden_states", "audio_hidden_states", "encoder_hidden_states",
                           "audio_encoder_hidden_states", "timestep", "audio_timestep", "video_keyframes_mask"}
    assert all(c.split_dim == 1 and not c.split_output for c in inputs.values())
    assert (inputs["timestep"].expected_dims, inputs["audio_timestep"].expected_dims) == (2, 2)
    # each RoPE module's cos and sin, on the sequence axis of the tables it returns
    kw = make_inputs(model, batch=2, video_tokens_shape=VIDEO, audio_tokens=AUDIO, pass_coords=True)
    coords = {"rope": kw["video_coords"], "cross_attn_rope": kw["video_coords"][:, 0:1],
              "audio_rope": kw["audio_coords"], "cross_attn_audio_rope": kw["audio_coords"][:, 0:1]}
    tokens = {"rope": 32, "cross_attn_rope": 32, "audio_rope": AUDIO, "cross_attn_audio_rope": AUDIO}
    for name, coord in coords.items():
        cos, sin = getattr(model, name)(coord)
        for i, table in enumerate((cos, sin)):
            c = plan[name][i]
            assert c.split_output and table.dim() == c.expected_dims
            assert table.shape[c.split_dim] == tokens[name], (name, table.shape)
    assert {k for k in plan if k} == {"rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope",
                                      "proj_out", "audio_proj_out"}
    for name in ("proj_out", "audio_proj_out"):
        assert (plan[name].gather_dim, plan[name].expected_dims) == (1, 3)


def test_plan_refuses_other_models():
    with pytest.raises(UnsupportedModelError, match="LTX2VideoTransformer3DModel"):
        P.context_parallel_plan(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- sizes


def test_sizes_that_do_not_split_are_named():
    cfg = full_config(1)  # 32 video heads, 32 audio heads
    P.check_sizes(cfg, _ulysses(4), video_tokens=6144, audio_tokens=128, text_tokens=256, audio_text_tokens=256)
    with pytest.raises(P.ContextParallelError, match=r"126 audio tokens do not divide by 4.*ulysses_anything"):
        P.check_sizes(cfg, _ulysses(4), video_tokens=6144, audio_tokens=126)
    with pytest.raises(P.ContextParallelError, match="video self/text attention has 32 heads.*Ulysses degree 3"):
        P.check_sizes(cfg, _ulysses(3))
    with pytest.raises(P.ContextParallelError, match="audio self/text, a2v and v2a attention has 6 heads"):
        P.check_sizes(dict(cfg, audio_num_attention_heads=6), _ulysses(4))
    # ring trades no heads; the uneven modes take any size of at least one token a GPU
    P.check_sizes(dict(cfg, num_attention_heads=6), ContextParallelConfig(ring_degree=4), video_tokens=8)
    P.check_sizes(cfg, _ulysses(4, ulysses_anything=True), audio_tokens=126)
    P.check_sizes(dict(cfg, num_attention_heads=6), _ulysses(4, ulysses_anything=True))
    with pytest.raises(P.ContextParallelError, match="fewer tokens than GPUs"):
        P.check_sizes(cfg, ContextParallelConfig(ring_degree=4, ring_anything=True), audio_tokens=3)


# ---------------------------------------------------------------- the call check


@pytest.fixture(scope="module")
def tiny():
    return build_model(tiny_config("2.0"))


def _kw(model, **options):
    return make_inputs(model, batch=2, video_tokens_shape=VIDEO, audio_tokens=AUDIO, text_tokens=TEXT, **options)


def test_call_check_drops_masks_that_mask_nothing_and_refuses_real_ones(tiny):
    kw = _kw(tiny)
    ones = torch.ones(2, TEXT)
    out = P.check_call(tiny, _ulysses(), dict(kw, encoder_attention_mask=ones, audio_encoder_attention_mask=ones))
    assert out["encoder_attention_mask"] is None and out["audio_encoder_attention_mask"] is None
    zeros_bias = torch.zeros(2, 1, TEXT)  # an additive (3-D) mask of zeros masks nothing either
    assert P.check_call(tiny, _ulysses(), dict(kw, encoder_attention_mask=zeros_bias))["encoder_attention_mask"] is None
    real = ones.clone()
    real[0, -2:] = 0
    for name in ("encoder_attention_mask", "audio_encoder_attention_mask"):
        with pytest.raises(P.ContextParallelError, match=f"{name} masks some tokens.*2573.*#14317"):
            P.check_call(tiny, _ulysses(), dict(kw, **{name: real}))
    bias = torch.zeros(2, 1, TEXT)
    bias[1, 0, 0] = -10000.0
    with pytest.raises(P.ContextParallelError, match="masks some tokens"):
        P.check_call(tiny, _ulysses(), dict(kw, encoder_attention_mask=bias))
    with pytest.raises(P.ContextParallelError, match="video_self_attention_mask is not supported"):
        P.check_call(tiny, _ulysses(), _kw(tiny, masks=True) | {"encoder_attention_mask": None,
                                                                 "audio_encoder_attention_mask": None})


def test_call_check_keeps_the_verdict_of_a_mask_until_it_changes(tiny, monkeypatch):
    verdicts = P._MaskVerdicts()
    mask = torch.ones(2, TEXT)
    assert verdicts.masks_nothing(mask, additive=False)
    calls = []
    monkeypatch.setattr(torch.Tensor, "all", lambda self, *a, **k: calls.append(1) or torch.tensor(True))
    assert verdicts.masks_nothing(mask, additive=False) and not calls  # the same tensor: no new check
    mask[0, 0] = 0  # written in place: its version changes, so it is checked again
    monkeypatch.undo()
    assert not verdicts.masks_nothing(mask, additive=False)


def test_call_check_shapes_timesteps_and_refuses_per_token_sigma(tiny):
    kw = _kw(tiny, per_token=True)
    out = P.check_call(tiny, _ulysses(), dict(kw, timestep=kw["timestep"][..., None]))  # [B, S, 1]
    assert out["timestep"].shape == (2, 32) and torch.equal(out["timestep"], kw["timestep"])
    assert out["audio_timestep"].shape == (2, AUDIO)
    flat = P.check_call(tiny, _ulysses(), dict(_kw(tiny), timestep=torch.tensor([[500.0], [400.0]])))
    assert flat["timestep"].shape == (2,)  # [B, 1]: per sample (diffusers would assert on a 1-long split)
    with pytest.raises(P.ContextParallelError, match="timestep of shape \\(2, 7\\) is neither per sample"):
        P.check_call(tiny, _ulysses(), dict(kw, timestep=torch.zeros(2, 7)))
    with pytest.raises(P.ContextParallelError, match="sigma of shape \\(2, 6\\) is not per sample"):
        P.check_call(tiny, _ulysses(), dict(kw, sigma=torch.zeros(2, TEXT)))
    with pytest.raises(P.ContextParallelError, match="perturbation_mask .* is not per sample"):
        P.check_call(tiny, _ulysses(), dict(kw, perturbation_mask=torch.ones(2, 32, 1)))
    with pytest.raises(P.ContextParallelError, match="video_keyframes_mask of shape"):
        P.check_call(tiny, _ulysses(), dict(kw, video_keyframes_mask=torch.ones(2, 32)))
    with pytest.raises(P.ContextParallelError, match="7 text tokens do not divide by 2"):
        P.check_call(tiny, _ulysses(), _kw(tiny) | {"encoder_hidden_states": torch.zeros(2, 7, 24)})


def test_call_check_binds_every_argument_by_keyword(tiny):
    kw = _kw(tiny)
    names = ["hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
             "timestep"]
    bound = P._bind(tuple(kw[n] for n in names), {k: v for k, v in kw.items() if k not in names})
    assert bound["audio_timestep"] is None and bound["return_dict"] is False and bound["fps"] == 24.0
    assert all(bound[n] is kw[n] for n in names)
    with pytest.raises(TypeError, match="multiple values for argument 'hidden_states'"):
        P._bind((kw["hidden_states"],), {"hidden_states": kw["hidden_states"]})


def test_enable_needs_distributed_and_an_ltx2_model(tiny):
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        P.enable_context_parallel(tiny, _ulysses())
    with pytest.raises(UnsupportedModelError):
        P.enable_context_parallel(torch.nn.Linear(2, 2), _ulysses())


# ---------------------------------------------------------------- two gloo processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.accelerator.device_count = lambda: 1  # see the module docstring
    results = {}
    try:
        cases = {
            # name: (variant, make_inputs options, the CP config, accelerate before enabling CP)
            "2.0 per-sample, all-ones masks": ("2.0", {"masks": "ones"}, {}, False),
            "2.3 per-token, accelerated first": ("2.3", {"per_token": True, "pass_coords": True}, {}, True),
            "2.3 STG + cross timestep": ("2.3", {"stg_blocks": [1], "use_cross_timestep": True}, {}, False),
            # ulysses_anything gathers uneven pieces with dist.all_gather, which gloo refuses: GPU test only
        }
        for name, (variant, options, cp, accelerate_first) in cases.items():
            options = dict(options)
            ones = options.pop("masks", None) == "ones"
            stock = build_model(tiny_config(variant), seed=0)
            ours = build_model(tiny_config(variant), seed=0)
            kw = make_inputs(stock, batch=2, video_tokens_shape=VIDEO, audio_tokens=options.pop("audio_tokens", AUDIO),
                             text_tokens=TEXT, **options)
            if ones:
                kw["encoder_attention_mask"] = kw["audio_encoder_attention_mask"] = torch.ones(2, TEXT)
            single = stock(**kw)
            P.enable_context_parallel(stock, _ulysses(world, **cp))
            if accelerate_first:
                handle = bitfuse.accelerate(ours)
                P.enable_context_parallel(ours, _ulysses(world, **cp))
            else:
                P.enable_context_parallel(ours, _ulysses(world, **cp))
                handle = bitfuse.accelerate(ours)
            reference = stock(**kw)
            got = ours(**kw)
            handle.restore()  # the stock forward again, under diffusers' hooks
            restored = ours(**kw)
            results[name] = {"single": single, "reference": reference, "got": got, "restored": restored}

        errors = {}
        model = build_model(tiny_config("2.0"), seed=0)
        for label, fn in {
            "ring with native": lambda: P.enable_context_parallel(model, ContextParallelConfig(ring_degree=world)),
            "heads": lambda: P.enable_context_parallel(
                build_model(tiny_config("2.0", num_attention_heads=3, cross_attention_dim=48)), _ulysses(world)),
        }.items():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the message is the result
                errors[label] = f"{type(exc).__name__}: {exc}"
        P.enable_context_parallel(model, _ulysses(world))
        kw = make_inputs(model, batch=2, video_tokens_shape=VIDEO, audio_tokens=AUDIO, text_tokens=TEXT)
        for label, call in {
            "odd video": dict(kw, hidden_states=torch.zeros(2, 9, 8), num_frames=1, height=3, width=3),
            "real mask": dict(kw, encoder_attention_mask=torch.tensor([[1.0] * TEXT, [1.0] * (TEXT - 1) + [0.0]])),
            "twice": None,
        }.items():
            try:
                model(**call) if call is not None else P.enable_context_parallel(model, _ulysses(world))
            except Exception as exc:  # noqa: BLE001 - the message is the result
                errors[label] = f"{type(exc).__name__}: {exc}"
        results["errors"] = errors
    finally:
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("cp"))
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]


def test_gloo_accelerated_equals_stock_under_the_same_parallelism(gloo_run):
    rank0, rank1 = gloo_run
    cases = [k for k in rank0 if k != "errors"]
    assert len(cases) == 3
    for name in cases:
        r0, r1 = rank0[name], rank1[name]
        for i, kind in enumerate(("video", "audio")):
            ref, got = r0["reference"][i], r0["got"][i]
            assert ref.shape == r0["single"][i].shape  # whole sequences come back
            assert torch.equal(got, ref), (name, kind, differing(got, ref))
            assert torch.equal(r0["restored"][i], ref), (name, kind)  # restore() under the hooks: stock again
            assert torch.equal(r1["got"][i], got), (name, kind)  # every rank returns the same whole output
            # against one process: the same model, not sharded (fp32 on the CPU): the GEMMs and attention run
            # on other shapes, so the bits may differ; the plan is right when they agree to rounding
            torch.testing.assert_close(ref, r0["single"][i], rtol=1e-5, atol=1e-5, msg=f"{name} {kind}")


def test_gloo_errors_are_clear(gloo_run):
    errors = gloo_run[0]["errors"]
    assert "ContextParallelError" in errors["ring with native"] and "_native_cudnn" in errors["ring with native"]
    assert "video self/text attention has 3 heads" in errors["heads"]
    assert "9 video tokens do not divide by 2" in errors["odd video"]
    assert "encoder_attention_mask masks some tokens" in errors["real mask"]
    assert "already enabled" in errors["twice"]


def test_cuda_graphs_are_refused_under_context_parallelism():
    model = build_model(tiny_config("2.0"))
    handle = bitfuse.accelerate(model)
    try:
        handle.graph_options()  # no parallelism: fine
        model._parallel_config = object()  # what diffusers' enable_parallelism records
        with pytest.raises(RuntimeError, match="CUDA graphs are not supported with context parallelism"):
            handle.graph_options()
    finally:
        model._parallel_config = None
        handle.restore()
