"""CUDA graphs for a whole forward: capture once per call signature, replay after.

    runner = GraphRunner(fn)            # fn: any callable of tensors and plain values
    out = runner(*args, **kwargs)       # first sight: warm up, capture, replay
    out = runner(*args2, **kwargs2)     # same signature: copy inputs in, replay

    handle = bitfuse.accelerate(model, cuda_graphs=True, max_graphs=4)
    handle.graphs                       # the GraphRunner (wrap_model_for_graphs(handle) does this)
    handle.restore()                    # also removes the graph wrapper

The signature of a call is its tensors' (shape, stride, dtype, device, 16-byte
alignment), every other argument by value, and the context that picks kernels:
the quality tier requested by `bitfuse.quality(...)`, the tiers mounted on the
model's sites, BITFUSE_DISABLE/BITFUSE_VERIFY, grad and inference mode. A graph
captured under one tier never replays under another.

First sight of a signature: the inputs are copied into static buffers with the
same strides and alignment, `fn` runs eagerly `warmup` times on a side stream
outside capture (every first-sight gate in bitfuse reaches its verdict there, so
capture records verified fast paths, see policy.gated), then `fn` is captured
into a `torch.cuda.CUDAGraph` and replayed. Later calls copy their inputs into
the static buffers, replay, and return clones of the static outputs (a later
replay overwrites the static outputs; `reuse_outputs=True` returns them as is).

What can go wrong is contained per signature: if capture raises, a
GraphCaptureWarning carries the exception text and that signature runs eagerly
for the rest of the runner's life. Graphs are kept in an LRU of `max_graphs`
entries; an evicted graph's memory (its pool, static inputs and outputs) is
released. `runner.report()` lists per-signature memory and hit counts.

The capture/replay mechanism is a small object (`CUDAGraphBackend`); tests
inject `EmulatedGraphBackend` (or a failing one) to check all the bookkeeping
on CPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import gc
import inspect
import statistics
import threading
import time
import warnings
from typing import Any, Callable

import torch

from . import policy

__all__ = [
    "GraphRunner",
    "GraphCaptureWarning",
    "CUDAGraphBackend",
    "EmulatedGraphBackend",
    "UnsupportedInput",
    "signature_of",
    "runner_for_model",
    "wrap_model_for_graphs",
    "unwrap_model_for_graphs",
    "graph_runner_of",
    "ltx2_coords_prepare",
    "bench_graphs",
]

_ALIGN = 16  # bytes; Triton specialises pointers on 16-byte divisibility, aten vectorises on it


class GraphCaptureWarning(UserWarning):
    """A forward could not be captured (or replayed) as a CUDA graph; it runs eagerly."""


class UnsupportedInput(TypeError):
    """An argument the signature cannot key by value (the call then runs eagerly)."""


# ---------------------------------------------------------------- signatures

# tags (identity-hashed sentinels) for the hashable spec of a call
_TENSOR = object()
_TUPLE = object()
_LIST = object()
_DICT = object()
_NAMEDTUPLE = object()
_FLOAT = object()
_CONST = object()

_PRIMITIVES = (type(None), bool, int, str, bytes)
_CONST_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum, type(Ellipsis), frozenset)


def _tensor_meta(x: torch.Tensor) -> tuple:
    if x.layout is not torch.strided:
        raise UnsupportedInput(f"a {x.layout} tensor (only strided tensors can be static graph inputs)")
    # alignment: a kernel may take another path (other bits) for a misaligned pointer,
    # so the static buffer reproduces it and the signature keys on it
    return (_TENSOR, tuple(x.shape), x.stride(), x.dtype, x.device, x.data_ptr() % _ALIGN)


def _spec(obj, leaves: list) -> tuple:
    """Hashable description of `obj` with every tensor replaced by its metadata
    (the tensors themselves are appended to `leaves`, in order)."""
    t = type(obj)
    if t is torch.Tensor or isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _tensor_meta(obj)
    if t in _PRIMITIVES:
        return (t, obj)  # the type keeps True apart from 1
    if t is float:
        return (_FLOAT, obj.hex())  # stable for nan, distinguishes -0.0
    if t is tuple:
        return (_TUPLE, tuple(_spec(v, leaves) for v in obj))
    if t is list:
        return (_LIST, tuple(_spec(v, leaves) for v in obj))
    if t is dict:
        for k in obj:
            if type(k) not in _PRIMITIVES:
                raise UnsupportedInput(f"a dict key of type {type(k).__name__}")
        return (_DICT, tuple((k, _spec(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, tuple) and hasattr(t, "_fields"):
        return (_NAMEDTUPLE, t, tuple(_spec(v, leaves) for v in obj))
    if isinstance(obj, _CONST_TYPES):
        return (_CONST, t, obj)
    if t.__hash__ is not None and t.__hash__ is not object.__hash__ and t.__eq__ is not object.__eq__:
        # a value type that defines its own equality: key by value
        return (_CONST, t, obj)
    raise UnsupportedInput(
        f"an argument of type {t.__module__}.{t.__qualname__} (not a tensor, a plain value, or a container of them)"
    )


def _build(spec: tuple, leaves):
    """Inverse of _spec: rebuild the object, taking tensors from the iterator `leaves`."""
    tag = spec[0]
    if tag is _TENSOR:
        return next(leaves)
    if tag in _PRIMITIVES:
        return spec[1]
    if tag is _FLOAT:
        return float.fromhex(spec[1])
    if tag is _TUPLE:
        return tuple(_build(s, leaves) for s in spec[1])
    if tag is _LIST:
        return [_build(s, leaves) for s in spec[1]]
    if tag is _DICT:
        return {k: _build(s, leaves) for k, s in spec[1]}
    if tag is _NAMEDTUPLE:
        return spec[1](*(_build(s, leaves) for s in spec[2]))
    if tag is _CONST:
        return spec[2]
    raise AssertionError(f"bad spec tag {tag!r}")


def default_context() -> tuple:
    """What decides which kernels a forward runs, besides its arguments."""
    return (
        policy.requested_quality(),
        policy.DISABLED,
        policy.VERIFY_ALWAYS,
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    )


def signature_of(args: tuple, kwargs: dict, context: tuple = ()) -> tuple[tuple, list]:
    """(key, tensors) of a call: a hashable key and the tensor arguments in order.
    kwargs are keyed by name, whatever order they were passed in."""
    leaves: list = []
    a = tuple(_spec(v, leaves) for v in args)
    names = sorted(kwargs)
    k = tuple((n, _spec(kwargs[n], leaves)) for n in names)
    return (a, k, context), leaves


def describe_signature(key: tuple, limit: int = 400) -> str:
    """A readable one-line rendering of a signature key."""

    def render(spec) -> str:
        tag = spec[0]
        if tag is _TENSOR:
            _, shape, stride, dtype, device, align = spec
            contiguous = stride == _contiguous_stride(shape)
            s = f"{str(dtype).replace('torch.', '')}[{','.join(map(str, shape))}]"
            if not contiguous:
                s += f"/s({','.join(map(str, stride))})"
            if align:
                s += f"@+{align}"
            return s if device.type == "cuda" else s + f"@{device}"
        if tag in _PRIMITIVES:
            return repr(spec[1])
        if tag is _FLOAT:
            return repr(float.fromhex(spec[1]))
        if tag in (_TUPLE, _LIST):
            inner = ", ".join(render(s) for s in spec[1])
            return f"({inner})" if tag is _TUPLE else f"[{inner}]"
        if tag is _DICT:
            return "{" + ", ".join(f"{k!r}: {render(s)}" for k, s in spec[1]) + "}"
        if tag is _NAMEDTUPLE:
            return f"{spec[1].__name__}(" + ", ".join(render(s) for s in spec[2]) + ")"
        return repr(spec[2])

    args, kwargs, context = key
    parts = [render(s) for s in args]
    parts += [f"{n}={render(s)}" for n, s in kwargs if not (s[0] is type(None))]
    text = "(" + ", ".join(parts) + f") context={context!r}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


# ---------------------------------------------------------------- static buffers


def _span(x: torch.Tensor) -> int:
    """Elements of storage the tensor reaches, from its first element to its last."""
    if x.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride()))


class _StaticInput:
    """A buffer laid out like the first input of its signature (same shape, strides,
    alignment), refilled by copying the memory span of each new input. Copying the
    span rather than the elements keeps expanded (stride-0) and strided inputs
    exact, and is a plain memcpy for contiguous ones."""

    __slots__ = ("tensor", "flat", "span", "nbytes")

    def __init__(self, x: torch.Tensor):
        self.span = _span(x)
        elsize = x.element_size()
        misalign = x.data_ptr() % _ALIGN
        pad = misalign // elsize if misalign % elsize == 0 else 0
        base = torch.empty(self.span + pad, dtype=x.dtype, device=x.device)
        self.tensor = base.as_strided(x.shape, x.stride(), pad)
        self.flat = base[pad : pad + self.span]
        self.nbytes = base.numel() * elsize
        self.fill(x)

    def fill(self, x: torch.Tensor) -> None:
        if self.span:
            self.flat.copy_(x.as_strided((self.span,), (1,), x.storage_offset()))


# ---------------------------------------------------------------- output structures

_O_TENSOR = object()
_O_TUPLE = object()
_O_NAMEDTUPLE = object()
_O_LIST = object()
_O_DICT = object()
_O_DATACLASS = object()
_O_CONST = object()


def _out_spec(obj, leaves: list):
    """Structure of an output (tensors, tuples, lists, dicts, dataclasses such as
    diffusers' BaseOutput/AudioVisualModelOutput; anything else is kept as is)."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return (_O_TENSOR,)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        return (
            _O_DATACLASS,
            type(obj),
            tuple((f.name, f.init, _out_spec(getattr(obj, f.name), leaves)) for f in fields),
        )
    if isinstance(obj, tuple):
        if hasattr(type(obj), "_fields"):
            return (_O_NAMEDTUPLE, type(obj), tuple(_out_spec(v, leaves) for v in obj))
        return (_O_TUPLE, tuple(_out_spec(v, leaves) for v in obj))
    if isinstance(obj, list):
        return (_O_LIST, tuple(_out_spec(v, leaves) for v in obj))
    if isinstance(obj, dict):
        return (_O_DICT, type(obj), tuple((k, _out_spec(v, leaves)) for k, v in obj.items()))
    return (_O_CONST, obj)


def _out_build(spec, leaves):
    tag = spec[0]
    if tag is _O_TENSOR:
        return next(leaves)
    if tag is _O_TUPLE:
        return tuple(_out_build(s, leaves) for s in spec[1])
    if tag is _O_NAMEDTUPLE:
        return spec[1](*(_out_build(s, leaves) for s in spec[2]))
    if tag is _O_LIST:
        return [_out_build(s, leaves) for s in spec[1]]
    if tag is _O_DICT:
        items = [(k, _out_build(s, leaves)) for k, s in spec[2]]
        try:
            return spec[1](items)
        except Exception:
            return dict(items)
    if tag is _O_DATACLASS:
        values = [(name, init, _out_build(s, leaves)) for name, init, s in spec[2]]
        obj = spec[1](**{name: v for name, init, v in values if init})
        for name, init, v in values:
            if not init:
                object.__setattr__(obj, name, v)
        return obj
    return spec[1]


# ---------------------------------------------------------------- capture backends


class CUDAGraphBackend:
    """Capture and replay with `torch.cuda.CUDAGraph`.

    pool: None gives every graph a private memory pool; a handle from
    `torch.cuda.graph_pool_handle()` (or the runner's "shared" option) makes its
    graphs share one, which the runner allows only when it clones outputs (see
    GraphRunner)."""

    name = "cuda"

    def __init__(self, pool=None, capture_error_mode: str = "global"):
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def capturing(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def rejects(self, tensors: list) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        devices = {t.device for t in tensors}
        bad = sorted(str(d) for d in devices if d.type != "cuda")
        if bad:
            # a CPU value read during capture would be baked into the graph: never capture it
            return f"tensor inputs on {', '.join(bad)} (a CUDA graph takes CUDA tensors only)"
        if len(devices) > 1:
            return f"tensor inputs on several devices ({', '.join(sorted(map(str, devices)))})"
        return None

    def device(self, tensors: list):
        return tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())

    def context(self, device):
        return torch.cuda.device(device)

    # one warmup stream and one capture stream per device for the process: every new
    # stream would get its own cuBLAS workspace (allocated through the caching
    # allocator and kept for good); torch.cuda.graph's default capture stream lives
    # on whichever device was current when it was first used
    _streams: dict = {}

    def _stream(self, role: str, device):
        index = torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        stream = CUDAGraphBackend._streams.get((role, index))
        if stream is None:
            stream = CUDAGraphBackend._streams.setdefault((role, index), torch.cuda.Stream(index))
        return stream

    def warmup(self, call: Callable, n: int, device) -> None:
        if n <= 0:
            return
        main = torch.cuda.current_stream(device)
        side = self._stream("warmup", device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(n):
                call()
        main.wait_stream(side)

    def capture(self, call: Callable, device):
        """(graph, static outputs, memory stats). Raises if capture fails."""
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()  # torch.cuda.graph does this too; do it first so the deltas are clean
        allocated0 = torch.cuda.memory_allocated(device)
        reserved0 = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self._stream("capture", device), capture_error_mode=self.capture_error_mode
            ):
                out = call()
        except BaseException:
            with contextlib.suppress(Exception):
                graph.reset()
            _release_generator(device)
            raise
        leaves: list = []
        _out_spec(out, leaves)
        stray = sorted({str(t.device) for t in leaves if t.device != device})
        if stray:
            graph.reset()
            raise RuntimeError(
                f"outputs on {', '.join(stray)}: work off the capture device is not recorded, "
                "a replay would return values from the capture"
            )
        torch.cuda.synchronize(device)
        stats = {
            "capture_allocated_bytes": torch.cuda.memory_allocated(device) - allocated0,
            "capture_reserved_bytes": torch.cuda.memory_reserved(device) - reserved0,
        }
        return graph, out, stats

    def replay(self, graph) -> None:
        graph.replay()

    def release(self, graph) -> None:
        graph.reset()


def _release_generator(device) -> None:
    """After a failed capture, take the device's default RNG out of capture mode.

    Capture registers the default CUDA generator with the graph; when the capture
    aborts before its end, the generator stays marked as capturing and every later
    random op in the process fails ("Offset increment outside graph capture").
    A clone of its state (same seed and offset) is not marked, so installing it
    restores the generator without changing the random stream."""
    index = torch.device(device).index
    gen = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
    with contextlib.suppress(Exception):
        gen.graphsafe_set_state(gen.clone_state())


class _EmulatedGraph:
    def __init__(self, call, out):
        self.call = call
        leaves: list = []
        self.spec = _out_spec(out, leaves)
        self.leaves = leaves


class EmulatedGraphBackend:
    """Runs the runner's bookkeeping without CUDA graphs, on any device: "capture"
    runs the call once and keeps its outputs as the static outputs; "replay" runs
    the call again on the static inputs and writes the results into the static
    outputs in place, as a graph replay would. For CPU tests and debugging."""

    name = "emulated"

    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.released = 0

    def capturing(self) -> bool:
        return False

    def rejects(self, tensors: list) -> str | None:
        return None

    def device(self, tensors: list):
        return tensors[0].device if tensors else torch.device("cpu")

    def context(self, device):
        return contextlib.nullcontext()

    def warmup(self, call: Callable, n: int, device) -> None:
        for _ in range(n):
            call()

    def capture(self, call: Callable, device):
        out = call()
        self.captures += 1
        return _EmulatedGraph(call, out), out, {"capture_allocated_bytes": 0, "capture_reserved_bytes": 0}

    def replay(self, graph: _EmulatedGraph) -> None:
        leaves: list = []
        spec = _out_spec(graph.call(), leaves)
        if spec != graph.spec or len(leaves) != len(graph.leaves):
            raise RuntimeError("emulated replay: the output structure changed since capture")
        for dst, src in zip(graph.leaves, leaves):
            dst.copy_(src)
        self.replays += 1

    def release(self, graph: _EmulatedGraph) -> None:
        graph.call = None
        self.released += 1


# ---------------------------------------------------------------- the runner


@dataclasses.dataclass(eq=False)
class _Entry:
    key: tuple
    graph: Any = None
    device: Any = None
    inputs: list = dataclasses.field(default_factory=list)  # _StaticInput per tensor argument
    constants: dict = dataclasses.field(default_factory=dict)  # from `prepare`, held for the graph's life
    out_spec: Any = None
    out_leaves: list = dataclasses.field(default_factory=list)
    hits: int = 0
    capture_s: float = 0.0
    stats: dict = dataclasses.field(default_factory=dict)

    def static_bytes(self) -> dict:
        return {
            "static_input_bytes": sum(s.nbytes for s in self.inputs),
            "static_output_bytes": sum(t.untyped_storage().nbytes() for t in _unique_storages(self.out_leaves)),
            "constant_bytes": sum(
                t.untyped_storage().nbytes() for t in _unique_storages(_leaves_of(self.constants))
            ),
        }


@dataclasses.dataclass(eq=False)
class _Eager:
    key: tuple
    reason: str
    hits: int = 0


def _leaves_of(obj) -> list:
    leaves: list = []
    _out_spec(obj, leaves)
    return leaves


def _unique_storages(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        p = t.untyped_storage().data_ptr()
        if p not in seen:
            seen.add(p)
            out.append(t)
    return out


def _exception_text(exc: BaseException) -> str:
    """The exception and what it was raised during (capture errors come in pairs:
    the op that failed, then capture_end complaining about the invalidated capture)."""
    parts, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {str(e).strip()}")
        e = e.__cause__ or e.__context__
    return " <- during: ".join(parts)


_COUNTS = ("calls", "captures", "capture_failures", "evictions", "replays", "eager")


class GraphRunner:
    """Call `fn` through CUDA graphs, one per call signature (see the module docstring).

    fn: the callable to capture (for a model, its original forward).
    max_graphs: how many graphs to keep (LRU); the least recently used is released.
    warmup: eager runs before capture, on a side stream (>= 1 lets every
        first-sight gate reach its verdict, so capture records the fast paths).
    reuse_outputs: return the static outputs themselves (no clone); the next
        replay of that graph overwrites them.
    pool: None (a private memory pool per graph), "shared" (one pool for all of
        this runner's graphs: much less memory when several signatures are live;
        safe here because replays are serialised and outputs are cloned before
        another graph runs), or a `torch.cuda.graph_pool_handle()`.
    backend: the capture mechanism (default CUDAGraphBackend).
    prepare: `prepare(args, kwargs) -> dict`, called once per new signature outside
        capture with the static arguments; the returned keyword arguments (tensors
        constant for the signature, e.g. RoPE coordinates) are passed to `fn` at
        warmup and capture and held for the graph's life.
    context: extra `() -> hashable` that keys the signature (e.g. mounted tiers),
        added to default_context().
    """

    def __init__(
        self,
        fn: Callable,
        *,
        max_graphs: int = 8,
        warmup: int = 2,
        reuse_outputs: bool = False,
        pool=None,
        backend=None,
        prepare: Callable | None = None,
        context: Callable[[], Any] | None = None,
        capture_error_mode: str = "global",
        name: str | None = None,
    ):
        if int(max_graphs) < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        if int(warmup) < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if pool is not None and reuse_outputs:
            raise ValueError(
                "a shared pool with reuse_outputs=True would let one graph's replay overwrite "
                "another graph's returned outputs; use one or the other"
            )
        self.fn = fn
        self.max_graphs = int(max_graphs)
        self.warmup = int(warmup)
        self.reuse_outputs = bool(reuse_outputs)
        self.prepare = prepare
        self.context = context
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        if backend is None:
            if isinstance(pool, str):
                if pool != "shared":
                    raise ValueError(f"pool must be None, 'shared' or a graph pool handle, got {pool!r}")
                pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
            backend = CUDAGraphBackend(pool=pool, capture_error_mode=capture_error_mode)
        self.backend = backend
        self.enabled = True
        self._on_restore: Callable | None = None
        self._graphs: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._eager: dict[tuple, _Eager] = {}
        self._warned: set = set()
        self._lock = threading.RLock()
        self.counts = collections.Counter()  # calls, captures, capture_failures, evictions, replays, eager

    # -------------------------------------------------------------- calling

    def __call__(self, *args, **kwargs):
        if not self.enabled or self.backend.capturing():
            # inside someone else's capture: the outer graph records our eager ops
            return self.fn(*args, **kwargs)
        context = default_context()
        if self.context is not None:
            context = context + (self.context(),)
        try:
            key, tensors = signature_of(args, kwargs, context)
        except UnsupportedInput as exc:
            self._warn_once(("unsupported", str(exc)), f"cannot key {exc}; calling {self.name} eagerly")
            self.counts["eager"] += 1
            return self.fn(*args, **kwargs)
        with self._lock:
            self.counts["calls"] += 1
            entry = self._graphs.get(key)
            if entry is not None:
                self._graphs.move_to_end(key)
                entry.hits += 1
                return self._replay(entry, tensors)
            eager = self._eager.get(key)
            if eager is None:
                reason = self._rejects(tensors)
                if reason is None:
                    return self._first_sight(key, tensors, args, kwargs)
                eager = self._eager[key] = _Eager(key, reason)
                self._warn_once(("rejected", reason), f"{reason}; calling {self.name} eagerly")
            else:
                eager.hits += 1
        self.counts["eager"] += 1
        return self.fn(*args, **kwargs)

    def _rejects(self, tensors) -> str | None:
        if torch.is_grad_enabled():
            # a captured autograd graph would keep stale saved tensors: inference only
            return "autograd is enabled (call under torch.no_grad() or torch.inference_mode())"
        return self.backend.rejects(tensors)

    def _first_sight(self, key, tensors, args, kwargs):
        spec_args, spec_kwargs, _ = key
        entry = _Entry(key, device=self.backend.device(tensors))
        with self.backend.context(entry.device):
            entry.inputs = [_StaticInput(t) for t in tensors]
            leaves = iter([s.tensor for s in entry.inputs])
            s_args = tuple(_build(s, leaves) for s in spec_args)
            s_kwargs = {n: _build(s, leaves) for n, s in spec_kwargs}
            if self.prepare is not None:
                entry.constants = dict(self.prepare(s_args, s_kwargs) or {})
            call_kwargs = {**s_kwargs, **entry.constants}
            fn = self.fn

            def call():
                return fn(*s_args, **call_kwargs)

            # Errors in warmup are the function's own (they would happen eagerly too): raise them.
            self.backend.warmup(call, self.warmup, entry.device)
            t0 = time.perf_counter()
            try:
                graph, out, stats = self.backend.capture(call, entry.device)
            except Exception as exc:
                return self._capture_failed(key, exc, args, kwargs)
            entry.capture_s = time.perf_counter() - t0
            entry.graph, entry.stats = graph, stats
            entry.out_spec = _out_spec(out, entry.out_leaves)
            self.counts["captures"] += 1
            self._graphs[key] = entry
            self._evict()
            # capture records without running: the first result comes from a replay (inputs
            # refilled in case the function wrote to them during warmup)
            return self._replay(entry, tensors)

    def _capture_failed(self, key, exc, args, kwargs):
        text = _exception_text(exc)
        self.counts["capture_failures"] += 1
        self._eager[key] = _Eager(key, f"capture failed: {text}")
        warnings.warn(
            f"bitfuse.graphs: CUDA-graph capture of {self.name} failed for {describe_signature(key)}: {text}; "
            "this signature runs eagerly from now on",
            GraphCaptureWarning,
            stacklevel=4,
        )
        self.counts["eager"] += 1
        return self.fn(*args, **kwargs)

    def _replay(self, entry: _Entry, tensors):
        with self.backend.context(entry.device):
            if tensors is not None:
                for static, x in zip(entry.inputs, tensors):
                    static.fill(x)
            self.backend.replay(entry.graph)
            self.counts["replays"] += 1
            if self.reuse_outputs:
                leaves = iter(entry.out_leaves)
            else:
                leaves = iter([t.clone() for t in entry.out_leaves])
            return _out_build(entry.out_spec, leaves)

    def _evict(self) -> None:
        while len(self._graphs) > self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            self._release(old)
            self.counts["evictions"] += 1

    def _release(self, entry: _Entry) -> None:
        if entry.graph is not None:
            self.backend.release(entry.graph)
        entry.graph = None
        entry.inputs = []
        entry.out_leaves = []
        entry.constants = {}

    def _warn_once(self, key, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(f"bitfuse.graphs: {message}", GraphCaptureWarning, stacklevel=4)

    # -------------------------------------------------------------- management

    def clear(self, forget_failures: bool = False) -> None:
        """Release every graph (and, optionally, forget which signatures run eagerly)."""
        with self._lock:
            while self._graphs:
                _, entry = self._graphs.popitem(last=False)
                self._release(entry)
            if forget_failures:
                self._eager.clear()
                self._warned.clear()

    def close(self) -> None:
        """Release every graph; later calls go straight to `fn`."""
        self.enabled = False
        self.clear()

    def restore(self) -> None:
        """Undo what installed this runner (wrap_model_for_graphs: the model's
        previous forward comes back), then close it. Idempotent."""
        undo, self._on_restore = self._on_restore, None
        if undo is not None:
            undo()
        self.close()

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[tuple]:
        """Signatures with a live graph, least recently used first."""
        return list(self._graphs)

    def report(self) -> dict:
        """Per-signature memory and hit counts, graphs least recently used first.

        static_input_bytes / static_output_bytes / constant_bytes are exact;
        capture_allocated_bytes (memory_allocated after capture minus before: the
        static outputs and whatever else the capture left allocated) and
        capture_reserved_bytes (the same for memory_reserved: the pool's growth)
        estimate what the graph's pool holds."""
        with self._lock:
            rows = []
            for entry in self._graphs.values():
                row = {
                    "signature": describe_signature(entry.key),
                    "state": "graph",
                    "hits": entry.hits,
                    "capture_s": round(entry.capture_s, 6),
                    **entry.static_bytes(),
                    **entry.stats,
                }
                row["total_bytes_estimate"] = (
                    row["static_input_bytes"]
                    + row["constant_bytes"]
                    + max(row.get("capture_reserved_bytes", 0), row["static_output_bytes"])
                )
                rows.append(row)
            for e in self._eager.values():
                rows.append(
                    {"signature": describe_signature(e.key), "state": "eager", "hits": e.hits, "reason": e.reason}
                )
            return {
                "name": self.name,
                "backend": self.backend.name,
                "graphs": len(self._graphs),
                "max_graphs": self.max_graphs,
                "total_bytes_estimate": sum(r.get("total_bytes_estimate", 0) for r in rows),
                **{k: self.counts[k] for k in _COUNTS},
                "signatures": rows,
            }


# ---------------------------------------------------------------- models

_UNSET = object()


def ltx2_coords_prepare(model) -> Callable | None:
    """For diffusers' LTX2VideoTransformer3DModel: a `prepare` that computes the
    RoPE coordinates the forward would compute, when the caller passed none.

    Why: the forward's `rope.prepare_video_coords` builds `torch.tensor(patch_size)`
    and `torch.tensor(scale_factors)` on the host and copies them (pageable) to the
    GPU, which stream capture forbids (FIELD_NOTES: whole-forward capture fails).
    The forward takes `video_coords` / `audio_coords`; given them it skips that
    code. So the coordinates are computed once per signature, outside capture, by
    the same methods with the same arguments as the forward (LTX2 forward, step 1:
    `prepare_video_coords(batch_size, num_frames, height, width,
    hidden_states.device, fps=fps)` and `prepare_audio_coords(batch_size,
    audio_num_frames, audio_hidden_states.device)`, batch_size =
    hidden_states.size(0)), and passed as constant inputs of the graph; everything
    they depend on (batch size, devices, num_frames, height, width, fps,
    audio_num_frames) is in the signature. Bit-identical by construction, no
    copy per replay, and one graph for the whole forward. Splitting the graph
    around the host code ("breakable" graphs) would also work but costs a graph
    boundary and more machinery for nothing here: the rest of the forward
    captures as is."""
    rope = getattr(model, "rope", None)
    audio_rope = getattr(model, "audio_rope", None)
    if not (hasattr(rope, "prepare_video_coords") and hasattr(audio_rope, "prepare_audio_coords")):
        return None
    try:
        # the class's forward: an instance-level wrapper must accept the same call
        sig = inspect.signature(type(model).forward)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters)
    needed = ("hidden_states", "audio_hidden_states", "video_coords", "audio_coords")
    if not all(n in params for n in needed):
        return None
    positional = {n: params.index(n) - 1 for n in ("video_coords", "audio_coords")}  # -1: self

    def prepare(args: tuple, kwargs: dict) -> dict:
        try:
            bound = sig.bind(model, *args, **kwargs)
        except TypeError:
            return {}
        bound.apply_defaults()
        a = bound.arguments
        extra = {}
        hidden, audio_hidden = a["hidden_states"], a["audio_hidden_states"]
        if not isinstance(hidden, torch.Tensor) or not isinstance(audio_hidden, torch.Tensor):
            return {}
        batch_size = hidden.size(0)
        # given positionally (even as None) they can't be added as keywords: leave the call alone
        if a.get("video_coords") is None and len(args) <= positional["video_coords"]:
            with contextlib.suppress(Exception):  # bad arguments: let the forward raise its own error
                extra["video_coords"] = rope.prepare_video_coords(
                    batch_size, a.get("num_frames"), a.get("height"), a.get("width"), hidden.device, fps=a.get("fps")
                )
        if a.get("audio_coords") is None and len(args) <= positional["audio_coords"]:
            with contextlib.suppress(Exception):
                extra["audio_coords"] = audio_rope.prepare_audio_coords(
                    batch_size, a.get("audio_num_frames"), audio_hidden.device
                )
        return extra

    return prepare


def _model_of(handle) -> torch.nn.Module:
    if isinstance(handle, torch.nn.Module):
        return handle
    model = getattr(handle, "model", None)
    if isinstance(model, torch.nn.Module):
        return model
    raise TypeError(f"expected an accelerate() handle with a .model, or a torch.nn.Module; got {type(handle).__name__}")


def _sites_context(model) -> Callable[[], Any]:
    """The tiers mounted on the model's sites, read at every call (cheap: the
    Site objects are collected once)."""
    from .sites import sites_of

    sites = sites_of(model)

    def context():
        return tuple(sorted({s.tier for s in sites}, key=str))

    return context


def runner_for_model(model: torch.nn.Module, forward: Callable | None = None, **options) -> GraphRunner:
    """A GraphRunner for a model's forward, with the model's `prepare` (LTX-2 RoPE
    coordinates) and its mounted tiers in the signature. `forward` defaults to
    the model's current forward (bound); options go to GraphRunner."""
    if forward is None:
        forward = model.forward
    options.setdefault("prepare", ltx2_coords_prepare(model))
    options.setdefault("context", _sites_context(model))
    options.setdefault("name", f"{type(model).__name__}.forward")
    return GraphRunner(forward, **options)


def graph_runner_of(model) -> GraphRunner | None:
    """The GraphRunner installed on a model (or handle) by wrap_model_for_graphs, if any."""
    model = _model_of(model)
    fwd = model.__dict__.get("forward")
    return getattr(fwd, "_bitfuse_graph_runner", None)


def wrap_model_for_graphs(handle, **options) -> GraphRunner:
    """Route `model.forward` (instance level) through a GraphRunner and return it.

    handle: what `bitfuse.accelerate` returned (its `.model` is wrapped), or a
    module. Options go to GraphRunner (max_graphs, warmup, reuse_outputs, pool,
    backend, ...). Wrapping twice replaces the first runner.

    Undoing it: `runner.restore()` (or `unwrap_model_for_graphs(model)`) puts the
    previous forward back and releases every graph. `handle.restore()` does it
    too: a handle with a `graphs` attribute (LTX2Handle) keeps the runner there
    and calls `handle.graphs.restore()` first; other handles get the unwrap
    registered through `add_restore_callback(fn)`, a `_restore_callbacks` list,
    or, failing both, an instance-level wrapper around `handle.restore`."""
    model = _model_of(handle)
    unwrap_model_for_graphs(model)
    previous = model.__dict__.get("forward", _UNSET)  # e.g. the accelerated forward accelerate() installed
    runner = runner_for_model(model, model.forward, **options)

    @functools.wraps(runner.fn)  # keeps inspect.signature(model.forward): pipelines read its parameters
    def forward(*args, **kwargs):
        return runner(*args, **kwargs)

    forward._bitfuse_graph_runner = runner
    forward._bitfuse_previous_forward = previous
    model.forward = forward
    runner._on_restore = functools.partial(unwrap_model_for_graphs, model)
    if handle is not model:
        if callable(getattr(handle, "add_restore_callback", None)) or isinstance(
            getattr(handle, "_restore_callbacks", None), list
        ):
            _register_restore(handle, runner.restore)
        elif hasattr(handle, "graphs"):
            handle.graphs = runner  # the handle's restore() calls handle.graphs.restore()
        else:
            _register_restore(handle, runner.restore)
    return runner


def unwrap_model_for_graphs(handle) -> bool:
    """Remove the graph wrapper from a model (or handle) and release its graphs.
    Returns whether there was one. Safe to call twice."""
    model = _model_of(handle)
    fwd = model.__dict__.get("forward")
    runner = getattr(fwd, "_bitfuse_graph_runner", None)
    if runner is None:
        return False
    previous = fwd._bitfuse_previous_forward
    if previous is _UNSET:
        del model.forward
    else:
        model.forward = previous
    runner.close()
    if not isinstance(handle, torch.nn.Module) and getattr(handle, "graphs", None) is runner:
        with contextlib.suppress(AttributeError):
            handle.graphs = None
    return True


def _register_restore(handle, fn: Callable) -> None:
    """Make `handle.restore()` run `fn` first. Uses, in order: a
    `handle.add_restore_callback(fn)` method, a `handle._restore_callbacks` list,
    else wraps `handle.restore` at the instance level."""
    add = getattr(handle, "add_restore_callback", None)
    if callable(add):
        add(fn)
        return
    callbacks = getattr(handle, "_restore_callbacks", None)
    if isinstance(callbacks, list):
        callbacks.append(fn)
        return
    restore = getattr(handle, "restore", None)
    if not callable(restore):
        raise TypeError(f"{type(handle).__name__} has no restore() to attach the graph unwrap to")
    if getattr(restore, "_bitfuse_graph_unwrap", None) is not None:
        restore = restore.__wrapped__

    @functools.wraps(restore)
    def restore_and_unwrap(*args, **kwargs):
        fn()
        if handle.__dict__.get("restore") is restore_and_unwrap:
            del handle.__dict__["restore"]
        return restore(*args, **kwargs)

    restore_and_unwrap._bitfuse_graph_unwrap = fn
    handle.restore = restore_and_unwrap


# ---------------------------------------------------------------- benchmarks


def _tree_equal(a, b) -> bool:
    la, lb = _leaves_of(a), _leaves_of(b)
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb))


def _timer(fn: Callable, iters: int, cuda: bool) -> list[float]:
    """Per-call milliseconds."""
    times = []
    if cuda:
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in times]
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_graphs(
    target,
    kwargs: dict | None = None,
    args: tuple = (),
    *,
    tier: str | None = None,
    iters: int = 20,
    warmup_iters: int = 3,
    compare_eager: bool = True,
    **runner_options,
) -> dict:
    """Time a forward eagerly and through CUDA graphs, side by side, and check
    that the replay is `torch.equal` to eager under the same tier.

    target: a model (its current forward is graphed, with the LTX-2 coords
        `prepare`; if it is already wrapped by wrap_model_for_graphs, its runner
        is used and eager means the forward under it) or any callable.
    tier: run everything inside `bitfuse.quality(tier)` (None: the mounted tier).
    Returns eager_ms / graph_ms (medians of `iters` calls, each including the
    input copy and output clone), speedup, first_call_s (warmup + capture +
    first replay), equal (replay vs eager), and the runner's report.
    """
    kwargs = dict(kwargs or {})
    runner = graph_runner_of(target) if isinstance(target, torch.nn.Module) else None
    owned = runner is None
    if owned:
        if isinstance(target, torch.nn.Module):
            runner = runner_for_model(target, **runner_options)
        else:
            runner = GraphRunner(target, **runner_options)
    eager = runner.fn
    tensors = [t for t in _leaves_of((args, kwargs)) if isinstance(t, torch.Tensor)]
    cuda = any(t.is_cuda for t in tensors)
    scope = policy.quality(tier) if tier is not None else contextlib.nullcontext()
    result: dict = {"tier": tier or "mounted", "iters": iters}
    with scope, torch.no_grad():
        ref = eager(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = runner(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        result["first_call_s"] = time.perf_counter() - t0
        result["equal"] = _tree_equal(out, ref)
        del out, ref
        if compare_eager:
            for _ in range(warmup_iters):
                eager(*args, **kwargs)
            times = _timer(lambda: eager(*args, **kwargs), iters, cuda)
            result["eager_ms"] = statistics.median(times)
        for _ in range(warmup_iters):
            runner(*args, **kwargs)
        times = _timer(lambda: runner(*args, **kwargs), iters, cuda)
        result["graph_ms"] = statistics.median(times)
        result["graph_min_ms"] = min(times)
    if compare_eager:
        result["speedup"] = result["eager_ms"] / result["graph_ms"] if result["graph_ms"] else float("nan")
    result["report"] = runner.report()
    result["graphed"] = result["report"]["graphs"] > 0
    if owned:
        runner.close()  # free the graphs now, not whenever the runner is collected
    return result
