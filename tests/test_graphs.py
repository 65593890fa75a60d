"""GraphRunner bookkeeping on CPU: signatures, LRU, tiers, output cloning,
capture-failure fallback, static buffers, the LTX-2 coords hook, wrap/restore.

The capture mechanism is swapped for EmulatedGraphBackend, whose "replay" reruns
the function on the static inputs and writes into the static outputs in place,
as a CUDA graph replay does; a missing input copy or a missing output clone shows
up here exactly as it would on the GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from collections import namedtuple

import pytest
import torch

import bitfuse
from bitfuse import graphs, policy
from bitfuse.graphs import (
    EmulatedGraphBackend,
    GraphCaptureWarning,
    GraphRunner,
    UnsupportedInput,
    signature_of,
)

HAS_DIFFUSERS = importlib.util.find_spec("diffusers") is not None


class Recording(EmulatedGraphBackend):
    """Emulated backend that logs what it captured and released."""

    def __init__(self):
        super().__init__()
        self.log = []

    def capture(self, call, device):
        graph, out, stats = super().capture(call, device)
        graph.label = self.captures - 1
        self.log.append(("capture", graph.label))
        return graph, out, stats

    def release(self, graph):
        self.log.append(("release", graph.label))
        super().release(graph)


class FailingCapture(EmulatedGraphBackend):
    """Capture raises the way torch does when a forward syncs with the host."""

    def __init__(self, fail_when=lambda: True):
        super().__init__()
        self.attempts = 0
        self.fail_when = fail_when

    def capture(self, call, device):
        self.attempts += 1
        if self.fail_when():
            try:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            except RuntimeError as inner:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from inner
        return super().capture(call, device)


class Counting:
    """fn(x, scale=..., ...) = x * scale + bias, counting calls."""

    def __init__(self):
        self.calls = 0
        self.bias = torch.arange(4.0)

    def __call__(self, x, scale=2.0, flip=False):
        self.calls += 1
        y = x * scale + self.bias[: x.shape[-1]]
        return -y if flip else y


def runner_of(fn, **kw):
    kw.setdefault("backend", EmulatedGraphBackend())
    return GraphRunner(fn, **kw)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# ---------------------------------------------------------------- signatures


def key(*args, **kwargs):
    return signature_of(args, kwargs)[0]


def test_signature_keys_tensor_metadata_not_values():
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert key(a) == key(b)
    assert key(a) != key(torch.randn(3, 2))  # shape
    assert key(a) != key(a.double())  # dtype
    assert key(a) != key(torch.randn(3, 2).t())  # same shape, other strides
    assert key(a) != key(torch.randn(3).expand(2, 3))  # stride 0: a broadcast view
    wide = torch.randn(2, 4)
    assert key(wide[:, :3]) != key(wide[:, 1:])  # same strides, 4-byte misalignment


def test_signature_keys_plain_values_by_value_and_type():
    x = torch.zeros(2)
    assert key(x, 1) == key(x, 1)
    assert key(x, 1) != key(x, 2)
    assert key(x, 1) != key(x, True)  # 1 == True in Python, not here
    assert key(x, 1) != key(x, 1.0)
    assert key(x, 0.0) != key(x, -0.0)
    assert key(x, float("nan")) == key(x, float("nan"))  # nan != nan, but the key is stable
    assert key(x, None) != key(x, "None")
    assert key(x, (1, [2, {"a": 3}])) == key(x, (1, [2, {"a": 3}]))
    assert key(x, (1, [2, {"a": 3}])) != key(x, (1, [2, {"a": 4}]))
    assert key(x, (1, 2)) != key(x, [1, 2])
    assert key(x, torch.float16) != key(x, torch.bfloat16)
    assert key(x=x, y=1) == key(y=1, x=x)  # keyword order does not matter
    assert key(x, y=1) != key(x, 1)  # positional vs keyword does


def test_signature_collects_nested_tensors_in_order():
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    k, tensors = signature_of((a, [b, {"c": c}]), {})
    assert [t.shape for t in tensors] == [a.shape, b.shape, c.shape]
    assert all(t is s for t, s in zip(tensors, (a, b, c)))


def test_signature_rejects_identity_hashed_objects():
    with pytest.raises(UnsupportedInput):
        key(torch.zeros(1), object())
    with pytest.raises(UnsupportedInput):
        key({object(): 1})


def test_unsupported_argument_runs_eagerly_with_one_warning():
    seen = []

    def fn(x, thing):
        seen.append(thing)
        return x + 1

    runner = runner_of(fn)
    x = torch.zeros(3)
    with pytest.warns(GraphCaptureWarning, match="cannot key"):
        out = runner(x, object())
    assert torch.equal(out, x + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner(x, object())
    assert len(seen) == 2 and runner.backend.captures == 0 and len(runner) == 0


def test_quality_tier_is_part_of_the_signature():
    base = signature_of((torch.zeros(1),), {}, graphs.default_context())[0]
    with bitfuse.quality("high"):
        high = signature_of((torch.zeros(1),), {}, graphs.default_context())[0]
    with bitfuse.quality("lossless"):
        lossless = signature_of((torch.zeros(1),), {}, graphs.default_context())[0]
    assert len({base, high, lossless}) == 3


def test_a_graph_captured_in_one_tier_never_replays_in_another():
    tiers = []

    def fn(x):
        tiers.append(policy.requested_quality())
        return x * 3

    runner = runner_of(fn, warmup=0)
    x = torch.ones(2)
    runner(x)
    with bitfuse.quality("high"):
        runner(x)
        runner(x)
    runner(x)
    assert runner.backend.captures == 2
    # each graph's function ran (capture and replays) under its own tier only
    assert tiers == [None, None, "high", "high", "high", None]
    rows = runner.report()["signatures"]
    assert sorted(r["hits"] for r in rows) == [1, 1]


def test_mounted_tier_is_part_of_the_signature():
    block = torch.nn.Module()
    site = bitfuse.mark_site(block, "toy")
    model = torch.nn.Module()
    model.block = block
    model.forward = lambda x: x + 1
    runner = graphs.runner_for_model(model, backend=EmulatedGraphBackend(), warmup=0)
    x = torch.zeros(2)
    runner(x)
    runner(x)
    site.tier = "high"
    runner(x)
    site.tier = "lossless"
    runner(x)
    assert runner.backend.captures == 3
    contexts = {row["signature"].split("context=")[1] for row in runner.report()["signatures"]}
    assert len(contexts) == 3


# ---------------------------------------------------------------- capture and replay


def test_warmup_runs_before_capture_then_replays():
    fn = Counting()
    runner = runner_of(fn, warmup=2)
    x = torch.randn(3, 4)
    out = runner(x)
    # 2 warmups + 1 capture + 1 replay (emulated replays rerun the function)
    assert fn.calls == 4 and runner.backend.captures == 1 and runner.backend.replays == 1
    assert torch.equal(out, fn(x))
    fn.calls = 0
    runner(x)
    assert fn.calls == 1 and runner.backend.captures == 1


def test_new_input_values_give_new_outputs():
    fn = Counting()
    runner = runner_of(fn)
    for seed in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(runner(x, scale=0.5), x * 0.5 + fn.bias)
    assert runner.backend.captures == 1
    assert torch.equal(runner(x, scale=3.0), x * 3.0 + fn.bias)  # another value: another graph
    assert runner.backend.captures == 2


def test_outputs_are_clones_not_overwritten_by_later_replays():
    runner = runner_of(lambda x: (x * 2, {"y": x + 1}))
    a, b = torch.ones(3), torch.full((3,), 5.0)
    out_a = runner(a)
    out_b = runner(b)
    assert torch.equal(out_a[0], a * 2) and torch.equal(out_a[1]["y"], a + 1)
    assert torch.equal(out_b[0], b * 2) and torch.equal(out_b[1]["y"], b + 1)
    assert out_a[0].data_ptr() != out_b[0].data_ptr()
    static = runner._graphs[runner.keys()[0]].out_leaves
    assert all(t.data_ptr() != s.data_ptr() for t in (out_a[0], out_b[0]) for s in static)


def test_reuse_outputs_returns_the_static_outputs():
    runner = runner_of(lambda x: x * 2, reuse_outputs=True)
    a, b = torch.ones(3), torch.full((3,), 5.0)
    out_a = runner(a)
    assert torch.equal(out_a, a * 2)
    out_b = runner(b)
    assert out_a.data_ptr() == out_b.data_ptr()
    assert torch.equal(out_a, b * 2)  # overwritten, as documented


def test_shared_pool_requires_cloned_outputs():
    with pytest.raises(ValueError, match="shared pool"):
        GraphRunner(lambda x: x, pool="shared", reuse_outputs=True)


def test_output_structures_are_rebuilt():
    Pair = namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Out:
        sample: torch.Tensor
        extra: object = None
        n: int = dataclasses.field(default=0, init=False)

    def fn(x):
        out = Out(x + 1, extra=[x * 2, "tag"])
        out.n = 7
        return Pair(out, (x - 1, None))

    runner = runner_of(fn)
    x = torch.randn(4)
    runner(torch.zeros(4))
    got = runner(x)
    assert isinstance(got, Pair) and isinstance(got.a, Out)
    assert torch.equal(got.a.sample, x + 1) and torch.equal(got.a.extra[0], x * 2) and got.a.extra[1] == "tag"
    assert got.a.n == 7
    assert torch.equal(got.b[0], x - 1) and got.b[1] is None


@pytest.mark.skipif(not HAS_DIFFUSERS, reason="needs diffusers")
def test_diffusers_model_output_is_rebuilt():
    from diffusers.models.transformers.transformer_ltx2 import AudioVisualModelOutput

    runner = runner_of(lambda x: AudioVisualModelOutput(sample=x * 2, audio_sample=x + 1))
    runner(torch.zeros(2))
    x = torch.randn(2)
    out = runner(x)
    assert isinstance(out, AudioVisualModelOutput)
    assert torch.equal(out.sample, x * 2) and torch.equal(out["audio_sample"], x + 1)
    assert torch.equal(out[0], x * 2)  # BaseOutput's tuple view is rebuilt too


def test_static_inputs_keep_strides_alignment_and_broadcasts():
    seen = []

    def fn(t, s):
        seen.append((t.stride(), t.data_ptr() % 16, s.stride()))
        return t * s

    runner = runner_of(fn)
    base = torch.randn(5, 9)
    t = base.t()[1:]  # strided and offset by 4 bytes
    s = torch.randn(1).expand(8, 5)  # stride 0, like a pipeline's `t.expand(batch)`
    runner(t, s)
    static_t, static_s = (si.tensor for si in runner._graphs[runner.keys()[0]].inputs)
    assert static_t.stride() == t.stride() and static_t.data_ptr() % 16 == t.data_ptr() % 16
    assert static_s.stride() == (0, 0)
    assert all(entry == seen[0] for entry in seen)
    t2, s2 = torch.randn(5, 9).t()[1:], torch.randn(1).expand(8, 5)
    assert torch.equal(runner(t2, s2), t2 * s2)


# ---------------------------------------------------------------- LRU


def test_lru_evicts_least_recently_used_and_releases_it():
    backend = Recording()
    runner = runner_of(lambda x: x + 1, max_graphs=2, backend=backend, warmup=0)
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    runner(a)  # graph 0
    runner(b)  # graph 1
    runner(a)  # a is now the most recent
    runner(c)  # graph 2: evicts b (graph 1), not a
    assert backend.log == [("capture", 0), ("capture", 1), ("capture", 2), ("release", 1)]
    shapes = [k[0][0][1] for k in runner.keys()]
    assert shapes == [(1,), (3,)]  # least recently used first
    report = runner.report()
    assert report["graphs"] == 2 and report["evictions"] == 1
    runner(b)  # recaptured; evicts a, now the least recently used
    assert backend.log[-2:] == [("capture", 3), ("release", 0)]
    assert torch.equal(runner(b), b + 1)


def test_evicted_graph_drops_its_buffers():
    runner = runner_of(lambda x: x * 2, max_graphs=1, warmup=0)
    runner(torch.zeros(2))
    first = runner._graphs[runner.keys()[0]]
    runner(torch.zeros(3))
    assert first.graph is None and first.inputs == [] and first.out_leaves == []


def test_max_graphs_must_be_positive():
    with pytest.raises(ValueError):
        GraphRunner(lambda x: x, max_graphs=0)


def test_clear_and_close():
    fn = Counting()
    runner = runner_of(fn)
    x = torch.ones(4)
    runner(x)
    runner.clear()
    assert len(runner) == 0 and runner.backend.released == 1
    runner(x)
    assert runner.backend.captures == 2
    runner.close()
    fn.calls = 0
    assert torch.equal(runner(x), fn(x)) and fn.calls == 2 and runner.backend.captures == 2


# ---------------------------------------------------------------- report


def test_report_counts_memory_and_hits():
    runner = runner_of(lambda x, y: x @ y, warmup=1)
    x, y = torch.randn(4, 8), torch.randn(8, 2)
    for _ in range(3):
        runner(x, y)
    report = runner.report()
    assert report["captures"] == 1 and report["calls"] == 3 and report["replays"] == 3
    (row,) = report["signatures"]
    assert row["state"] == "graph" and row["hits"] == 2
    assert row["static_input_bytes"] == (4 * 8 + 8 * 2) * 4
    assert row["static_output_bytes"] == 4 * 2 * 4
    assert row["total_bytes_estimate"] >= row["static_input_bytes"] + row["static_output_bytes"]
    assert "float32[4,8]" in row["signature"]


# ---------------------------------------------------------------- fallback


def test_capture_failure_warns_with_the_error_and_stays_eager_for_that_signature():
    backend = FailingCapture()
    fn = Counting()
    runner = runner_of(fn, backend=backend, warmup=1)
    x = torch.randn(2, 4)
    with pytest.warns(GraphCaptureWarning) as record:
        out = runner(x)
    assert torch.equal(out, x * 2.0 + fn.bias)
    text = str(record[0].message)
    assert "operation not permitted when stream is capturing" in text  # the root cause
    assert "previous error during capture" in text
    assert "runs eagerly" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = torch.randn(2, 4)
            assert torch.equal(runner(x), x * 2.0 + fn.bias)
    assert backend.attempts == 1  # never retried
    report = runner.report()
    assert report["capture_failures"] == 1 and report["graphs"] == 0
    (row,) = report["signatures"]
    assert row["state"] == "eager" and row["hits"] == 3 and "not permitted" in row["reason"]


def test_capture_failure_is_per_signature():
    backend = FailingCapture(fail_when=lambda: backend.attempts == 1)
    runner = runner_of(lambda x: x + 1, backend=backend)
    with pytest.warns(GraphCaptureWarning):
        runner(torch.zeros(2))
    y = torch.ones(3)
    assert torch.equal(runner(y), y + 1)
    assert backend.captures == 1 and len(runner) == 1


def test_errors_in_warmup_are_raised_not_cached():
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("bad input")
        return x + 1

    runner = runner_of(fn)
    with pytest.raises(ValueError, match="bad input"):
        runner(torch.zeros(2))
    assert runner.report()["signatures"] == []
    assert torch.equal(runner(torch.zeros(2)), torch.ones(2))  # tried again, captured


def test_rejected_inputs_run_eagerly_once_warned():
    # the real backend refuses CPU tensors (their values would be baked into a graph)
    runner = GraphRunner(lambda x: x + 1)
    with pytest.warns(GraphCaptureWarning, match="CUDA"):
        out = runner(torch.zeros(2))
    assert torch.equal(out, torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner(torch.zeros(2))
    assert runner.report()["signatures"][0]["state"] == "eager"


def test_autograd_enabled_runs_eagerly():
    runner = runner_of(lambda x: x * 2)
    x = torch.ones(2, requires_grad=True)
    with torch.enable_grad():
        with pytest.warns(GraphCaptureWarning, match="autograd"):
            out = runner(x)
        assert out.requires_grad and runner.backend.captures == 0
        out.sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_inside_an_outer_capture_the_function_runs_directly():
    class Capturing(EmulatedGraphBackend):
        def capturing(self):
            return True

    fn = Counting()
    runner = runner_of(fn, backend=Capturing())
    runner(torch.ones(4))
    assert fn.calls == 1 and runner.report()["calls"] == 0


# ---------------------------------------------------------------- prepare (constant inputs)


def test_prepare_runs_once_per_signature_and_feeds_constants():
    prepared = []

    def prepare(args, kwargs):
        prepared.append(args[0].shape)
        return {"offset": torch.full(args[0].shape, 10.0)}

    def fn(x, offset=None):
        return x + (offset if offset is not None else 0)

    runner = runner_of(fn, prepare=prepare)
    for _ in range(3):
        x = torch.randn(3)
        assert torch.equal(runner(x), x + 10)
    runner(torch.randn(4))
    assert prepared == [torch.Size([3]), torch.Size([4])]
    assert runner.report()["signatures"][0]["constant_bytes"] == 12


# ---------------------------------------------------------------- LTX-2


@pytest.fixture(scope="module")
def tiny_ltx2():
    if not HAS_DIFFUSERS:
        pytest.skip("needs diffusers")
    from bitfuse.models.ltx2_configs import build_model, tiny_config

    return build_model(tiny_config("2.0"), dtype=torch.float32)


def test_ltx2_coords_are_precomputed_exactly_as_the_forward_would(tiny_ltx2):
    from bitfuse.models.ltx2_configs import make_inputs

    model = tiny_ltx2
    prepare = graphs.ltx2_coords_prepare(model)
    kwargs = make_inputs(model, batch=2, video_tokens_shape=(2, 3, 4), audio_tokens=5)
    extra = prepare((), kwargs)
    want_v = model.rope.prepare_video_coords(2, 2, 3, 4, torch.device("cpu"), fps=24.0)
    want_a = model.audio_rope.prepare_audio_coords(2, 5, torch.device("cpu"))
    assert torch.equal(extra["video_coords"], want_v) and torch.equal(extra["audio_coords"], want_a)
    # given coords (keyword or positional) are left alone
    assert "video_coords" not in prepare((), {**kwargs, "video_coords": want_v})
    kwargs_fps = {**kwargs, "fps": 12.0}
    assert not torch.equal(prepare((), kwargs_fps)["video_coords"], want_v)


def test_ltx2_forward_through_the_runner_matches_eager(tiny_ltx2):
    from bitfuse.models.ltx2_configs import make_inputs

    model = tiny_ltx2
    runner = graphs.runner_for_model(model, backend=EmulatedGraphBackend())
    seen = []
    inner = runner.fn

    def spy(*args, **kwargs):
        seen.append("video_coords" in kwargs and "audio_coords" in kwargs)
        return inner(*args, **kwargs)

    runner.fn = spy
    for seed in range(2):
        kwargs = make_inputs(model, batch=1, seed=seed, per_token=bool(seed))
        ref = model(**kwargs)
        out = runner(**kwargs)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        ref_d = model(**{**kwargs, "return_dict": True})
        out_d = runner(**{**kwargs, "return_dict": True})
        assert torch.equal(out_d.sample, ref_d.sample) and torch.equal(out_d.audio_sample, ref_d.audio_sample)
    assert seen and all(seen)


# ---------------------------------------------------------------- wrapping a model


class Handle:
    """The three handle shapes wrap_model_for_graphs knows: "graphs" (LTX2Handle's
    contract: restore() calls handle.graphs.restore() first), "callbacks" (a
    _restore_callbacks list) and "plain" (only a restore())."""

    def __init__(self, model, style: str):
        self.model = model
        self.restored = 0
        if style == "graphs":
            self.graphs = None
        elif style == "callbacks":
            self._restore_callbacks = []

    def restore(self):
        if getattr(self, "graphs", None) is not None:
            self.graphs.restore()
            self.graphs = None
        for fn in reversed(getattr(self, "_restore_callbacks", [])):
            fn()
        self.restored += 1


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, *, double=False):
        y = self.lin(x)
        return y * 2 if double else y


@pytest.mark.parametrize("style", ["graphs", "callbacks", "plain"])
def test_wrap_and_restore(style):
    import inspect

    model = Toy()
    handle = Handle(model, style)
    runner = graphs.wrap_model_for_graphs(handle, backend=EmulatedGraphBackend(), max_graphs=3)
    assert graphs.graph_runner_of(model) is runner and runner.max_graphs == 3
    if style == "graphs":
        assert handle.graphs is runner
    x = torch.randn(2, 4)
    assert torch.equal(model(x, double=True), Toy.forward(model, x, double=True))
    assert runner.backend.captures == 1
    assert "double" in inspect.signature(model.forward).parameters  # pipelines inspect forward's parameters
    handle.restore()
    assert handle.restored == 1
    assert "forward" not in model.__dict__ and graphs.graph_runner_of(model) is None
    assert not runner.enabled and len(runner) == 0 and runner.backend.released == 1
    model(x)
    assert runner.backend.captures == 1  # no longer routed through the runner
    handle.restore()  # a second restore is harmless
    assert handle.restored == 2


def test_runner_restore_unwraps_the_model():
    model = Toy()
    runner = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    runner.restore()
    assert "forward" not in model.__dict__ and not runner.enabled
    runner.restore()  # idempotent


@pytest.mark.skipif(not HAS_DIFFUSERS, reason="needs diffusers")
def test_accelerate_with_cuda_graphs_wires_the_runner(tiny_ltx2):
    """bitfuse.accelerate(..., cuda_graphs=True, **graph_options) -> wrap_model_for_graphs."""
    from bitfuse.models.ltx2_configs import make_inputs

    model = tiny_ltx2
    kwargs = make_inputs(model, batch=1)
    ref = model(**kwargs)
    handle = bitfuse.accelerate(model, cuda_graphs=True, backend=EmulatedGraphBackend(), max_graphs=5)
    try:
        runner = handle.graphs
        assert isinstance(runner, GraphRunner) and graphs.graph_runner_of(model) is runner
        assert runner.max_graphs == 5
        out = model(**kwargs)
        out = model(**kwargs)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert runner.backend.captures == 1 and runner.report()["signatures"][0]["hits"] == 1
        assert "'lossless'" in runner.report()["signatures"][0]["signature"]  # the mounted tier is keyed
    finally:
        handle.restore()
    assert "forward" not in model.__dict__ and not runner.enabled


def test_wrap_keeps_an_instance_forward_set_by_someone_else():
    model = Toy()
    own = lambda x: x - 1  # noqa: E731
    model.forward = own
    graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    assert torch.equal(model(torch.ones(2)), torch.zeros(2))
    assert graphs.unwrap_model_for_graphs(model)
    assert model.__dict__["forward"] is own
    assert not graphs.unwrap_model_for_graphs(model)


def test_wrapping_twice_replaces_the_runner():
    model = Toy()
    first = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    second = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    assert not first.enabled and graphs.graph_runner_of(model) is second
    x = torch.randn(1, 4)
    assert torch.equal(model(x), Toy.forward(model, x))
    graphs.unwrap_model_for_graphs(model)
    assert "forward" not in model.__dict__


# ---------------------------------------------------------------- bench helper


def test_bench_graphs_reports_equality_and_times():
    model = Toy()
    x = torch.randn(3, 4)
    result = graphs.bench_graphs(model, {"x": x}, iters=3, warmup_iters=1, backend=EmulatedGraphBackend())
    assert result["equal"] is True and result["graphed"] is True
    assert result["eager_ms"] > 0 and result["graph_ms"] > 0 and result["first_call_s"] > 0
    assert result["report"]["captures"] == 1
