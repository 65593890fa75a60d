"""CUDA graphs for a whole forward: capture once per call signature, replay after.

    runner = GraphRunner(fn)            # fn: any callable of tensors and plain values
    out = runner(*args, **kwargs)       # first sight: warm up, capture, replay
    out = runner(*args2, **kwargs2)     # same signature: copy inputs in, replay

    handle = bitfuse.accelerate(model, cuda_graphs=True, max_graphs=4)
    handle.graphs                       # the GraphRunner around model.forward
    handle.restore()                    # also removes the graph wrapper (handle.graphs.restore())

The signature of a call is its tensors' (shape, stride, dtype, device, 16-byte
alignment), every other argument by value, and the context that picks kernels:
the quality tier requested by `bitfuse.quality(...)`, BITFUSE_DISABLE/VERIFY,
grad and inference mode, plus whatever the caller's `context()` adds (a model
integration adds the tiers mounted on its sites) and the values `hoist` computes.
A graph captured under one tier never replays under another. A graph also reads,
where they were at capture, the tensors `watch` names (for a model: its parameters
and buffers); before each call the runner checks that none has moved, and
captures again where one has (see GraphRunner).

First sight of a signature: the inputs are copied into static buffers with the
same strides and alignment, `fn` runs eagerly `warmup` times on a side stream
outside capture (every first-sight gate in bitfuse reaches its verdict there, so
capture records verified fast paths, see policy.gated), then `fn` is captured and
replayed. Later calls copy their inputs into the static buffers, replay, and
return clones of the static outputs (`reuse_outputs=True` returns them as is).

Host syncs. Capture refuses what needs the host mid-forward (`.item()`, a branch
on a tensor's truth, a pageable host-to-device copy). Two ways through, both
exact:
- hoisting: `hoist(args, kwargs) -> {name: plain value}` runs per call before the
  signature (outside capture); the values join the signature and `fn` reads them
  with `hoisted(name)` instead of syncing. The forward stays one graph.
- breaking: `graph_break(fn, *args)` inside the forward ends the graph being
  captured, runs `fn` eagerly and starts the next one. Replays run the segments
  with the breaks between them; a break's tensor results (on the capture device)
  are copied into the buffers the next segment reads. Every other part of its
  result (plain values, the structure, tensors' shapes and dtypes, host tensors'
  values) is the *path*: a replay whose break returns another path stops there
  and the call is served by the signature's graph for that path, captured on
  first sight of it (up to `max_paths` per signature), or else eagerly; never
  by a graph of another path. `report()` gives each signature's segments and paths.

What can go wrong is contained per signature: if capture raises, a
GraphCaptureWarning carries the exception text and that signature runs eagerly
for the rest of the runner's life. Graphs are kept in an LRU of `max_graphs`
signatures; an evicted signature's memory (pools, static inputs and outputs) is
released. `runner.report()` lists per-signature memory, hits and segments.

The capture mechanism is a small object: `CUDAGraphBackend`, or for tests
`EmulatedGraphBackend`, which records the aten ops of a capture and re-runs them on
the same tensors (CUDA-graph semantics on the CPU, host syncs refused).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import enum
import functools
import gc
import sys
import threading
import time
import types
import warnings
from typing import Any, Callable

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
)

from . import policy

__all__ = [
    "GraphRunner",
    "GraphCaptureWarning",
    "CUDAGraphBackend",
    "EmulatedGraphBackend",
    "UnsupportedInput",
    "default_context",
    "signature_of",
    "describe_signature",
    "graph_break",
    "hoisted",
    "wrap_model_for_graphs",
    "unwrap_model_for_graphs",
    "model_tensors",
    "AdapterState",
    "graph_runner_of",
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
    """A readable one-line rendering of a signature key (arguments cut at `limit` characters)."""

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
    parts += [f"{n}={render(s)}" for n, s in kwargs if s[0] is not type(None)]
    text = "(" + ", ".join(parts) + ")"
    if len(text) > limit:
        text = text[: limit - 4] + "...)"
    return f"{text} context={context!r}"  # whole: it says which tier and hoisted values the graph is for


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


# ---------------------------------------------------------------- hoisted values and graph breaks

_NOTHING: types.MappingProxyType = types.MappingProxyType({})
_hoisted: contextvars.ContextVar = contextvars.ContextVar("bitfuse_graphs_hoisted", default=_NOTHING)
_capture: contextvars.ContextVar = contextvars.ContextVar("bitfuse_graphs_capture", default=None)


def hoisted(name: str, default=None):
    """The value `name` that the running GraphRunner's `hoist` computed for the
    current call (before its graph), or `default` outside such a call."""
    return _hoisted.get().get(name, default)


def graph_break(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, run outside the CUDA graph a GraphRunner is capturing.

    For host syncs that cannot be hoisted out of a forward: while a runner captures,
    the graph ends here, `fn` runs eagerly, its result is kept (tensors on the
    capture device as buffers the next graph reads; everything else as the path the
    rest of the capture took) and a new graph begins. At replay `fn` runs again on
    the same inputs between the graphs (see the module docstring). `fn` must be a
    function of its arguments (no side effects). Outside a capture, just the call."""
    capture = _capture.get()
    if capture is None:
        return fn(*args, **kwargs)
    return capture.graph_break(fn, args, kwargs)


_HOST_TENSOR = object()


def _path_spec(obj, device, leaves: list):
    """Hashable description of a break's result: tensors on `device` by (shape,
    dtype) and appended to `leaves`; any other tensor (host) by value; plain values
    and containers as in signatures."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            leaves.append(obj)
            return (_TENSOR, tuple(obj.shape), obj.dtype)
        return (_HOST_TENSOR, tuple(obj.shape), obj.dtype, str(obj.device), tuple(obj.flatten().tolist()))
    t = type(obj)
    if t is tuple or t is list:
        return (_TUPLE if t is tuple else _LIST, tuple(_path_spec(v, device, leaves) for v in obj))
    if t is dict:
        return (_DICT, tuple((k, _path_spec(v, device, leaves)) for k, v in obj.items()))
    return _spec(obj, [])  # plain values; anything unkeyable raises UnsupportedInput


@dataclasses.dataclass(eq=False)
class _Break:
    """A graph break as captured: the call, and its result's path and device tensors."""

    fn: Callable
    args: tuple
    kwargs: dict
    spec: tuple
    static: list  # its result's tensors on the capture device: the next graph reads these


class _Capture:
    """One capture in progress: the call split into graphs at its graph breaks."""

    def __init__(self, backend, device, data: list):
        self.backend = backend
        self.device = device
        self.data = list(data)  # tensors whose values change per call (inputs, break results)
        self.steps: list = []  # graphs and _Breaks, in call order
        self.first = None  # the first graph: later ones share its memory pool
        self.open = None

    def begin(self) -> None:
        self.open = self.backend.begin(self.device, self.first, self.data)
        if self.first is None:
            self.first = self.open

    def end(self) -> None:
        graph, self.open = self.open, None
        self.backend.end(graph)
        self.steps.append(graph)
        self.backend.replay(graph)  # real values in its memory: a break may read them

    def graph_break(self, fn: Callable, args: tuple, kwargs: dict):
        self.end()
        token = _capture.set(None)  # fn runs eagerly, nested breaks included
        try:
            value = fn(*args, **kwargs)
        finally:
            _capture.reset(token)
        leaves: list = []
        spec = _path_spec(value, self.device, leaves)
        self.steps.append(_Break(fn, args, kwargs, spec, leaves))
        self.data.extend(leaves)
        self.begin()
        return value

    def abort(self) -> None:
        graph, self.open = self.open, None
        try:
            if graph is not None:
                self.backend.abort(graph, self.device)
        finally:
            for step in self.steps:
                if not isinstance(step, _Break):
                    with contextlib.suppress(Exception):
                        self.backend.release(step)


# ---------------------------------------------------------------- capture backends


class CUDAGraphBackend:
    """Capture and replay with `torch.cuda.CUDAGraph`, one graph per segment.

    pool: None gives every capture (a signature's path) a private memory pool that
    its segments share; a handle from `torch.cuda.graph_pool_handle()` (or the
    runner's "shared" option) makes all captures share one, which the runner allows
    only when it clones outputs (see GraphRunner)."""

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
    # allocator and kept for good)
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

    @contextlib.contextmanager
    def session(self, device):
        """Around one capture (all its segments and breaks): a clean allocator, the
        capture stream, and the memory it left allocated (the yielded dict, filled on exit)."""
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()  # as torch.cuda.graph does; first, so that the deltas are clean
        stats: dict = {}
        allocated0 = torch.cuda.memory_allocated(device)
        reserved0 = torch.cuda.memory_reserved(device)
        main, stream = torch.cuda.current_stream(device), self._stream("capture", device)
        stream.wait_stream(main)
        try:
            with torch.cuda.stream(stream):
                yield stats
        finally:
            main.wait_stream(stream)  # segments replayed during capture ran there
        torch.cuda.synchronize(device)
        stats["capture_allocated_bytes"] = torch.cuda.memory_allocated(device) - allocated0
        stats["capture_reserved_bytes"] = torch.cuda.memory_reserved(device) - reserved0

    def begin(self, device, first, data):
        graph = torch.cuda.CUDAGraph()
        pool = self.pool if self.pool is not None else (first.pool() if first is not None else None)
        graph.capture_begin(pool=pool, capture_error_mode=self.capture_error_mode)
        return graph

    def end(self, graph) -> None:
        graph.capture_end()

    def abort(self, graph, device) -> None:
        """End a capture that failed (its error, if any, is raised in the context of
        the original one), and take the device's RNG out of capture mode."""
        try:
            graph.capture_end()
        finally:
            with contextlib.suppress(Exception):
                graph.reset()
            _release_generator(device)

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


# aten ops that read a tensor's values on the host (or size their output by them)
_HOST_READS = frozenset({
    "aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::masked_select", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive",
})


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Records every aten op run under it, with the tensors it read and returned;
    refuses a host read of a value that depends on the call's data (`data`)."""

    def __init__(self, data):
        super().__init__()
        self.ops: list = []
        self.tainted = {_storage_key(t) for t in data}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tainted = any(_storage_key(t) in self.tainted for t in inputs)
        if tainted and func._schema.name in _HOST_READS:
            raise RuntimeError(
                f"CUDA error: operation not permitted when stream is capturing (emulated: {func} reads on "
                "the host a value that depends on the graph's inputs)"
            )
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        if tainted:
            self.tainted.update(_storage_key(t) for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


class _EmulatedGraph:
    def __init__(self, recorder: _Recorder):
        self.recorder = recorder
        self.addresses: list = []  # (tensor, its address at capture) for every tensor the ops read


class EmulatedGraphBackend:
    """CUDA-graph semantics on any device, for tests and debugging.

    A capture records every aten op the call runs (a TorchDispatchMode), running
    it; a replay re-runs the recorded ops on the very tensors of the capture and
    writes each result into the tensor the capture produced, as a graph replay
    rewrites its memory. Python code does not run at replay. So a static input not
    refilled, a break's result not copied back, an output not cloned, or a value
    baked in at capture shows up here as on the GPU; so does a tensor the capture
    read whose data was replaced since (a `.data` swap, `.to()`, offloading): the
    replay raises, where a CUDA graph would read the memory it left. Like stream capture, a
    recording refuses a host read (`.item()`, `bool(t)`, `torch.equal`, `nonzero`)
    of a value computed from the call's inputs or break results ("operation not
    permitted when stream is capturing"); host reads of constants (parameters,
    tensors made in the forward) pass, as host tensors do on the GPU."""

    name = "emulated"

    def __init__(self):
        self.captures = 0  # graphs (segments) recorded
        self.replays = 0
        self.released = 0

    def capturing(self) -> bool:
        return any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack())

    def rejects(self, tensors: list) -> str | None:
        return None

    def device(self, tensors: list):
        return tensors[0].device if tensors else torch.device("cpu")

    def context(self, device):
        return contextlib.nullcontext()

    def warmup(self, call: Callable, n: int, device) -> None:
        for _ in range(n):
            call()

    @contextlib.contextmanager
    def session(self, device):
        yield {"capture_allocated_bytes": 0, "capture_reserved_bytes": 0}

    def begin(self, device, first, data) -> _EmulatedGraph:
        recorder = _Recorder(data)
        recorder.__enter__()
        return _EmulatedGraph(recorder)

    def end(self, graph: _EmulatedGraph) -> None:
        graph.recorder.__exit__(None, None, None)
        seen = set()
        for _, args, kwargs, _ in graph.recorder.ops:
            for t in _pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    graph.addresses.append((t, t.data_ptr()))
        self.captures += 1

    def abort(self, graph: _EmulatedGraph, device) -> None:
        graph.recorder.__exit__(None, None, None)

    def replay(self, graph: _EmulatedGraph) -> None:
        for t, address in graph.addresses:
            if t.data_ptr() != address:
                # (a CUDA graph holds addresses: it would read the memory the tensor left)
                raise RuntimeError(
                    f"emulated CUDA graph: a {tuple(t.shape)} {t.dtype} tensor the capture read has moved since "
                    "(its data was replaced); a CUDA graph would read its old memory"
                )
        for func, args, kwargs, out in graph.recorder.ops:
            result = func(*args, **kwargs)
            for dst, src in zip(_pytree.tree_leaves(out), _pytree.tree_leaves(result)):
                # a view or an in-place result already lives in the capture's memory
                if isinstance(dst, torch.Tensor) and _storage_key(dst) != _storage_key(src):
                    dst.copy_(src)
        self.replays += 1

    def release(self, graph: _EmulatedGraph) -> None:
        graph.recorder.ops.clear()
        self.released += 1


# ---------------------------------------------------------------- the runner


@dataclasses.dataclass(eq=False)
class _Path:
    """One captured path of a signature: its graphs with the breaks between them."""

    steps: list
    out_spec: Any
    out_leaves: list
    capture_s: float
    stats: dict
    hits: int = 0

    @property
    def breaks(self) -> list[_Break]:
        return [s for s in self.steps if isinstance(s, _Break)]

    @property
    def key(self) -> tuple:
        return tuple(b.spec for b in self.breaks)

    @property
    def segments(self) -> int:
        return len(self.steps) - len(self.breaks)


@dataclasses.dataclass(eq=False)
class _Entry:
    """A signature with graphs: its static inputs, constants, and captured paths."""

    key: tuple
    device: Any = None
    call: Callable | None = None  # fn on the static inputs (and constants, hoisted values)
    hoisted: Any = dataclasses.field(default=None)  # the hoist's values (part of the key)
    inputs: list = dataclasses.field(default_factory=list)  # _StaticInput per tensor argument
    constants: dict = dataclasses.field(default_factory=dict)  # from `prepare`, held for the graph's life
    paths: list = dataclasses.field(default_factory=list)  # _Path, most recently used first
    hits: int = 0

    def static_bytes(self) -> dict:
        outputs = [t for p in self.paths for t in p.out_leaves]
        breaks = [t for p in self.paths for b in p.breaks for t in b.static]
        return {
            "static_input_bytes": sum(s.nbytes for s in self.inputs),
            "static_output_bytes": _bytes(outputs),
            "constant_bytes": _bytes(_leaves_of(self.constants)),
            "break_bytes": _bytes(breaks),
        }


@dataclasses.dataclass(eq=False)
class _Eager:
    key: tuple
    reason: str
    hits: int = 0


class _Diverged(Exception):
    """A replay's break returned another path than the capture's (`observed`: the
    path so far, the diverging value last)."""

    def __init__(self, observed: tuple):
        super().__init__(observed)
        self.observed = observed


class _OffDevice(Exception):
    """Watched tensors still away from the capture device after the warm-up (weights
    offloaded until their block runs): a capture would have to copy them in."""


class _WarmupError(Exception):
    """Carries (as __cause__) an error the function raised during warmup: its own
    error, which it would raise eagerly too (not a capture failure)."""


def _leaves_of(obj) -> list:
    leaves: list = []
    _out_spec(obj, leaves)
    return leaves


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        p = t.untyped_storage().data_ptr()
        if p not in seen:
            seen.add(p)
            total += t.untyped_storage().nbytes()
    return total


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


_COUNTS = ("calls", "captures", "capture_failures", "evictions", "replays", "divergences", "eager", "moves")


# ---------------------------------------------------------------- tensors graphs read in place

_registrations = [0]  # modules, parameters and buffers registered anywhere since a runner began watching
_registration_hooks: list = []
_hooks_lock = threading.Lock()


def _registered(module, name, value) -> None:
    _registrations[0] += 1  # (returns None: the registration goes on unchanged)


def _count_registrations() -> None:
    """Count module, parameter and buffer registrations process-wide (torch's global
    registration hooks), from the first runner that watches tensors on: a module or
    parameter replaced anywhere tells the runners to look at their models again."""
    with _hooks_lock:
        if not _registration_hooks:
            from torch.nn.modules import module as _module

            _registration_hooks.extend(register(_registered) for register in (
                _module.register_module_module_registration_hook,
                _module.register_module_parameter_registration_hook,
                _module.register_module_buffer_registration_hook,
            ))


#: torch's C++ check of tensors' addresses (CUDA-graph trees use it), where this build has it
_same_addresses = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def model_tensors(model: torch.nn.Module) -> list:
    """`model`'s parameters and buffers: what a graph of its forward reads in place."""
    return [*model.parameters(), *model.buffers()]


def _tuner_layer_class():
    """PEFT's base class of adapter layers, if PEFT is imported (no layer exists otherwise)."""
    if "peft" not in sys.modules:
        return None
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except Exception:  # (another PEFT layout: no layers to find)
        return None
    return BaseTunerLayer


def _adapter_layer_state(layer) -> tuple:
    """What a PEFT adapter layer's forward reads besides tensors: whether its adapters are
    disabled, the active and the merged ones, and each adapter's scale (LoRA's
    `scaling`; the rest of an adapter's configuration is its modules, registered)."""
    d = layer.__dict__  # (plain attributes: nn.Module's __getattr__ is slow for hundreds of layers)
    active, scaling = d.get("_active_adapter"), d.get("scaling")
    return (d.get("_disable_adapters"), active if active.__class__ is str else tuple(active or ()),
            tuple(d.get("merged_adapters", ())), tuple(scaling.items()) if scaling.__class__ is dict else None)


class AdapterState:
    """`() -> hashable`: the Python state of `model`'s PEFT adapter layers (LoRA via
    diffusers' `add_adapter`/`load_lora_adapter`), for a runner's `context`. A graph
    bakes in what the layers' forwards read on the host: the active adapters and their
    scales (`set_adapters(..., weights=...)`), `disable_adapters()`, merged adapters
    (`fuse_lora`). Keyed by this, a change is a new signature (captured anew), not a
    replay of the old. The layers are found again after any module, parameter or buffer
    registration in the process (adapters added or deleted register modules); a model
    without adapters gives () for the cost of that check."""

    __slots__ = ("model", "registrations", "layers")

    def __init__(self, model: torch.nn.Module):
        _count_registrations()
        self.model = model
        self.registrations = -1
        self.layers: tuple = ()

    def __call__(self) -> tuple:
        if self.registrations != _registrations[0]:
            cls = _tuner_layer_class()
            self.layers = () if cls is None else tuple(m for m in self.model.modules() if isinstance(m, cls))
            self.registrations = _registrations[0]
        return tuple(_adapter_layer_state(m) for m in self.layers) if self.layers else ()


class _Watched:
    """The tensors a runner's `watch` gave when its live graphs were captured, and
    their addresses then."""

    __slots__ = ("tensors", "addresses", "indices", "registrations")

    def __init__(self, watch):
        self.registrations = _registrations[0]
        self.tensors = [t for t in watch() if isinstance(t, torch.Tensor)]
        self.addresses = [t.data_ptr() for t in self.tensors]
        self.indices = list(range(len(self.tensors)))

    def moved(self, watch) -> bool:
        """Whether a graph captured then would now read a wrong address."""
        if self.registrations != _registrations[0]:
            tensors = [t for t in watch() if isinstance(t, torch.Tensor)]
            if len(tensors) != len(self.tensors) or any(a is not b for a, b in zip(tensors, self.tensors)):
                return True
            self.registrations = _registrations[0]
        if _same_addresses is not None:
            return not _same_addresses(self.tensors, self.addresses, self.indices)
        return any(t.data_ptr() != a for t, a in zip(self.tensors, self.addresses))


class GraphRunner:
    """Call `fn` through CUDA graphs, one per call signature (see the module docstring).

    fn: the callable to capture (for a model, its forward).
    max_graphs: how many signatures to keep graphs for (LRU); the least recently
        used is released.
    max_paths: how many paths (see graph_break) to keep per signature.
    warmup: eager runs before capture, on a side stream (>= 1 lets every
        first-sight gate reach its verdict, so capture records the fast paths).
    reuse_outputs: return the static outputs themselves (no clone); the next
        replay of that graph overwrites them.
    pool: None (a private memory pool per captured path), "shared" (one pool for all
        of this runner's graphs: much less memory when several signatures are live;
        safe here because replays are serialised and outputs are cloned before
        another graph runs), or a `torch.cuda.graph_pool_handle()`.
    backend: the capture mechanism (default CUDAGraphBackend).
    prepare: `prepare(args, kwargs) -> dict`, called once per new signature outside
        capture with the static arguments; the returned keyword arguments (tensors
        constant for the signature) are passed to `fn` at warmup and capture and
        held for the graph's life.
    hoist: `hoist(args, kwargs) -> {name: plain value}`, called on every call before
        its signature is keyed, outside capture: host syncs moved out of `fn`. The
        values join the signature and `fn` reads them with `hoisted(name)`.
    context: `() -> hashable`, read on every call, added to the signature (e.g. the
        tiers mounted on a model's sites).
    watch: `() -> tensors` that the graphs read in place besides their inputs (a
        model's parameters and buffers: `model_tensors`). A graph holds their
        addresses, so before each call the runner checks that they have not moved
        since capture (`.to()`, offloading, a `.data` swap) and, after any module,
        parameter or buffer was registered anywhere in the process (a module or
        parameter replaced, LoRA layers added), that `watch()` gives the same
        tensors. If not, every graph is released and captured again on the new
        addresses; after `MAX_MOVES` such moves (a model offloaded between calls),
        graphs are off for good and `fn` runs as it is, with a warning. A signature
        whose warm-up leaves a watched tensor off the capture device (weights
        offloaded until their block runs) runs eagerly, without a capture.
    """

    #: releases for moved `watch` tensors after which graphs stay off
    MAX_MOVES = 3

    def __init__(
        self,
        fn: Callable,
        *,
        max_graphs: int = 8,
        max_paths: int = 2,
        warmup: int = 2,
        reuse_outputs: bool = False,
        pool=None,
        backend=None,
        prepare: Callable[[tuple, dict], dict] | None = None,
        hoist: Callable[[tuple, dict], dict] | None = None,
        context: Callable[[], Any] | None = None,
        watch: Callable[[], Any] | None = None,
        capture_error_mode: str = "global",
        name: str | None = None,
    ):
        if int(max_graphs) < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        if int(max_paths) < 1:
            raise ValueError(f"max_paths must be at least 1, got {max_paths}")
        if int(warmup) < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if pool is not None and reuse_outputs:
            raise ValueError(
                "a shared pool with reuse_outputs=True would let one graph's replay overwrite "
                "another graph's returned outputs; use one or the other"
            )
        self.fn = fn
        self.max_graphs = int(max_graphs)
        self.max_paths = int(max_paths)
        self.warmup = int(warmup)
        self.reuse_outputs = bool(reuse_outputs)
        self.prepare = prepare
        self.hoist = hoist
        self.context = context
        self.watch = watch
        self._watched: _Watched | None = None  # the watched tensors where the live graphs read them
        if watch is not None:
            _count_registrations()
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        if backend is None:
            if isinstance(pool, str):
                if pool != "shared":
                    raise ValueError(f"pool must be None, 'shared' or a graph pool handle, got {pool!r}")
                pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
            backend = CUDAGraphBackend(pool=pool, capture_error_mode=capture_error_mode)
        self.backend = backend
        self.enabled = True
        self._on_restore: Callable[[], Any] | None = None
        self._graphs: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._eager: dict[tuple, _Eager] = {}
        self._warned: set = set()
        self._unused = 0  # graphs evicted in a row that were never replayed
        self._lock = threading.RLock()
        self.counts = collections.Counter()

    # -------------------------------------------------------------- calling

    def __call__(self, *args, **kwargs):
        if not self.enabled or self.backend.capturing():
            # inside someone else's capture: the outer graph records our eager ops
            return self.fn(*args, **kwargs)
        values = types.MappingProxyType(dict(self.hoist(args, kwargs))) if self.hoist is not None else _NOTHING
        context = default_context()
        if self.context is not None:
            context = context + (self.context(),)
        if values:
            context = context + (("hoisted",) + tuple(sorted(values.items())),)
        try:
            key, tensors = signature_of(args, kwargs, context)
            hash(key)
        except (UnsupportedInput, TypeError) as exc:
            self._warn_once(("unsupported", str(exc)), f"cannot key {exc}; calling {self.name} eagerly")
            self.counts["eager"] += 1
            return self._eager_call(values, args, kwargs)
        with self._lock:
            if self._watched is not None and self._watched.moved(self.watch):
                self._moved()
                if not self.enabled:  # (graphs off: this call as every later one, eagerly)
                    self.counts["eager"] += 1
                    return self._eager_call(values, args, kwargs)
            self.counts["calls"] += 1
            entry = self._graphs.get(key)
            if entry is not None:
                self._graphs.move_to_end(key)
                entry.hits += 1
                return self._replay(entry, tensors, args, kwargs)
            eager = self._eager.get(key)
            if eager is None:
                reason = self._rejects(tensors)
                if reason is None:
                    return self._first_sight(key, values, tensors, args, kwargs)
                eager = self._eager[key] = _Eager(key, reason)
                self._warn_once(("rejected", reason), f"{reason}; calling {self.name} eagerly")
            else:
                eager.hits += 1
        self.counts["eager"] += 1
        return self._eager_call(values, args, kwargs)

    def _eager_call(self, values, args, kwargs):
        token = _hoisted.set(values)
        try:
            return self.fn(*args, **kwargs)
        finally:
            _hoisted.reset(token)

    def _rejects(self, tensors) -> str | None:
        if torch.is_grad_enabled():
            # a captured autograd graph would keep stale saved tensors: inference only
            return "autograd is enabled (call under torch.no_grad() or torch.inference_mode())"
        return self.backend.rejects(tensors)

    def _first_sight(self, key, values, tensors, args, kwargs):
        spec_args, spec_kwargs, _ = key
        entry = _Entry(key, device=self.backend.device(tensors), hoisted=values)
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
                token = _hoisted.set(values)
                try:
                    return fn(*s_args, **call_kwargs)
                finally:
                    _hoisted.reset(token)

            entry.call = call
            try:
                # kernels compiled and verified in the warm-up itself: a signature still
                # compiling in the background would be captured as eager
                with policy.background_compiles(False):
                    out = self._capture_path(entry, tensors)
            except _WarmupError as exc:
                raise exc.__cause__ from None  # the function's own error: it would happen eagerly too
            except _OffDevice as exc:
                return self._off_device(entry, exc, args, kwargs)
            except Exception as exc:
                return self._capture_failed(entry, exc, args, kwargs)
            self._graphs[key] = entry
            self._evict()
            return out

    def _capture_path(self, entry: _Entry, tensors):
        """Warm up and capture `entry.call` on the current inputs: a new path of the
        signature, served to this call (the capture replays each graph as it ends)."""
        for static, x in zip(entry.inputs, tensors):
            static.fill(x)
        try:
            self.backend.warmup(entry.call, self.warmup, entry.device)
        except Exception as exc:
            raise _WarmupError() from exc
        for static, x in zip(entry.inputs, tensors):
            static.fill(x)  # in case the function wrote to them
        if self.watch is not None:
            # a graph reads these in place, so they must be on the device now that the
            # warm-up has run the forward's own hooks (a model CPU offload brings the
            # model over and leaves it; group offloading takes each block's weights back)
            away = [t for t in self.watch() if isinstance(t, torch.Tensor) and t.device != entry.device]
            if away:
                where = ", ".join(sorted({str(t.device) for t in away}))
                raise _OffDevice(f"{len(away)} of the parameters and buffers {self.name} reads are on {where} "
                                 f"after its warm-up, not {entry.device} (offloaded between calls? CUDA graphs "
                                 "need them resident on the device)")
        if self.watch is not None and self._watched is None:
            self._watched = _Watched(self.watch)  # where the graphs about to be captured read them
        capture = _Capture(self.backend, entry.device, [s.tensor for s in entry.inputs])
        t0 = time.perf_counter()
        with self.backend.session(entry.device) as stats:
            token = _capture.set(capture)
            try:
                capture.begin()
                out = entry.call()
                capture.end()
            except BaseException:
                _capture.reset(token)
                token = None
                capture.abort()
                raise
            finally:
                if token is not None:
                    _capture.reset(token)
        path = _Path(capture.steps, None, [], time.perf_counter() - t0, dict(stats))
        path.out_spec = _out_spec(out, path.out_leaves)
        stray = sorted({str(t.device) for t in path.out_leaves if t.device != entry.device})
        if stray:
            self._release_path(path)
            raise RuntimeError(
                f"outputs on {', '.join(stray)}: work off the capture device is not recorded, "
                "a replay would return values from the capture"
            )
        entry.paths.insert(0, path)
        self.counts["captures"] += 1
        self.counts["replays"] += 1
        return self._outputs(path)

    def _eager_from_now(self, entry: _Entry, reason: str, args, kwargs):
        """Release `entry`'s graphs; its signature runs eagerly from now on (this call too)."""
        self._graphs.pop(entry.key, None)
        self._release(entry)
        self._eager[entry.key] = _Eager(entry.key, reason)
        self.counts["eager"] += 1
        return self._eager_call(entry.hoisted, args, kwargs)

    def _off_device(self, entry: _Entry, exc: _OffDevice, args, kwargs):
        """The warm-up left watched tensors off the device: no capture (one warning per
        distinct reason)."""
        self._warn_once(("off device", str(exc)), f"{exc}; calling {self.name} eagerly")
        return self._eager_from_now(entry, str(exc), args, kwargs)

    def _capture_failed(self, entry: _Entry, exc: BaseException, args, kwargs):
        text = _exception_text(exc)
        self.counts["capture_failures"] += 1
        warnings.warn(
            f"bitfuse.graphs: CUDA-graph capture of {self.name} failed for {describe_signature(entry.key)}: {text}; "
            "this signature runs eagerly from now on",
            GraphCaptureWarning,
            stacklevel=4,
        )
        return self._eager_from_now(entry, f"capture failed: {text}", args, kwargs)

    def _replay(self, entry: _Entry, tensors, args, kwargs):
        observed: tuple = ()
        with self.backend.context(entry.device):
            for path in list(entry.paths):
                if path.key[: len(observed)] != observed:
                    continue  # diverges where this call's breaks already went elsewhere
                try:
                    out = self._run(entry, path, tensors)
                except _Diverged as d:
                    observed = d.observed
                    self.counts["divergences"] += 1
                    continue
                path.hits += 1
                if entry.paths[0] is not path:
                    entry.paths.remove(path)
                    entry.paths.insert(0, path)
                return out
            # no captured path fits this call's data
            if len(entry.paths) < self.max_paths:
                try:
                    return self._capture_path(entry, tensors)
                except _WarmupError as exc:
                    raise exc.__cause__ from None
                except _OffDevice as exc:
                    return self._off_device(entry, exc, args, kwargs)
                except Exception as exc:
                    return self._capture_failed(entry, exc, args, kwargs)
        self.counts["eager"] += 1
        return self._eager_call(entry.hoisted, args, kwargs)

    def _run(self, entry: _Entry, path: _Path, tensors):
        """Replay one path; raises _Diverged where a break leaves it."""
        for static, x in zip(entry.inputs, tensors):
            static.fill(x)
        observed = []
        token = _hoisted.set(entry.hoisted)
        try:
            for step in path.steps:
                if not isinstance(step, _Break):
                    self.backend.replay(step)
                    continue
                value = step.fn(*step.args, **step.kwargs)
                leaves: list = []
                try:
                    spec = _path_spec(value, entry.device, leaves)
                except UnsupportedInput as exc:
                    spec = ("unkeyable", str(exc))
                observed.append(spec)
                if spec != step.spec:
                    raise _Diverged(tuple(observed))
                for dst, src in zip(step.static, leaves):
                    dst.copy_(src)
        finally:
            _hoisted.reset(token)
        self.counts["replays"] += 1
        return self._outputs(path)

    def _outputs(self, path: _Path):
        leaves = path.out_leaves if self.reuse_outputs else [t.clone() for t in path.out_leaves]
        return _out_build(path.out_spec, iter(leaves))

    #: graphs evicted in a row without a replay after which the runner warns (once)
    UNUSED_EVICTIONS = 4

    def _evict(self) -> None:
        while len(self._graphs) > self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            self._release(old)
            self.counts["evictions"] += 1
            self._unused = self._unused + 1 if old.hits == 0 else 0
            if self._unused >= self.UNUSED_EVICTIONS:
                self._warn_once("unused", (
                    f"{self._unused} graphs of {self.name} in a row were released without a replay: its calls "
                    "rarely repeat a signature (inputs of new shapes, a value in the arguments, or adapter scales "
                    "that change from call to call), so each call pays a warm-up and a capture; "
                    f"the last signature released: {describe_signature(old.key)}"))

    def _release_path(self, path: _Path) -> None:
        for step in path.steps:
            if not isinstance(step, _Break):
                self.backend.release(step)
        path.steps = []
        path.out_leaves = []

    def _release(self, entry: _Entry) -> None:
        for path in entry.paths:
            self._release_path(path)
        entry.paths = []
        entry.inputs = []
        entry.constants = {}
        entry.call = None

    def _moved(self) -> None:
        """A watched tensor moved: release every graph (they read the old addresses)."""
        self.counts["moves"] += 1
        self.clear()
        self._watched = None
        what = (f"the parameters or buffers {self.name} reads moved since its CUDA graphs were captured "
                "(.to(), offloading, a .data swap, or a module or parameter replaced)")
        if self.counts["moves"] >= self.MAX_MOVES:
            self.enabled = False
            warnings.warn(f"bitfuse.graphs: {what}, {self.counts['moves']} times; CUDA graphs are off for it "
                          "from now on (it runs without them)", GraphCaptureWarning, stacklevel=4)
        else:
            self._warn_once("moved", f"{what}; its graphs are released and captured again")

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
        """Signatures with live graphs, least recently used first."""
        return list(self._graphs)

    def report(self) -> dict:
        """Per-signature memory, hits and segments, graphs least recently used first.

        Per graphed signature: hits (calls after the first), segments (graphs in its
        most recently used path: 1 without graph breaks), paths (captured paths) and
        their segment counts; static_input / static_output / constant / break bytes
        are exact; capture_allocated_bytes (memory_allocated after capture minus
        before) and capture_reserved_bytes (the same for memory_reserved: the pools'
        growth) estimate what the graphs hold, summed over paths."""
        with self._lock:
            rows = []
            for entry in self._graphs.values():
                paths = entry.paths
                row = {
                    "signature": describe_signature(entry.key),
                    "state": "graph",
                    "hits": entry.hits,
                    "segments": paths[0].segments,
                    "paths": [{"segments": p.segments, "breaks": len(p.breaks), "hits": p.hits} for p in paths],
                    "capture_s": round(sum(p.capture_s for p in paths), 6),
                    "capture_allocated_bytes": sum(p.stats.get("capture_allocated_bytes", 0) for p in paths),
                    "capture_reserved_bytes": sum(p.stats.get("capture_reserved_bytes", 0) for p in paths),
                    **entry.static_bytes(),
                }
                row["total_bytes_estimate"] = (
                    row["static_input_bytes"] + row["constant_bytes"] + row["break_bytes"]
                    + max(row["capture_reserved_bytes"], row["static_output_bytes"])
                )
                rows.append(row)
            for e in self._eager.values():
                rows.append(
                    {"signature": describe_signature(e.key), "state": "eager", "hits": e.hits, "reason": e.reason}
                )
            return {
                "name": self.name,
                "backend": self.backend.name,
                "enabled": self.enabled,  # (False after close(), or after MAX_MOVES moves of watched tensors)
                "graphs": len(self._graphs),
                "max_graphs": self.max_graphs,
                "total_bytes_estimate": sum(r.get("total_bytes_estimate", 0) for r in rows),
                **{k: self.counts[k] for k in _COUNTS},
                "signatures": rows,
            }


# ---------------------------------------------------------------- a module's forward

_UNSET = object()


def graph_runner_of(model: torch.nn.Module) -> GraphRunner | None:
    """The GraphRunner that wrap_model_for_graphs installed on `model`, if any."""
    return getattr(model.__dict__.get("forward"), "_bitfuse_graph_runner", None)


def wrap_model_for_graphs(model: torch.nn.Module, **options) -> GraphRunner:
    """Route `model.forward` (instance level) through a new GraphRunner; returns it.

    options: GraphRunner's; `watch` defaults to the model's parameters and buffers
    (`model_tensors`), and the `context` given is joined by the model's adapter state
    (`AdapterState`: PEFT's LoRA scales and switches). What the model needs (a
    `prepare`, a `hoist`, its mounted tiers as `context`) comes from its integration: `handle.enable_graphs()`
    (or `accelerate(cuda_graphs=True)`) passes them. The wrapper keeps the forward's
    signature (pipelines inspect it). `runner.restore()` puts the previous forward
    back and releases the graphs; wrapping again replaces the runner."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    unwrap_model_for_graphs(model)
    previous = model.__dict__.get("forward", _UNSET)  # e.g. the forward accelerate() installed
    options.setdefault("name", f"{type(model).__name__}.forward")
    options.setdefault("watch", functools.partial(model_tensors, model))  # its graphs read them in place
    adapters, context = AdapterState(model), options.get("context")  # the LoRA scales a graph would bake in
    options["context"] = adapters if context is None else (lambda: (context(), adapters()))
    runner = GraphRunner(model.forward, **options)

    @functools.wraps(runner.fn)
    def forward(*args, **kwargs):
        return runner(*args, **kwargs)

    forward._bitfuse_graph_runner = runner
    forward._bitfuse_previous_forward = previous
    model.forward = forward
    runner._on_restore = functools.partial(_unwrap, model, runner)
    return runner


def unwrap_model_for_graphs(model: torch.nn.Module) -> bool:
    """Remove the graph wrapper from `model` and release its graphs. Returns whether
    there was one."""
    runner = graph_runner_of(model)
    return runner is not None and _unwrap(model, runner)


def _unwrap(model: torch.nn.Module, runner: GraphRunner) -> bool:
    forward = model.__dict__.get("forward")
    runner.close()
    if getattr(forward, "_bitfuse_graph_runner", None) is not runner:
        return False  # already unwrapped, or wrapped again since
    previous = forward._bitfuse_previous_forward
    if previous is _UNSET:
        del model.forward
    else:
        model.forward = previous
    return True
