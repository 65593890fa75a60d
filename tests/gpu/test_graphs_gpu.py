"""CUDA-graph replay against eager, on the GPU.

Every comparison is torch.equal between a graph replay and the same function run
eagerly under the same tier ("high" against eager-high). New input values per
call (no stale static buffers), earlier outputs re-checked after later replays
(no overwritten outputs), a capture that must fail (pageable host-to-device copy)
falls back to eager, graph breaks (segments, a break's tensors copied in, a path
that flips), and LTX-2 (tiny, when diffusers is importable) captured whole, stock
and accelerated, with and without a spatio-temporal guidance mask."""

from __future__ import annotations

import contextlib
import importlib.util
import warnings

import pytest
import torch

import bitfuse
from bitfuse import graphs, sites
from bitfuse.graphs import GraphCaptureWarning, GraphRunner
from bitfuse.numerics import same_bits

pytestmark = pytest.mark.gpu

HAS_DIFFUSERS = importlib.util.find_spec("diffusers") is not None
DEVICE = "cuda"
DTYPE = torch.bfloat16
RUNNER_OPTIONS: dict = {}  # e.g. {"backend": graphs.EmulatedGraphBackend()} to debug the file off the GPU
TIERS = ["lossless", "high"]


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


def _equal(a, b) -> bool:
    la, lb = graphs._leaves_of(a), graphs._leaves_of(b)
    return len(la) == len(lb) and all(x.shape == y.shape and same_bits(x, y) for x, y in zip(la, lb))


@contextlib.contextmanager
def _strict():
    """Treat any GraphCaptureWarning as an error (capture must succeed here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCaptureWarning)
        yield


# ---------------------------------------------------------------- a toy model made of bitfuse sites


class ToyBlock(torch.nn.Module):
    """diffusers-style adaLN block: strided scale/shift/gate views from an unbind."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        self.ff = torch.nn.Linear(dim, dim)
        self.table = torch.nn.Parameter(torch.randn(3, dim) / dim**0.5)
        sites.mark_site(self, "toy_block", norms=(self.norm,))

    def forward(self, x, temb):
        b = x.shape[0]
        shift, scale, gate = (self.table[None, None] + temb.reshape(b, temb.shape[1], 3, self.dim)).unbind(2)
        h = sites.rms_norm_modulate_site(self, self.norm, x, scale, shift)
        h = torch.nn.functional.gelu(self.ff(h), approximate="tanh")
        return sites.gated_residual_site(x, h, gate)


class ToyModel(torch.nn.Module):
    def __init__(self, dim: int = 256, layers: int = 2):
        super().__init__()
        self.dim = dim
        self.t_proj = torch.nn.Linear(1, 3 * dim)
        self.blocks = torch.nn.ModuleList(ToyBlock(dim) for _ in range(layers))
        self.norm_out = torch.nn.LayerNorm(dim, elementwise_affine=False)
        self.out_table = torch.nn.Parameter(torch.randn(2, dim) / dim**0.5)
        sites.mark_site(self, "toy_head", norms=(self.norm_out,))

    def forward(self, x, timestep, return_dict: bool = False):
        b = x.shape[0]
        t = timestep.to(x.dtype).reshape(b, -1, 1) / 1000  # [B] or [B, S] timesteps
        temb = torch.nn.functional.silu(self.t_proj(t))  # [B, 1 or S, 3D]
        for block in self.blocks:
            x = block(x, temb)
        shift, scale = (self.out_table[None, None] + temb[..., : 2 * self.dim].reshape(b, -1, 2, self.dim)).unbind(2)
        x = sites.layer_norm_modulate_site(self, self.norm_out, x, scale, shift)
        return {"sample": x} if return_dict else (x, temb)


def _toy(seed=0, dim=256):
    torch.manual_seed(seed)
    model = ToyModel(dim).to(device=DEVICE, dtype=DTYPE).eval().requires_grad_(False)
    bitfuse.mount(model, "lossless")
    return model


def _toy_inputs(b, s, dim, seed, per_token=False):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(b, s, dim, generator=gen) * 2).to(DEVICE, DTYPE)
    t = torch.rand(b, s if per_token else 1, generator=gen).squeeze(-1) * 1000
    return x, t.to(DEVICE)


SHAPES = [(1, 128, False), (2, 1031, False), (2, 256, True)]  # (batch, tokens, per-token timestep)


@pytest.mark.parametrize("tier", TIERS)
def test_toy_replay_equals_eager_for_shapes_and_timesteps(tier):
    model = _toy()
    runner = GraphRunner(model.forward, max_graphs=8, **RUNNER_OPTIONS)
    with _strict(), bitfuse.quality(tier):
        for b, s, per_token in SHAPES:
            for seed in range(3):  # new values (and timesteps) each call: no stale static buffers
                x, t = _toy_inputs(b, s, model.dim, seed, per_token)
                out = runner(x, t)  # the graph first: its warmup, not eager, meets the gates first
                if DEVICE == "cuda" and not bitfuse.verdicts():
                    pytest.fail("warmup should have driven the first-sight gates to a verdict before capture")
                ref = model(x, t)
                assert _equal(out, ref), f"tier={tier} shape={(b, s)} per_token={per_token} seed={seed}"
    report = runner.report()
    assert report["captures"] == len(SHAPES) and report["capture_failures"] == 0
    assert all(row["hits"] == 2 for row in report["signatures"])


def test_tier_switch_replays_the_right_graph():
    model = _toy()
    runner = GraphRunner(model.forward, **RUNNER_OPTIONS)
    x, t = _toy_inputs(2, 512, model.dim, seed=1)
    with _strict():
        lossless_ref = model(x, t)
        with bitfuse.quality("high"):
            high_ref = model(x, t)
        for _ in range(2):
            assert _equal(runner(x, t), lossless_ref)
            with bitfuse.quality("high"):
                assert _equal(runner(x, t), high_ref)
    assert runner.report()["captures"] == 2


def test_outputs_survive_later_replays():
    model = _toy()
    runner = GraphRunner(model.forward, **RUNNER_OPTIONS)
    inputs = [_toy_inputs(2, 384, model.dim, seed) for seed in range(4)]
    refs = [model(*xt) for xt in inputs]
    with _strict():
        outs = [runner(*xt) for xt in inputs]
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert _equal(out, ref), f"output {i} was overwritten by a later replay"
    assert not same_bits(outs[0][0], outs[1][0])


def test_reuse_outputs_shares_storage():
    model = _toy()
    runner = GraphRunner(model.forward, reuse_outputs=True, **RUNNER_OPTIONS)
    a, b = _toy_inputs(1, 128, model.dim, 0), _toy_inputs(1, 128, model.dim, 1)
    out_a = runner(*a)
    out_b = runner(*b)
    assert out_a[0].data_ptr() == out_b[0].data_ptr()
    assert _equal(out_a, model(*b))


def test_structured_outputs():
    model = _toy()
    runner = GraphRunner(model.forward, **RUNNER_OPTIONS)
    x, t = _toy_inputs(1, 64, model.dim, 3)
    out = runner(x, t, return_dict=True)
    out = runner(x, t, return_dict=True)
    assert isinstance(out, dict) and same_bits(out["sample"], model(x, t, return_dict=True)["sample"])


def test_shared_pool_interleaved_signatures():
    model = _toy()
    runner = GraphRunner(model.forward, pool="shared", **RUNNER_OPTIONS)
    shapes = [(1, 64), (2, 300), (1, 1024)]
    with _strict():
        for rnd in range(3):
            for i, (b, s) in enumerate(shapes if rnd % 2 == 0 else reversed(shapes)):
                x, t = _toy_inputs(b, s, model.dim, seed=10 * rnd + i)
                assert _equal(runner(x, t), model(x, t)), f"round {rnd} shape {(b, s)}"
    assert runner.report()["captures"] == len(shapes)


def test_lru_eviction_frees_memory():
    model = _toy()
    # one graph first, so that the warmup and capture streams' cuBLAS workspaces exist
    GraphRunner(model.forward, **RUNNER_OPTIONS)(*_toy_inputs(1, 8, model.dim, 0))
    runner = GraphRunner(model.forward, max_graphs=2, **RUNNER_OPTIONS)
    big = _toy_inputs(2, 16384, model.dim, 0)
    runner(*big)
    row = runner.report()["signatures"][0]
    torch.cuda.synchronize()
    with_big = torch.cuda.memory_allocated()
    del big
    for s in (8, 16):  # two small graphs: the big one is least recently used, evicted
        runner(*_toy_inputs(1, s, model.dim, s))
    assert runner.report()["evictions"] == 1 and all("16384" not in str(k) for k in runner.keys())
    torch.cuda.synchronize()
    freed = with_big - torch.cuda.memory_allocated()
    # the big inputs, the big graph's static inputs and its static outputs are all gone
    assert freed >= 2 * row["static_input_bytes"] + row["static_output_bytes"] - (1 << 20), (freed, row)


def test_report_memory_on_the_gpu():
    model = _toy()
    runner = GraphRunner(model.forward, **RUNNER_OPTIONS)
    runner(*_toy_inputs(2, 2048, model.dim, 0))
    (row,) = runner.report()["signatures"]
    assert row["static_input_bytes"] >= 2 * 2048 * model.dim * 2
    assert row["capture_allocated_bytes"] >= row["static_output_bytes"] > 0
    assert row["capture_reserved_bytes"] > 0


def test_capture_failure_falls_back_to_eager_and_the_device_stays_usable():
    def host_copy(x):
        # the pattern diffusers' LTX-2 RoPE coords use: a pageable host-to-device copy
        return x * torch.tensor([2.0], device=x.device, dtype=x.dtype)

    runner = GraphRunner(host_copy, **RUNNER_OPTIONS)
    x = torch.randn(4, 8, device=DEVICE, dtype=DTYPE)
    with pytest.warns(GraphCaptureWarning, match="capture of .* failed"):
        out = runner(x)
    assert same_bits(out, x * 2)
    with _strict():
        y = torch.randn(4, 8, device=DEVICE, dtype=DTYPE)
        assert same_bits(runner(y), y * 2)  # eager, no second attempt or warning
    assert runner.report()["capture_failures"] == 1
    # a later capture in the same process works
    model = _toy()
    other = GraphRunner(model.forward, **RUNNER_OPTIONS)
    xt = _toy_inputs(1, 128, model.dim, 0)
    with _strict():
        assert _equal(other(*xt), model(*xt)) and other.report()["graphs"] == 1


def _bench():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "graphs.py"
    spec = importlib.util.spec_from_file_location("bench_graphs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_graphs_on_the_gpu():
    model = _toy()
    x, t = _toy_inputs(2, 1024, model.dim, 0)
    result = _bench().bench_graphs(model, {"x": x, "timestep": t}, tier="lossless", iters=5, **RUNNER_OPTIONS)
    assert result["equal"] and result["graphed"] and result["graph_ms"] > 0 and result["eager_ms"] > 0


# ---------------------------------------------------------------- graph breaks


def _positive(t):
    return bool(t.float().sum() > 0)  # a host sync: capture refuses it


def _row_sums(t):
    return t.float().sum(dim=-1, keepdim=True).to(t.dtype)


def _steered(model, x, t):
    """The toy forward, then a branch on its output's sign (host sync) and a break
    returning a tensor the rest reads."""
    h, _ = model(x, t)
    if graphs.graph_break(_positive, h):
        h = h * 2
    else:
        h = h - 1
    return h + graphs.graph_break(_row_sums, h)


def test_graph_breaks_replay_segments_and_follow_paths():
    model = _toy()
    runner = GraphRunner(lambda x, t: _steered(model, x, t), max_paths=2, **RUNNER_OPTIONS)
    with _strict():
        for i, sign in enumerate([1, -1, 1, -1, -1]):
            x, t = _toy_inputs(2, 256, model.dim, seed=i)
            x = x.abs() * sign * 4  # the sign of the output follows the input's, at this scale
            ref = _steered(model, x, t)
            assert _equal(runner(x, t), ref), (i, sign)
    report = runner.report()
    (row,) = report["signatures"]
    assert row["segments"] == 3 and len(row["paths"]) in (1, 2)
    assert report["capture_failures"] == 0 and report["eager"] == 0
    assert report["captures"] == len(row["paths"])


def test_without_the_break_the_same_forward_falls_back():
    model = _toy()

    def inline(x, t):
        h, _ = model(x, t)
        return h * 2 if bool(h.float().sum() > 0) else h - 1

    runner = GraphRunner(inline, **RUNNER_OPTIONS)
    x, t = _toy_inputs(1, 64, model.dim, 0)
    with pytest.warns(GraphCaptureWarning, match="capture of .* failed"):
        assert _equal(runner(x, t), inline(x, t))


# ---------------------------------------------------------------- LTX-2 (tiny)

LTX_CASES = [  # (batch, video latent (F, H, W), audio tokens, per-token timestep, coords passed in)
    (1, (2, 4, 4), 6, False, False),
    (2, (3, 4, 6), 9, True, False),
    (2, (2, 4, 4), 6, False, True),
]


def _ltx2(variant):
    if not HAS_DIFFUSERS:
        pytest.skip("needs diffusers")
    from bitfuse.models.ltx2_configs import build_model, tiny_config

    return build_model(tiny_config(variant), device=DEVICE, dtype=DTYPE, seed=0)


def _ltx2_inputs(model, case, seed):
    from bitfuse.models.ltx2_configs import make_inputs

    b, shape, audio, per_token, coords = case
    return make_inputs(
        model, batch=b, video_tokens_shape=shape, audio_tokens=audio, per_token=per_token, seed=seed,
        pass_coords=coords,
    )


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_stock_ltx2_captures_whole_with_precomputed_coords(variant):
    """No bitfuse kernels: diffusers' forward as is, graphed (the 'eager+graphs' mode)."""
    from bitfuse.models import ltx2

    model = _ltx2(variant)
    runner = GraphRunner(model.forward, **ltx2.stock_graph_options(model), **RUNNER_OPTIONS)
    with _strict():
        for case in LTX_CASES:
            for seed in range(2):
                kwargs = _ltx2_inputs(model, case, seed)
                assert _equal(runner(**kwargs), model(**kwargs)), (variant, case, seed)
    report = runner.report()
    assert report["capture_failures"] == 0 and report["captures"] == len(LTX_CASES)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_accelerated_ltx2_graphs_equal_eager(variant, tier):
    model = _ltx2(variant)
    stock = {}
    for case in LTX_CASES:
        stock[case] = [model(**_ltx2_inputs(model, case, seed)) for seed in range(2)]
    handle = bitfuse.accelerate(model, quality="lossless", cuda_graphs=True, **RUNNER_OPTIONS)
    try:
        runner = handle.graphs
        assert isinstance(runner, GraphRunner)
        eager = runner.fn  # the accelerated forward, not graphed
        with _strict(), bitfuse.quality(tier):
            for case in LTX_CASES:
                for seed in range(2):
                    kwargs = _ltx2_inputs(model, case, seed)
                    ref = eager(**kwargs)
                    out = model(**kwargs)  # through the graph
                    assert _equal(out, ref), (variant, tier, case, seed)
                    if tier == "lossless":
                        assert _equal(out, stock[case][seed]), f"lossless graph differs from stock diffusers {case}"
                kwargs = {**_ltx2_inputs(model, case, 0), "return_dict": True}
                out = model(**kwargs)
                ref = eager(**kwargs)
                assert type(out).__name__ == "AudioVisualModelOutput"
                assert same_bits(out.sample, ref.sample) and same_bits(out.audio_sample, ref.audio_sample)
        report = runner.report()
        assert report["capture_failures"] == 0 and report["graphs"] == min(2 * len(LTX_CASES), runner.max_graphs)
    finally:
        handle.restore()
    assert "forward" not in model.__dict__


def test_accelerated_ltx2_outputs_survive_later_replays():
    model = _ltx2("2.0")
    handle = bitfuse.accelerate(model, cuda_graphs=True, **RUNNER_OPTIONS)
    try:
        case = LTX_CASES[1]
        inputs = [_ltx2_inputs(model, case, seed) for seed in range(3)]
        with _strict():
            outs = [model(**kw) for kw in inputs]
        eager = handle.graphs.fn
        for kw, out in zip(inputs, outs):
            assert _equal(out, eager(**kw))
    finally:
        handle.restore()


STG_CASES = [  # (STG blocks, mask): none, diffusers' default (all perturbed), mixed, all, none perturbed
    (None, None),
    ([1], None),
    ([0, 1], [0.0, 1.0]),
    ([1], [0.0, 0.0]),
    ([1], [1.0, 1.0]),
]


def _stg_inputs(model, case, seed):
    from bitfuse.models.ltx2_configs import make_inputs

    blocks, mask = case
    return make_inputs(model, batch=2, stg_blocks=blocks, seed=seed,
                       perturbation_mask=None if mask is None else torch.tensor(mask))


def test_accelerated_ltx2_stg_with_and_without_a_mask_captures_whole():
    """LTX-2.3 spatio-temporal guidance through accelerate(cuda_graphs=True): the branch
    on `torch.all(mask == 0)` is computed per call before the graph, so every case is
    one segment, equal to eager and to stock diffusers."""
    model = _ltx2("2.3")
    stock = {
        (i, seed): model(**_stg_inputs(model, case, seed)) for i, case in enumerate(STG_CASES) for seed in range(2)
    }
    handle = bitfuse.accelerate(model, cuda_graphs=True, max_graphs=len(STG_CASES), **RUNNER_OPTIONS)
    try:
        eager = handle.graphs.fn
        with _strict():
            for seed in range(2):
                for i, case in enumerate(STG_CASES):
                    kwargs = _stg_inputs(model, case, seed)
                    out = model(**kwargs)
                    assert _equal(out, eager(**kwargs)), (case, seed)
                    assert _equal(out, stock[i, seed]), (case, seed)
        report = handle.graphs.report()
        assert report["capture_failures"] == 0 and report["eager"] == 0
        assert report["graphs"] == len(STG_CASES) and all(r["segments"] == 1 for r in report["signatures"])
    finally:
        handle.restore()


def test_accelerated_ltx2_without_the_hoist_breaks_at_the_mask():
    """A plain runner around the accelerated forward: the forward's graph break at the
    STG branch splits it in two segments; a mask whose truth flips takes the other path."""
    model = _ltx2("2.3")
    cases = [([1], [0.0, 1.0]), ([1], [0.0, 0.0]), ([1], [0.0, 1.0])]
    refs = [model(**_stg_inputs(model, c, i)) for i, c in enumerate(cases)]
    with bitfuse.accelerate(model):
        runner = GraphRunner(model.forward, **RUNNER_OPTIONS)
        with _strict():
            for i, (case, ref) in enumerate(zip(cases, refs)):
                assert _equal(runner(**_stg_inputs(model, case, i)), ref), case
        runner.close()
    report = runner.report()
    assert report["captures"] == 2 and report["divergences"] >= 1 and report["eager"] == 0


def test_stock_ltx2_with_a_mask_falls_back_but_matches_eager():
    """diffusers' own forward syncs on the mask inside: that signature runs eagerly."""
    from bitfuse.models import ltx2

    model = _ltx2("2.3")
    runner = GraphRunner(model.forward, **ltx2.stock_graph_options(model), **RUNNER_OPTIONS)
    with pytest.warns(GraphCaptureWarning):
        kwargs = _stg_inputs(model, STG_CASES[2], 0)
        assert _equal(runner(**kwargs), model(**kwargs))
    kwargs = _stg_inputs(model, STG_CASES[2], 1)
    assert _equal(runner(**kwargs), model(**kwargs))
    assert runner.report()["capture_failures"] == 1
