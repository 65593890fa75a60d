"""GraphRunner bookkeeping on CPU: signatures, LRU, tiers, output cloning,
capture-failure fallback, static buffers, graph breaks and their paths, hoisted
values, LTX-2 (stock with its coordinates `prepare`, accelerated with its hoist,
with and without a perturbation mask), wrap/restore.

The capture mechanism is swapped for EmulatedGraphBackend, which records the aten
ops of a capture and replays them on the capture's own tensors, writing into the
static outputs in place, as a CUDA graph replay does (Python does not run at
replay); a missing input copy, a break result not copied back or a missing output
clone shows up here exactly as it would on the GPU, and so does a host sync inside
a capture."""

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
from bitfuse.numerics import same_bits  # noqa: E402

HAS_DIFFUSERS = importlib.util.find_spec("diffusers") is not None


class Recording(EmulatedGraphBackend):
    """Emulated backend that logs the graphs it captured and released."""

    def __init__(self):
        super().__init__()
        self.log = []

    def end(self, graph):
        super().end(graph)
        graph.label = self.captures - 1
        self.log.append(("capture", graph.label))

    def release(self, graph):
        self.log.append(("release", graph.label))
        super().release(graph)


class FailingCapture(EmulatedGraphBackend):
    """Capture ends with the pair of errors torch raises when a forward syncs with the host."""

    def __init__(self, fail_when=lambda: True):
        super().__init__()
        self.attempts = 0
        self.fail_when = fail_when

    def end(self, graph):
        super().end(graph)
        self.attempts += 1
        if self.fail_when():
            try:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            except RuntimeError as inner:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from inner


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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one intra-op thread (and CI cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    assert same_bits(out, x + 1)
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
    def fn(x):  # the tier picks the computation, as it picks kernels; a replay can't see it
        return x * (3 if policy.requested_quality() == "high" else 2)

    runner = runner_of(fn, warmup=0)
    x = torch.ones(2)
    for _ in range(2):
        assert same_bits(runner(x), x * 2)
        with bitfuse.quality("high"):
            assert same_bits(runner(x), x * 3)
    assert runner.backend.captures == 2
    rows = runner.report()["signatures"]
    assert sorted(r["hits"] for r in rows) == [1, 1]


def test_context_is_part_of_the_signature():
    """A model's integration passes its mounted tiers as `context` (test_install checks that)."""
    state = {"tier": "lossless"}

    def fn(x):
        return x + (1 if state["tier"] == "lossless" else 2)

    runner = runner_of(fn, warmup=0, context=lambda: state["tier"])
    x = torch.zeros(2)
    assert same_bits(runner(x), x + 1) and same_bits(runner(x), x + 1)
    state["tier"] = "high"
    assert same_bits(runner(x), x + 2)
    state["tier"] = "lossless"
    assert same_bits(runner(x), x + 1)
    assert runner.backend.captures == 2
    contexts = {row["signature"].split("context=")[1] for row in runner.report()["signatures"]}
    assert len(contexts) == 2


# ---------------------------------------------------------------- capture and replay


def test_warmup_runs_before_capture_then_replays():
    fn = Counting()
    runner = runner_of(fn, warmup=2)
    x = torch.randn(3, 4)
    out = runner(x)
    # 2 warmups + 1 capture; the capture's replay gives the first result
    assert fn.calls == 3 and runner.backend.captures == 1 and runner.backend.replays == 1
    assert same_bits(out, fn(x))
    fn.calls = 0
    y = torch.randn(3, 4)
    assert same_bits(runner(y), y * 2.0 + fn.bias)
    assert fn.calls == 0 and runner.backend.captures == 1  # a replay runs no Python


def test_new_input_values_give_new_outputs():
    fn = Counting()
    runner = runner_of(fn)
    for seed in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
        assert same_bits(runner(x, scale=0.5), x * 0.5 + fn.bias)
    assert runner.backend.captures == 1
    assert same_bits(runner(x, scale=3.0), x * 3.0 + fn.bias)  # another value: another graph
    assert runner.backend.captures == 2


def test_outputs_are_clones_not_overwritten_by_later_replays():
    runner = runner_of(lambda x: (x * 2, {"y": x + 1}))
    a, b = torch.ones(3), torch.full((3,), 5.0)
    out_a = runner(a)
    out_b = runner(b)
    assert same_bits(out_a[0], a * 2) and same_bits(out_a[1]["y"], a + 1)
    assert same_bits(out_b[0], b * 2) and same_bits(out_b[1]["y"], b + 1)
    assert out_a[0].data_ptr() != out_b[0].data_ptr()
    static = runner._graphs[runner.keys()[0]].paths[0].out_leaves
    assert all(t.data_ptr() != s.data_ptr() for t in (out_a[0], out_b[0]) for s in static)


def test_reuse_outputs_returns_the_static_outputs():
    runner = runner_of(lambda x: x * 2, reuse_outputs=True)
    a, b = torch.ones(3), torch.full((3,), 5.0)
    out_a = runner(a)
    assert same_bits(out_a, a * 2)
    out_b = runner(b)
    assert out_a.data_ptr() == out_b.data_ptr()
    assert same_bits(out_a, b * 2)  # overwritten, as documented


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
    assert same_bits(got.a.sample, x + 1) and same_bits(got.a.extra[0], x * 2) and got.a.extra[1] == "tag"
    assert got.a.n == 7
    assert same_bits(got.b[0], x - 1) and got.b[1] is None


@pytest.mark.skipif(not HAS_DIFFUSERS, reason="needs diffusers")
def test_diffusers_model_output_is_rebuilt():
    from diffusers.models.transformers.transformer_ltx2 import AudioVisualModelOutput

    runner = runner_of(lambda x: AudioVisualModelOutput(sample=x * 2, audio_sample=x + 1))
    runner(torch.zeros(2))
    x = torch.randn(2)
    out = runner(x)
    assert isinstance(out, AudioVisualModelOutput)
    assert same_bits(out.sample, x * 2) and same_bits(out["audio_sample"], x + 1)
    assert same_bits(out[0], x * 2)  # BaseOutput's tuple view is rebuilt too


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
    assert same_bits(runner(t2, s2), t2 * s2)


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
    assert same_bits(runner(b), b + 1)


def test_evicted_graph_drops_its_buffers():
    runner = runner_of(lambda x: x * 2, max_graphs=1, warmup=0)
    runner(torch.zeros(2))
    first = runner._graphs[runner.keys()[0]]
    runner(torch.zeros(3))
    assert first.paths == [] and first.inputs == [] and first.call is None
    assert runner.backend.released == 1


def test_graphs_released_without_a_replay_are_announced_once():
    """Calls that never repeat a signature (here a new length each time) pay a capture
    each and replay none: after UNUSED_EVICTIONS such evictions in a row, one warning."""
    runner = runner_of(lambda x: x * 2, max_graphs=2, warmup=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphs.GraphCaptureWarning)
        for n in range(1, 2 + runner.UNUSED_EVICTIONS):  # 2 kept, UNUSED_EVICTIONS - 1 evicted
            runner(torch.zeros(n))
    with pytest.warns(graphs.GraphCaptureWarning, match="released without a replay") as caught:
        for n in range(2 + runner.UNUSED_EVICTIONS, 12):
            assert same_bits(runner(torch.ones(n)), torch.full((n,), 2.0))
    assert len(caught) == 1 and runner.counts["evictions"] == 12 - 3


def test_graphs_replayed_before_release_are_not_announced():
    """The same number of evictions, each graph replayed first: no warning."""
    runner = runner_of(lambda x: x * 2, max_graphs=2, warmup=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphs.GraphCaptureWarning)
        for n in range(1, 12):
            runner(torch.zeros(n))
            runner(torch.zeros(n))
    assert runner.counts["evictions"] == 12 - 3 and runner.counts["replays"] == 2 * 11


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
    assert same_bits(runner(x), fn(x)) and fn.calls == 2 and runner.backend.captures == 2


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
    assert same_bits(out, x * 2.0 + fn.bias)
    text = str(record[0].message)
    assert "operation not permitted when stream is capturing" in text  # the root cause
    assert "previous error during capture" in text
    assert "runs eagerly" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            x = torch.randn(2, 4)
            assert same_bits(runner(x), x * 2.0 + fn.bias)
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
    assert same_bits(runner(y), y + 1)
    assert backend.attempts == 2 and runner.report()["captures"] == 1 and len(runner) == 1


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
    assert same_bits(runner(torch.zeros(2)), torch.ones(2))  # tried again, captured


def test_rejected_inputs_run_eagerly_once_warned():
    # the real backend refuses CPU tensors (their values would be baked into a graph)
    runner = GraphRunner(lambda x: x + 1)
    with pytest.warns(GraphCaptureWarning, match="CUDA"):
        out = runner(torch.zeros(2))
    assert same_bits(out, torch.ones(2))
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
    assert same_bits(x.grad, torch.full((2,), 2.0))


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
        assert same_bits(runner(x), x + 10)
    runner(torch.randn(4))
    assert prepared == [torch.Size([3]), torch.Size([4])]
    assert runner.report()["signatures"][0]["constant_bytes"] == 12


# ---------------------------------------------------------------- the emulator


def test_emulated_replay_reruns_the_recorded_ops_on_the_capture_tensors():
    """What a graph does: the ops, on the capture's memory; not the Python around them."""
    backend = EmulatedGraphBackend()
    x = torch.ones(3)
    python_side = [2.0]
    graph = backend.begin(x.device, None, [x])
    y = x * python_side[0]  # the Python value is baked in, as a kernel argument would be
    z = y.view(3, 1).expand(3, 2) + 1  # views and broadcasts
    z.add_(x[:, None])  # in place
    backend.end(graph)
    assert same_bits(z, torch.full((3, 2), 4.0))
    x.fill_(5.0)
    python_side[0] = 100.0
    backend.replay(graph)
    assert same_bits(y, torch.full((3,), 10.0)) and same_bits(z, torch.full((3, 2), 16.0))


def test_emulated_capture_refuses_host_reads_of_input_dependent_values():
    backend = EmulatedGraphBackend()
    x, weight = torch.ones(3), torch.ones(3)
    graph = backend.begin(x.device, None, [x])
    try:
        assert bool((weight * 2).sum() > 0)  # a constant: allowed (baked, like a host tensor on the GPU)
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            bool((x * 2).sum() > 0)
        with pytest.raises(RuntimeError, match="not permitted"):
            same_bits(x + 1, weight)
    finally:
        backend.abort(graph, x.device)
    assert not backend.capturing()


def test_a_host_sync_in_the_function_fails_capture_and_runs_eagerly():
    def fn(x):
        return x + 1 if bool(x.sum() > 0) else x - 1  # the branch diffusers' STG takes

    runner = runner_of(fn)
    x = torch.ones(3)
    with pytest.warns(GraphCaptureWarning, match="not permitted when stream is capturing"):
        assert same_bits(runner(x), x + 1)
    assert same_bits(runner(-x), -x - 1)
    assert runner.report()["capture_failures"] == 1 and runner.report()["graphs"] == 0


# ---------------------------------------------------------------- hoisted values


def test_hoisted_values_join_the_signature_and_reach_the_function():
    computed = []

    def hoist(args, kwargs):
        computed.append(1)
        return {"positive": bool(args[0].sum() > 0)}  # the sync, outside capture

    def fn(x):
        return x + 1 if graphs.hoisted("positive") else x - 1

    runner = runner_of(fn, hoist=hoist)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCaptureWarning)
        for seed in range(3):
            x = torch.rand(3, generator=torch.Generator().manual_seed(seed)) + 0.1
            assert same_bits(runner(x), x + 1)
            assert same_bits(runner(-x), -x - 1)
    report = runner.report()
    assert report["captures"] == 2 and report["graphs"] == 2 and len(computed) == 6
    assert all(row["segments"] == 1 for row in report["signatures"])
    assert {"True" in row["signature"] for row in report["signatures"]} == {True, False}
    assert graphs.hoisted("positive", "outside") == "outside"


# ---------------------------------------------------------------- graph breaks


def test_graph_break_outside_a_capture_is_the_call():
    assert graphs.graph_break(lambda a, b=0: a + b, 1, b=2) == 3


def test_graph_break_splits_the_capture_and_replays_the_segments():
    """A break's tensor result is a static buffer the next segment reads: refilled at
    every replay (a stale one would give the first call's value)."""
    breaks = []

    def total(t):
        breaks.append(1)
        return t.sum(dim=-1, keepdim=True)

    def fn(x):
        y = x * 2
        s = graphs.graph_break(total, y)
        return y + s

    runner = runner_of(fn, warmup=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCaptureWarning)
        for seed in range(4):
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))
            assert same_bits(runner(x), fn(x))
    assert runner.backend.captures == 2  # two segments, captured once
    (row,) = runner.report()["signatures"]
    assert row["segments"] == 2 and row["paths"] == [{"segments": 2, "breaks": 1, "hits": 3}]
    assert row["break_bytes"] == 2 * 4
    # per call: the break ran once (warmup + capture, then once per replay), plus fn(x) eagerly
    assert len(breaks) == 2 + 3 + 4


def test_a_break_that_steers_the_forward_keeps_one_graph_per_path():
    """A break's plain value is the path: a replay whose break returns another value
    never finishes on the captured graph; it switches to (or captures) its own path,
    and past max_paths it runs eagerly. Every call is exact."""

    def positive(t):
        return bool(t.sum() > 0)

    def fn(x):
        y = x * 3
        return y + 1 if graphs.graph_break(positive, y) else y - 1

    def eager(x):
        return x * 3 + 1 if bool((x * 3).sum() > 0) else x * 3 - 1

    runner = runner_of(fn, warmup=0, max_paths=2)
    signs = [1, -1, 1, 1, -1, -1, 1]
    for i, sign in enumerate(signs):
        x = sign * (torch.rand(4, generator=torch.Generator().manual_seed(i)) + 0.1)
        assert same_bits(runner(x), eager(x)), i
    report = runner.report()
    (row,) = report["signatures"]
    assert len(row["paths"]) == 2 and report["captures"] == 2 and report["eager"] == 0
    assert sorted(p["hits"] for p in row["paths"]) == [2, 3]  # 7 calls: 2 captures, 5 replays
    assert report["divergences"] == 4  # each change of sign after the first tries the last path first

    single = runner_of(fn, warmup=0, max_paths=1)
    for i, sign in enumerate(signs):
        x = sign * (torch.rand(4, generator=torch.Generator().manual_seed(i)) + 0.1)
        assert same_bits(single(x), eager(x)), i
    report = single.report()
    assert report["captures"] == 1 and report["eager"] == 3  # the other sign: eager, never a stale graph


def test_a_break_result_of_another_shape_is_another_path():
    def nonzero(t):
        return t.nonzero()  # data-dependent shape (a host sync on the GPU)

    def fn(x):
        idx = graphs.graph_break(nonzero, x)
        return idx * 2

    runner = runner_of(fn, warmup=0)
    for x in (torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 3.0, 4.0])):
        assert same_bits(runner(x), x.nonzero() * 2)
    report = runner.report()
    # 2, 1 then 2 indices: the third call replays the first path, with its own indices copied in
    assert report["captures"] == 2 and report["replays"] == 3 and report["divergences"] == 2


def test_breaks_in_a_nested_break_run_directly():
    def inner(t):
        return graphs.graph_break(lambda u: u + 1, t) * 2

    def fn(x):
        return graphs.graph_break(inner, x * 2) - 1

    runner = runner_of(fn, warmup=0)
    for v in (1.0, 2.0):
        x = torch.full((2,), v)
        assert same_bits(runner(x), (x * 2 + 1) * 2 - 1)
    assert runner.report()["signatures"][0]["segments"] == 2


# ---------------------------------------------------------------- LTX-2


@pytest.fixture(scope="module")
def tiny_ltx2():
    if not HAS_DIFFUSERS:
        pytest.skip("needs diffusers")
    from bitfuse.models.ltx2_configs import build_model, tiny_config

    return build_model(tiny_config("2.3"), dtype=torch.float32)


def _ltx2_inputs(model, seed, **options):
    from bitfuse.models.ltx2_configs import make_inputs

    return make_inputs(model, batch=2, seed=seed, per_token=bool(seed % 2), **options)


def _equal(a, b) -> bool:
    la, lb = graphs._leaves_of(a), graphs._leaves_of(b)
    return len(la) == len(lb) and all(x.shape == y.shape and same_bits(x, y) for x, y in zip(la, lb))


def test_ltx2_stock_coords_are_precomputed_exactly_as_the_forward_would(tiny_ltx2):
    from bitfuse.models import ltx2

    model = tiny_ltx2
    prepare = ltx2.stock_graph_options(model)["prepare"]
    kwargs = _ltx2_inputs(model, 0, video_tokens_shape=(2, 3, 4), audio_tokens=5)
    extra = prepare((), kwargs)
    want_v = model.rope.prepare_video_coords(2, 2, 3, 4, torch.device("cpu"), fps=24.0)
    want_a = model.audio_rope.prepare_audio_coords(2, 5, torch.device("cpu"))
    assert same_bits(extra["video_coords"], want_v) and same_bits(extra["audio_coords"], want_a)
    # given coords (keyword or positional) are left alone
    assert "video_coords" not in prepare((), {**kwargs, "video_coords": want_v})
    assert not same_bits(prepare((), {**kwargs, "fps": 12.0})["video_coords"], want_v)


def test_ltx2_stock_forward_through_the_runner_matches_eager(tiny_ltx2):
    from bitfuse.models import ltx2

    model = tiny_ltx2
    runner = GraphRunner(model.forward, backend=EmulatedGraphBackend(), **ltx2.stock_graph_options(model))
    seen = []
    inner = runner.fn

    def spy(*args, **kwargs):
        seen.append("video_coords" in kwargs and "audio_coords" in kwargs)
        return inner(*args, **kwargs)

    runner.fn = spy
    for seed in range(2):
        kwargs = _ltx2_inputs(model, seed)
        assert _equal(runner(**kwargs), model(**kwargs))
        kwargs = {**kwargs, "return_dict": True}
        out, ref = runner(**kwargs), model(**kwargs)
        assert type(out) is type(ref) and _equal(out, ref)
    assert seen and all(seen)


def test_ltx2_stock_forward_with_a_mask_syncs_inside_so_runs_eagerly(tiny_ltx2):
    """Why the accelerated forward hoists the STG branch: diffusers' forward branches
    on `torch.all(mask == 0)` inside (the emulator refuses it, as CUDA does)."""
    from bitfuse.models import ltx2

    model = tiny_ltx2
    runner = GraphRunner(model.forward, backend=EmulatedGraphBackend(), **ltx2.stock_graph_options(model))
    kwargs = _ltx2_inputs(model, 0, stg_blocks=[1], perturbation_mask=torch.tensor([0.0, 1.0]))
    with pytest.warns(GraphCaptureWarning, match="not permitted when stream is capturing"):
        out = runner(**kwargs)
    assert _equal(out, model(**kwargs)) and runner.report()["graphs"] == 0


STG_CASES = [  # (label, options): no STG, STG without a mask (diffusers perturbs all), mixed, all, none perturbed
    ("plain", {}),
    ("stg-default", {"stg_blocks": [1]}),
    ("mixed", {"stg_blocks": [0, 1], "perturbation_mask": torch.tensor([0.0, 1.0])}),
    ("all", {"stg_blocks": [1], "perturbation_mask": torch.tensor([0.0, 0.0])}),
    ("none", {"stg_blocks": [1], "perturbation_mask": torch.tensor([1.0, 1.0])}),
]


def test_accelerated_ltx2_graphs_with_and_without_a_mask_are_one_segment(tiny_ltx2):
    """accelerate(cuda_graphs=True): the STG branch (`torch.all(mask == 0)`) is computed
    per call before the graph (the handle's hoist), so every forward captures whole,
    with or without a perturbation mask, and equals stock diffusers."""
    model = tiny_ltx2
    refs = {(label, seed): model(**_ltx2_inputs(model, seed, **o)) for label, o in STG_CASES for seed in range(2)}
    handle = bitfuse.accelerate(model, cuda_graphs=True, backend=EmulatedGraphBackend(), warmup=1, max_graphs=16)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", GraphCaptureWarning)
            for seed in range(2):
                for label, options in STG_CASES:
                    out = model(**_ltx2_inputs(model, seed, **options))
                    assert _equal(out, refs[label, seed]), (label, seed)
        report = handle.graphs.report()
        assert report["capture_failures"] == 0 and report["eager"] == 0 and report["divergences"] == 0
        rows = report["signatures"]
        assert all(row["segments"] == 1 for row in rows)
        # one signature per case and shape (per-sample, per-token); the STG ones carry the branch's truth
        truths = [("'all_perturbed', True" in r["signature"], "'all_perturbed', False" in r["signature"]) for r in rows]
        assert len(rows) == 10 and truths.count((True, False)) == 4 and truths.count((False, True)) == 4
    finally:
        handle.restore()


def test_accelerated_ltx2_without_the_hoist_breaks_the_graph_at_the_mask(tiny_ltx2):
    """A runner around the accelerated forward without the integration's hoist: the
    forward's `graph_break` at the STG branch splits it in two segments; a mask whose
    truth flips at the same shapes takes the other path. Always equal to stock."""
    model = tiny_ltx2
    masks = [[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    kwargs = [_ltx2_inputs(model, 0, stg_blocks=[1], perturbation_mask=torch.tensor(m)) for m in masks]
    refs = [model(**kw) for kw in kwargs]
    with bitfuse.accelerate(model):
        runner = GraphRunner(model.forward, backend=EmulatedGraphBackend(), warmup=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", GraphCaptureWarning)
            for i, (kw, ref) in enumerate(zip(kwargs, refs)):
                assert _equal(runner(**kw), ref), masks[i]
    report = runner.report()
    (row,) = report["signatures"]
    assert row["segments"] == 2 and [p["segments"] for p in row["paths"]] == [2, 2]
    assert report["captures"] == 2 and report["divergences"] == 2 and report["eager"] == 0


def test_accelerate_with_cuda_graphs_wires_the_runner(tiny_ltx2):
    """bitfuse.accelerate(..., cuda_graphs=True, **graph_options): the handle keeps the
    runner (with the model's mounted tiers and hoist) and restores it first."""
    model = tiny_ltx2
    kwargs = _ltx2_inputs(model, 0)
    ref = model(**kwargs)
    handle = bitfuse.accelerate(model, cuda_graphs=True, backend=EmulatedGraphBackend(), max_graphs=5)
    try:
        runner = handle.graphs
        assert isinstance(runner, GraphRunner) and graphs.graph_runner_of(model) is runner
        assert runner.max_graphs == 5 and runner.hoist is not None
        out = model(**kwargs)
        out = model(**kwargs)
        assert _equal(out, ref)
        assert runner.backend.captures == 1 and runner.report()["signatures"][0]["hits"] == 1
        assert "'lossless'" in runner.report()["signatures"][0]["signature"]  # the mounted tier is keyed
    finally:
        handle.restore()
    assert "forward" not in model.__dict__ and not runner.enabled and handle.graphs is None


# ---------------------------------------------------------------- wrapping a module


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, *, double=False):
        y = self.lin(x)
        return y * 2 if double else y


def test_wrap_and_restore():
    import inspect

    model = Toy()
    runner = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend(), max_graphs=3)
    assert graphs.graph_runner_of(model) is runner and runner.max_graphs == 3 and runner.name == "Toy.forward"
    x = torch.randn(2, 4)
    assert same_bits(model(x, double=True), Toy.forward(model, x, double=True))
    assert runner.backend.captures == 1
    assert "double" in inspect.signature(model.forward).parameters  # pipelines inspect forward's parameters
    runner.restore()
    assert "forward" not in model.__dict__ and graphs.graph_runner_of(model) is None
    assert not runner.enabled and len(runner) == 0 and runner.backend.released == 1
    model(x)
    assert runner.backend.captures == 1  # no longer routed through the runner
    runner.restore()  # idempotent


def test_wrap_keeps_an_instance_forward_set_by_someone_else():
    model = Toy()
    own = lambda x: x - 1  # noqa: E731
    model.forward = own
    graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    assert same_bits(model(torch.ones(2)), torch.zeros(2))
    assert graphs.unwrap_model_for_graphs(model)
    assert model.__dict__["forward"] is own
    assert not graphs.unwrap_model_for_graphs(model)


def test_wrapping_twice_replaces_the_runner_and_the_old_restore_leaves_the_new_one():
    model = Toy()
    first = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    second = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    assert not first.enabled and graphs.graph_runner_of(model) is second
    first.restore()
    assert graphs.graph_runner_of(model) is second and second.enabled
    x = torch.randn(1, 4)
    assert same_bits(model(x), Toy.forward(model, x))
    graphs.unwrap_model_for_graphs(model)
    assert "forward" not in model.__dict__


def test_wrap_takes_modules_only():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        graphs.wrap_model_for_graphs(object())


# ---------------------------------------------------------------- parameters that move


def _moved_toy():
    model = Toy()
    runner = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    x = torch.randn(3, 4)
    assert same_bits(model(x), Toy.forward(model, x)) and runner.backend.captures == 1
    return model, runner, x


def test_a_graph_would_read_the_memory_a_moved_parameter_left():
    """The hazard the watch closes: without it, the emulated replay (as a CUDA graph)
    reads the weight where it was at capture, after `.data` moved it (`.to()` and
    offloading do so)."""
    model = Toy()
    graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend(), watch=None)
    x = torch.randn(3, 4)
    model(x)
    model.lin.weight.data = model.lin.weight.data * 2
    with pytest.raises(RuntimeError, match="has moved since"):
        model(x)


def test_a_parameter_moved_since_capture_releases_the_graphs_and_captures_again():
    model, runner, x = _moved_toy()
    model.lin.weight.data = model.lin.weight.data * 2  # new memory, new values
    with pytest.warns(graphs.GraphCaptureWarning, match="moved since its CUDA graphs were captured"):
        out = model(x)
    assert same_bits(out, Toy.forward(model, x))
    assert runner.backend.captures == 2 and runner.backend.released == 1 and runner.counts["moves"] == 1
    assert same_bits(model(x), Toy.forward(model, x)) and runner.backend.captures == 2  # replayed


def test_a_module_replaced_since_capture_releases_the_graphs():
    model, runner, x = _moved_toy()
    model.lin = torch.nn.Linear(4, 4)  # new parameters: the graph would run the old module's
    with pytest.warns(graphs.GraphCaptureWarning, match="moved"):
        assert same_bits(model(x), Toy.forward(model, x))
    assert runner.counts["moves"] == 1 and runner.backend.captures == 2


def test_a_buffer_is_watched_too():
    model, runner, x = _moved_toy()
    model.register_buffer("offset", torch.ones(4))  # a new buffer: the watched set changed
    with pytest.warns(graphs.GraphCaptureWarning):
        model(x)
    assert runner.counts["moves"] == 1
    model.offset.data = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", graphs.GraphCaptureWarning)
        model(x)
    assert runner.counts["moves"] == 2


def test_registrations_elsewhere_and_in_place_writes_keep_the_graphs():
    """A module built elsewhere makes the runner look at its model again (the same
    tensors in the same places: the graphs stay); an in-place write to a weight keeps
    its address, and the replay reads the new values, as eager would."""
    model, runner, x = _moved_toy()
    other = torch.nn.Linear(4, 4)  # registrations anywhere in the process
    model.lin.weight.mul_(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphs.GraphCaptureWarning)
        assert same_bits(model(x), Toy.forward(model, x))
    assert runner.counts["moves"] == 0 and runner.backend.captures == 1 and other.weight.numel() == 16


def test_parameters_that_move_on_every_call_turn_graphs_off():
    """A model offloaded between calls: after MAX_MOVES moves the runner stops capturing
    and the forward runs as it is (every output still the eager one)."""
    model, runner, x = _moved_toy()
    with pytest.warns(graphs.GraphCaptureWarning) as caught:
        for i in range(runner.MAX_MOVES + 2):
            for p in model.parameters():
                p.data = p.data.clone()  # an offload cycle: the same values, new memory
            assert same_bits(model(x), Toy.forward(model, x))
    assert runner.counts["moves"] == runner.MAX_MOVES and not runner.enabled
    report = runner.report()
    assert report["moves"] == runner.MAX_MOVES and report["enabled"] is False and report["graphs"] == 0
    assert runner.backend.captures == runner.MAX_MOVES  # the first, then one after each move but the last
    assert any("off for it from now on" in str(w.message) for w in caught)


def test_parameters_left_off_the_device_run_eagerly_without_a_capture():
    """A model offloaded between calls (diffusers' group offloading takes each block's
    weights back to the CPU after the block runs): after the warm-up the runner does not
    try a capture that would copy them in, and says why (the emulated backend's device
    is the CPU; a buffer on the meta device stands for the weights left behind)."""
    model = Toy()
    model.register_buffer("left_behind", torch.empty(2, device="meta"))
    runner = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    x = torch.randn(3, 4)
    with pytest.warns(graphs.GraphCaptureWarning, match=r"1 of the parameters and buffers .* are on meta after"):
        assert same_bits(model(x), Toy.forward(model, x))
    assert same_bits(model(x), Toy.forward(model, x))
    assert runner.backend.captures == 0 and runner.counts["eager"] == 2 and runner.counts["capture_failures"] == 0


def test_parameters_a_hook_brings_over_in_the_warm_up_are_captured():
    """A forward wrapped by a hook that moves the model onto the device first (accelerate's
    model CPU offload, set before bitfuse): the warm-up runs the hook, the capture reads
    the weights where it left them, and later calls replay."""
    model = Toy()
    model.register_buffer("held", torch.empty(2, device="meta"))
    inner = model.forward

    def onload_then_forward(x):
        if model.held.device.type == "meta":
            model.held = torch.zeros(2)  # the weights brought onto the device, kept there
        return inner(x)

    model.forward = onload_then_forward
    runner = graphs.wrap_model_for_graphs(model, backend=EmulatedGraphBackend())
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphs.GraphCaptureWarning)
        for _ in range(3):
            assert same_bits(model(x), Toy.forward(model, x))
    assert runner.backend.captures == 1 and runner.counts["replays"] == 3 and runner.counts["eager"] == 0


# ---------------------------------------------------------------- bench/graphs.py


def _bench_graphs():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "graphs.py"
    spec = importlib.util.spec_from_file_location("bench_graphs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_graphs_reports_equality_and_times():
    bench = _bench_graphs()
    model = Toy()
    x = torch.randn(3, 4)
    result = bench.bench_graphs(model, {"x": x}, iters=3, warmup_iters=1, backend=EmulatedGraphBackend())
    assert result["equal"] is True and result["graphed"] is True
    assert result["eager_ms"] > 0 and result["graph_ms"] > 0 and result["first_call_s"] > 0
    assert result["report"]["captures"] == 1
