"""The launch core shared by every kernel: Triton import, `jit`, host-side
integer helpers, a bounded geometry cache, and `FastLaunch`, which replays a
compiled Triton kernel without re-binding its arguments on every call."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import inspect
import os
import threading

import torch

try:  # triton is optional: without it every op takes its eager reference
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

HAS_TRITON = triton is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def jit(fn):
    """`triton.jit`, or the plain function where Triton is missing (never launched then)."""
    return triton.jit(fn) if HAS_TRITON else fn


def row_kernel(*names):
    """`triton.jit` without specialising on the arguments `names` (e.g. the row count:
    one compile for every S, or a debug flag: the checked kernel is the production one)."""
    def wrap(fn):
        return triton.jit(fn, do_not_specialize=list(names)) if HAS_TRITON else fn

    return wrap


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (host side: `triton.next_power_of_2` is a
    constexpr function in Triton 3.6 and costs about a microsecond a call)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def device_index(device) -> int:
    """A CUDA device's index (the current one for "cuda"), or -1 for the CPU; an int
    passes through."""
    if device.__class__ is int:
        return device
    device = torch.device(device)
    return -1 if device.type == "cpu" else (torch.cuda.current_device() if device.index is None else device.index)


def probe_allowed(device: int) -> bool:
    """Whether a probe of the running build (a few eager ops and launches, compared on
    the host) may run now on `device` (an index): not while tracing or capturing."""
    return not (torch.compiler.is_compiling() or (device >= 0 and torch.cuda.is_current_stream_capturing()))


def needs_int64(*extents) -> bool:
    """Whether offsets may pass 2**31: extents are (size, stride) pairs of every operand."""
    return sum(abs(stride) * (size - 1) for size, stride in extents) >= 2**31 - 1


def register_op(name: str, fn, fake):
    """`fn` (type-annotated, tensors in and out) as the custom op `torch.ops.bitfuse.<name>`,
    `fake` its shape function for tracing, and a backward that says there is none. The
    op serves torch.compile graphs and capture; eager callers launch directly (this
    boundary costs tens of microseconds a call)."""
    op = torch.library.custom_op(f"bitfuse::{name}", fn, mutates_args=())
    op.register_fake(fake)
    return inference_only(op)


def inference_only(op):
    """Register a backward for the custom op `op` that says it has none (the kernels
    are for inference; sites take eager PyTorch whenever autograd records)."""
    name = op._name

    def backward(ctx, *grads):
        raise RuntimeError(f"torch.ops.bitfuse.{name} has no backward: bitfuse's kernels are for inference. Call the model under "
                           "torch.no_grad() or torch.inference_mode(), or use the eager ops to train.")

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
    return op


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of `shape`, as torch lays it out (a size below
    1 counts as 1: c10's contiguous_strides)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


try:  # the allocation Inductor's generated code makes: a CUDA tensor without the dispatcher
    from torch._C._dynamo.guards import _empty_strided_cuda
except Exception:  # pragma: no cover - depends on the build
    _empty_strided_cuda = None


class Output:
    """A new tensor of one shape, strides and dtype on one device, for each call of a
    bound launch (whose call key fixes them): `torch.empty_strided`, allocated without the
    dispatcher (`_empty_strided_cuda`, the current device's caching allocator, as
    Inductor's wrappers allocate) where the device is the current CUDA device. The same
    tensor as `torch.empty_like(x, memory_format=torch.contiguous_format)` for
    `Output.contiguous_like(x)`, in about half its host time (bench/NOTES.md, fourteenth
    session)."""

    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, shape, stride, dtype, device: int):
        self.shape, self.stride, self.dtype, self.device = tuple(shape), tuple(stride), dtype, device

    @classmethod
    def contiguous_like(cls, x) -> "Output":
        return cls(x.shape, contiguous_strides(x.shape), x.dtype, x.get_device())

    def __call__(self) -> torch.Tensor:
        device = self.device
        if device >= 0 and _empty_strided_cuda is not None and torch._C._cuda_getDevice() == device:
            return _empty_strided_cuda(self.shape, self.stride, self.dtype)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                   device=torch.device("cpu") if device < 0 else torch.device("cuda", device))


class GeometryCache:
    """The guard's per-layout work (a plan's geometry and launch, or the reason a
    layout takes the reference), computed once per key; bounded, cleared when full."""

    __slots__ = ("entries", "limit")

    def __init__(self, limit: int = 4096):
        self.entries: dict = {}
        self.limit = limit

    def get(self, key, compute, *args):
        entry = self.entries.get(key)
        if entry is None:
            entry = compute(*args)
            if len(self.entries) >= self.limit:
                self.entries.clear()
            self.entries[key] = entry
        return entry

    def clear(self) -> None:
        self.entries.clear()


def _no_hooks(hook) -> bool:
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


class Recipe:
    """One launch with everything but the tensors fixed: grid, integer arguments,
    constexprs and warps. Built once per cached geometry, it keeps the compiled
    kernel per pointer-alignment pattern, so a call is a dict lookup and the launch.
    `fast`: the launch of the common case (every pointer 16-byte aligned, the operands'
    dtypes and device those of its first such launch) with its arguments but the
    stream and the pointers laid out, so that such a call builds no key."""

    __slots__ = ("grid", "ints", "consts", "num_warps", "entries", "fast")

    def __init__(self, grid, ints: tuple, consts: tuple, num_warps: int):
        self.grid = (grid[0], grid[1], grid[2] if len(grid) > 2 else 1)
        self.ints, self.consts, self.num_warps = ints, consts, num_warps
        self.entries = {}  # pointer alignments -> (run, head, metadata)
        self.fast = None  # (device, dtypes, run, grid x, y, z, the arguments before the pointers, after them)


class FastLaunch:
    """Launch a Triton kernel without re-binding its arguments on every call.

    `JITFunction.run` re-derives the specialization of every argument on each
    launch (~10 us of host time for a kernel with 17 arguments). The first call
    with a given key goes through it and keeps the compiled kernel; later calls
    with the same key launch that kernel directly. The key holds every integer
    argument's value and every pointer's element type and 16-byte alignment, which
    determine Triton's specialization, so a replayed kernel is the one Triton would
    pick (a key without the element types once replayed a kernel compiled for fp32
    weights on bf16 ones: tests/test_launch.py).
    Launch hooks (a Python profiler such as Proton) installed when a key is first
    launched keep that key on Triton's own path, so the hooks see every call.

    `launch(recipe, tensors)` is the same for a launch whose integers are fixed
    (`Recipe`): it skips building and hashing the key.

    Operands on a CUDA device other than the current one launch under that device
    (eager PyTorch runs them wherever they are; Triton compiles for, and launches
    on, the current device).
    """

    MAX_KEYS = 4096

    def __init__(self, fn, constexpr_names: tuple[str, ...] = (), fp_fusion: bool = False):
        self.fn = fn
        self.names = constexpr_names
        self.fp_fusion = fp_fusion  # exact kernels keep eager's roundings: no FMA contraction
        self.compiled = {}
        self.pending = {}  # key -> Triton's FutureKernel, compiling in the background
        self.direct = _knobs is not None and not INTERPRET

    def __call__(self, grid, tensors, ints: tuple, consts: tuple, num_warps: int):
        device = tensors[0].get_device()
        if device >= 0 and device != torch._C._cuda_getDevice():
            with torch.cuda.device(device):
                return self(grid, tensors, ints, consts, num_warps)
        ptrs = [t.data_ptr() for t in tensors]
        key = (_pointer_types(tensors, ptrs), ints, consts, num_warps, device)
        entry = self.compiled.get(key)
        if entry is None:
            self._first(key, grid, tensors, ints, consts, num_warps)
            return
        # pointers as ints: Triton's launcher takes them as they are, where for a
        # tensor it calls data_ptr() and cuPointerGetAttribute (the guard has
        # already checked every operand is on this CUDA device)
        run, head, metadata = entry
        run(grid[0], grid[1], grid[2] if len(grid) > 2 else 1, torch._C._cuda_getCurrentRawStream(device),
            *head, metadata, None, None, None, *ptrs, *ints, *consts)

    def launch(self, recipe: Recipe, tensors) -> None:
        """Launch `recipe` on `tensors` (every one of the dtype and device the recipe
        was built for: the caller's geometry cache is keyed by them).

        The common case takes `recipe.fast`: every pointer 16-byte aligned (an OR of
        the addresses), each operand of the dtype the fast entry was made for and on
        its device, which is the current one; the compiled kernel is then the one the
        full key (`_pointer_types`) picks, without building that key. Anything else
        takes the keyed path."""
        fast = recipe.fast
        if fast is not None:
            device, dtypes, run, gx, gy, gz, before, after = fast
            if len(tensors) == len(dtypes):
                ptrs = []
                bits = 0
                for t, dtype in zip(tensors, dtypes):
                    if t.dtype is not dtype:
                        bits = 1
                        break
                    p = t.data_ptr()
                    bits |= p
                    ptrs.append(p)
                if not bits & 15 and tensors[0].get_device() == device and torch._C._cuda_getDevice() == device:
                    run(gx, gy, gz, torch._C._cuda_getCurrentRawStream(device), *before, *ptrs, *after)
                    return
        device = tensors[0].get_device()
        if device >= 0 and device != torch._C._cuda_getDevice():
            with torch.cuda.device(device):
                return self.launch(recipe, tensors)
        ptrs = [t.data_ptr() for t in tensors]
        aligned = _pointer_types(tensors, ptrs)
        entry = recipe.entries.get(aligned)
        if entry is None:
            key = (aligned, recipe.ints, recipe.consts, recipe.num_warps, device)
            entry = self.compiled.get(key)
            if entry is None:
                self._first(key, recipe.grid, tensors, recipe.ints, recipe.consts, recipe.num_warps)
                entry = self.compiled.get(key)
                if entry is not None:
                    recipe.entries[aligned] = entry
                return
            recipe.entries[aligned] = entry
        run, head, metadata = entry
        grid = recipe.grid
        if recipe.fast is None and device >= 0 and all(a for _, a in aligned):
            recipe.fast = (device, tuple(t for t, _ in aligned), run, grid[0], grid[1], grid[2],
                           (*head, metadata, None, None, None), (*recipe.ints, *recipe.consts))
        run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device),
            *head, metadata, None, None, None, *ptrs, *recipe.ints, *recipe.consts)

    def _first(self, key, grid, tensors, ints, consts, num_warps) -> None:
        """Launch through Triton (compiling if needed) and keep the kernel for `key`.
        Inside `deferring()`, a kernel not compiled yet is handed to the compile
        threads instead, and nothing is launched (see `deferring`)."""
        deferred = _defer.get()
        if key in self.pending:
            if deferred is not None and not self.pending[key].future.done():
                deferred.pending += 1
                return
        elif deferred is not None and _ASYNC is not None:
            future = self._submit(grid, tensors, ints, consts, num_warps)
            if future is not None:
                self.pending[key] = future
                deferred.pending += 1
                return
        if self.pending:
            # Triton holds a compiling kernel as a FutureKernel, which its launch path
            # cannot run: wait for this kernel's compiles (keys sharing Triton's entry)
            mine, others = self.pending.pop(key, None), list(self.pending.values())
            self.pending.clear()
            for future in others:
                try:
                    future.result()
                except Exception:
                    pass  # (raised again at that key's own launch)
            if mine is not None:
                mine.result()  # a compile error raises here, as a synchronous compile's would
        k = self.fn[grid](*tensors, *ints, **dict(zip(self.names, consts)), num_warps=num_warps,
                          enable_fp_fusion=self.fp_fusion)
        if not self.direct or k is None:
            return
        try:
            hooks_off = _no_hooks(_knobs.runtime.launch_enter_hook) and _no_hooks(_knobs.runtime.launch_exit_hook)
            c_launch = _c_launch(k.run)
            if c_launch is None:
                entry = (k.run, (k.function,), k.packed_metadata)
            else:
                entry = (c_launch, (k.function, k.run.launch_cooperative_grid, k.run.launch_pdl, None, None),
                         k.packed_metadata)
        except AttributeError:  # another Triton's launcher: keep its own path
            self.direct = False
            return
        if hooks_off:
            if len(self.compiled) >= self.MAX_KEYS:
                self.compiled.clear()
            self.compiled[key] = entry

    def _submit(self, grid, tensors, ints, consts, num_warps):
        """Start compiling this launch's kernel on the compile threads; returns Triton's
        FutureKernel, or None when the kernel is already compiled (in Triton's cache)."""
        global _executor
        with _submit_lock:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="bitfuse-compile")
        token = _ASYNC.active_mode.set(_ASYNC.AsyncCompileMode(_executor))
        try:
            k = self.fn.warmup(*tensors, *ints, **dict(zip(self.names, consts)), grid=grid, num_warps=num_warps,
                               enable_fp_fusion=self.fp_fusion)
        finally:
            _ASYNC.active_mode.reset(token)
        future = getattr(k, "future", None)
        if future is None:
            return None
        with _submit_lock:
            _outstanding.append(future)
        return k


# ---------------------------------------------------------------- compiles in the background
#
# A model's first forward meets each kernel signature once. Compiling them one after
# another as they come (about 0.3 s each) made a full-depth LTX-2 first call 12 s
# longer than eager's. Inside `deferring()` a launch whose kernel is not compiled yet
# starts its compile on a thread pool (Triton's AsyncCompileMode: its parser and MLIR
# passes and ptxas run in parallel threads) and launches nothing; the caller (the gate)
# counts it and returns eager's result for that call. `settle()` waits for them all.

try:
    from triton.runtime import _async_compile as _ASYNC

    if not (hasattr(_ASYNC, "AsyncCompileMode") and hasattr(_ASYNC, "active_mode")):
        _ASYNC = None
except Exception:  # pragma: no cover - Triton without async compiles: always synchronous
    _ASYNC = None
if INTERPRET:
    _ASYNC = None



def _compile_threads() -> int:
    """BITFUSE_COMPILE_THREADS (a positive integer), else min(8, the CPU count)."""
    default = max(1, min(8, os.cpu_count() or 1))
    text = os.environ.get("BITFUSE_COMPILE_THREADS", "").strip()
    if not text:
        return default
    if text.isdigit() and int(text) > 0:
        return int(text)
    import warnings

    warnings.warn(f"bitfuse: BITFUSE_COMPILE_THREADS={text!r} is not a positive integer; using {default}",
                  UserWarning, stacklevel=2)
    return default


COMPILE_THREADS = _compile_threads()  # the background compiles' threads (read at import)
_executor = None
_submit_lock = threading.Lock()
_outstanding: list = []  # concurrent futures of the compiles started and not yet waited for


class Deferred:
    """What one `deferring()` block found: `pending`, the launches it skipped because
    their kernel was still compiling."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending = 0


_defer: contextvars.ContextVar[Deferred | None] = contextvars.ContextVar("bitfuse_defer", default=None)


@contextlib.contextmanager
def deferring():
    """Launches inside whose kernel is not compiled yet start compiling in the
    background and are skipped (not launched); yields a `Deferred` counting them.
    Where Triton has no async compile mode, launches compile in place as usual."""
    state = Deferred()
    token = _defer.set(state)
    try:
        yield state
    finally:
        _defer.reset(token)


@contextlib.contextmanager
def synchronous():
    """Launches inside compile in place and run, even within a `deferring()` block
    (a probe of the running build, whose outputs its caller reads at once)."""
    token = _defer.set(None)
    try:
        yield
    finally:
        _defer.reset(token)


def compiles_pending() -> int:
    """How many background compiles have started and not been waited for."""
    with _submit_lock:
        return sum(not f.done() for f in _outstanding)


def settle() -> None:
    """Wait for every background compile started so far (their errors surface at the
    kernel's next launch, where a synchronous compile would have raised them)."""
    with _submit_lock:
        futures, _outstanding[:] = list(_outstanding), []
    if futures:
        concurrent.futures.wait(futures)


def _pointer_types(tensors, ptrs) -> tuple:
    """What Triton specializes a kernel's pointer arguments on: each one's element type
    (the kernel loads and stores that type) and its 16-byte alignment."""
    return tuple([(t.dtype, p & 15 == 0) for t, p in zip(tensors, ptrs)])


def _c_launch(run):
    """The C `launch` behind Triton's launcher object `run`, when calling it directly
    is what `run(...)` does: no scratch buffers to allocate, and a `__call__` whose
    source passes (cooperative, pdl, global scratch, profile scratch) and then its
    arguments unchanged (Triton 3.6's; any other source keeps `run`). Saves the
    Python frame of `__call__`, about a microsecond a launch."""
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    cls = type(run)
    ok = _C_LAUNCH_OK.get(cls)
    if ok is None:
        try:
            src = "".join(inspect.getsource(cls.__call__).split())
        except (OSError, TypeError):
            src = ""
        ok = _C_LAUNCH_OK[cls] = _C_LAUNCH_CALL in src
    return getattr(run, "launch", None) if ok else None


_C_LAUNCH_CALL = ("self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,"
                  "global_scratch,profile_scratch,*args)")
_C_LAUNCH_OK: dict = {}


try:
    from triton import knobs as _knobs
except Exception:  # pragma: no cover - older Triton: no direct launch
    _knobs = None
