"""FastLaunch's direct call of Triton's C launcher: taken only when it is what the
launcher object's own `__call__` would do (CPU: fake launcher classes)."""

from bitfuse.ops import _launch as launch_core
from bitfuse.ops._launch import _c_launch, next_pow2


def c_launch(*args):  # stands for the compiled C function
    return args


class Triton36Launcher:
    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False
    launch = staticmethod(c_launch)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = None
        profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class OtherLauncher(Triton36Launcher):
    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, *args)  # another argument order


def test_direct_call_only_for_the_known_launcher_without_scratch():
    launch_core._C_LAUNCH_OK.clear()
    assert _c_launch(Triton36Launcher()) is c_launch
    assert _c_launch(OtherLauncher()) is None
    with_scratch = Triton36Launcher()
    with_scratch.global_scratch_size = 128
    assert _c_launch(with_scratch) is None
    profiled = Triton36Launcher()
    profiled.profile_scratch_size = 64
    assert _c_launch(profiled) is None


def test_next_pow2_matches_the_definition():
    assert [next_pow2(n) for n in (1, 2, 3, 64, 65, 2240, 4096, 4097)] == [1, 2, 4, 64, 128, 4096, 4096, 8192]


class FakeTensor:
    """What FastLaunch reads from an operand: its address, device and dtype."""

    def __init__(self, ptr, device=0, dtype="bf16"):
        self.ptr, self.device, self.dtype = ptr, device, dtype

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return self.device


class FakeCuda:
    """The current device, and `torch.cuda.device(i)` switching it."""

    def __init__(self, monkeypatch):
        self.current, self.entered = 0, []
        monkeypatch.setattr(launch_core.torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
        monkeypatch.setattr(launch_core.torch._C, "_cuda_getDevice", lambda: self.current, raising=False)
        monkeypatch.setattr(launch_core.torch.cuda, "device", self.device)

    def device(self, index):
        cuda = self

        class Switch:
            def __enter__(self):
                cuda.entered.append(index)
                self.before, cuda.current = cuda.current, index

            def __exit__(self, *exc):
                cuda.current = self.before

        return Switch()


class FakeKernel:
    """Triton's `fn[grid](...)`: records the call, returns a compiled kernel with a launcher."""

    def __init__(self):
        self.calls, self.launched = [], []
        run = Triton36Launcher()
        run.launch = lambda *args: self.launched.append(args)
        self.compiled = type("Compiled", (), {"run": run, "function": "fn", "packed_metadata": "meta"})()

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled
        return call


def test_recipe_launches_through_triton_once_per_alignment_then_directly(monkeypatch):
    FakeCuda(monkeypatch)
    launch_core._C_LAUNCH_OK.clear()
    kernel = FakeKernel()
    launcher = launch_core.FastLaunch(kernel, ("EVEN", "BLOCK"))
    launcher.direct = True  # (the interpreter turns it off)
    recipe = launch_core.Recipe((3, 1, 2), (5, 64), (True, 128), 4)
    aligned = (FakeTensor(4096), FakeTensor(8192))
    launcher.launch(recipe, aligned)  # first sight: Triton's path, constexprs by name
    assert kernel.calls == [((3, 1, 2), (aligned[0], aligned[1], 5, 64),
                             {"EVEN": True, "BLOCK": 128, "num_warps": 4, "enable_fp_fusion": False})]
    assert kernel.launched == []
    launcher.launch(recipe, (FakeTensor(4096 + 256), FakeTensor(8192)))  # same alignment: direct
    assert len(kernel.calls) == 1
    assert kernel.launched == [(3, 1, 2, 7, "fn", False, False, None, None, "meta", None, None, None,
                                4096 + 256, 8192, 5, 64, True, 128)]
    launcher.launch(recipe, (FakeTensor(4096 + 2), FakeTensor(8192)))  # another alignment: Triton again
    assert len(kernel.calls) == 2 and len(recipe.entries) == 2
    # the plain call with the same integers shares the compiled entry
    launcher((3, 1, 2), aligned, (5, 64), (True, 128), 4)
    assert len(kernel.calls) == 2 and len(kernel.launched) == 2


def test_operands_on_another_device_launch_under_that_device(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    launch_core._C_LAUNCH_OK.clear()
    kernel = FakeKernel()
    seen = []
    kernel.compiled.run.launch = lambda *args: seen.append((cuda.current, args[3]))
    launcher = launch_core.FastLaunch(kernel, ("BLOCK",))
    launcher.direct = True
    recipe = launch_core.Recipe((1, 1, 1), (5,), (128,), 4)
    on_1 = (FakeTensor(4096, device=1),)
    launcher.launch(recipe, on_1)  # through Triton: it compiles for the current device
    launcher.launch(recipe, on_1)  # directly
    launcher((1, 1, 1), on_1, (5,), (128,), 4)  # the plain call too
    assert cuda.entered == [1, 1, 1] and cuda.current == 0
    assert seen == [(1, 7), (1, 7)]
    launcher.launch(recipe, (FakeTensor(4096, device=0),))  # the current device: no switch
    assert cuda.entered == [1, 1, 1]


def test_an_operand_of_another_dtype_compiles_its_own_kernel(monkeypatch):
    """Triton specializes each pointer on its element type: the same integers and
    alignments with a weight of another dtype must not replay the kernel compiled for
    the first (it did, for x bf16 with fp32 then bf16 weights: the fuzz run's silent
    differences in layer_norm_f32, 2026-12-01), on either launch path."""
    FakeCuda(monkeypatch)
    launch_core._C_LAUNCH_OK.clear()
    kernel = FakeKernel()
    launcher = launch_core.FastLaunch(kernel, ("BLOCK",))
    launcher.direct = True
    fp32_weight = (FakeTensor(4096), FakeTensor(8192, dtype="fp32"))
    bf16_weight = (FakeTensor(4096), FakeTensor(8192, dtype="bf16"))
    launcher((1, 1, 1), fp32_weight, (5,), (128,), 4)
    launcher((1, 1, 1), bf16_weight, (5,), (128,), 4)
    assert [call[1][1].dtype for call in kernel.calls] == ["fp32", "bf16"]  # both through Triton
    launcher((1, 1, 1), bf16_weight, (5,), (128,), 4)  # then each directly
    launcher((1, 1, 1), fp32_weight, (5,), (128,), 4)
    assert len(kernel.calls) == 2 and len(kernel.launched) == 2
    recipe = launch_core.Recipe((1, 1, 1), (6,), (128,), 4)
    launcher.launch(recipe, fp32_weight)
    launcher.launch(recipe, bf16_weight)
    assert [call[1][1].dtype for call in kernel.calls[2:]] == ["fp32", "bf16"] and len(recipe.entries) == 2


def test_the_fast_entry_serves_only_aligned_operands_of_its_dtypes_on_the_current_device(monkeypatch):
    """`Recipe.fast` (an OR of the addresses instead of the full key) launches exactly
    what the keyed path launches, and only where that path would pick the same
    compiled kernel: a misaligned pointer, an operand of another dtype or on another
    device than the current one goes the keyed way."""
    cuda = FakeCuda(monkeypatch)
    launch_core._C_LAUNCH_OK.clear()
    kernel = FakeKernel()
    launcher = launch_core.FastLaunch(kernel, ("BLOCK",))
    launcher.direct = True
    recipe = launch_core.Recipe((3, 1, 2), (5, 64), (128,), 4)
    launcher.launch(recipe, (FakeTensor(4096), FakeTensor(8192)))  # compiles
    assert recipe.fast is None
    launcher.launch(recipe, (FakeTensor(4096 + 16), FakeTensor(8192)))  # keyed, direct: makes the fast entry
    assert recipe.fast is not None and len(kernel.calls) == 1
    launcher.launch(recipe, (FakeTensor(4096 + 32), FakeTensor(8192 + 48)))  # fast
    expected = [(3, 1, 2, 7, "fn", False, False, None, None, "meta", None, None, None, p, q, 5, 64, 128)
                for p, q in ((4096 + 16, 8192), (4096 + 32, 8192 + 48))]
    assert kernel.launched == expected and len(kernel.calls) == 1
    launcher.launch(recipe, (FakeTensor(4096 + 8), FakeTensor(8192)))  # misaligned: Triton's path
    assert len(kernel.calls) == 2
    launcher.launch(recipe, (FakeTensor(4096), FakeTensor(8192, dtype="fp32")))  # another dtype: compiles its own
    assert [call[1][1].dtype for call in kernel.calls] == ["bf16", "bf16", "fp32"]
    on_1 = (FakeTensor(4096, device=1), FakeTensor(8192, device=1))
    launcher.launch(recipe, on_1)  # another device: launched under it
    assert cuda.entered == [1]
    cuda.current = 1  # the fast entry's device is 0: not the current one now
    before = len(kernel.launched)
    launcher.launch(recipe, (FakeTensor(4096), FakeTensor(8192)))
    assert cuda.entered == [1, 0] and len(kernel.launched) == before + 1
    assert kernel.launched[-1][13:15] == (4096, 8192)


# ---------------------------------------------------------------- compiles in the background


class FakeAsync:
    """Triton's async-compile module as `_launch` uses it: the active mode (a context
    variable) and the mode, which hands compiles to its executor."""

    def __init__(self):
        import contextvars

        self.active_mode = contextvars.ContextVar("mode", default=None)

        class AsyncCompileMode:
            def __init__(self, executor):
                self.executor = executor

        self.AsyncCompileMode = AsyncCompileMode


class FutureKernel:
    def __init__(self, future):
        self.future = future

    def result(self):
        return self.future.result()


class SlowKernel(FakeKernel):
    """A kernel whose compile, started by `warmup` under an async mode, waits for `go`
    (or raises, when `broken`)."""

    def __init__(self, fake_async, broken=False):
        import threading

        super().__init__()
        self.fake_async, self.broken, self.go, self.compiles = fake_async, broken, threading.Event(), 0

    def _compile(self):
        self.go.wait(10)
        self.compiles += 1
        if self.broken:
            raise RuntimeError("ptxas says no")
        return self.compiled

    def warmup(self, *args, grid, **kwargs):
        mode = self.fake_async.active_mode.get()
        assert mode is not None, "warmup outside an async mode would compile in place"
        return FutureKernel(mode.executor.submit(self._compile))


def _slow_launcher(monkeypatch, broken=False):
    """A FastLaunch of a SlowKernel, with fake CUDA and a fake async-compile module."""
    FakeCuda(monkeypatch)
    fake_async = FakeAsync()
    monkeypatch.setattr(launch_core, "_ASYNC", fake_async)
    kernel = SlowKernel(fake_async, broken)
    return kernel, launch_core.FastLaunch(kernel, ("BLOCK",))


ARGS = ((1, 1, 1), (FakeTensor(4096),), (5,), (128,), 4)


def test_a_deferred_launch_compiles_in_the_background_and_launches_nothing(monkeypatch):
    kernel, launcher = _slow_launcher(monkeypatch)
    with launch_core.deferring() as deferred:
        launcher(*ARGS)
        launcher(*ARGS)  # still compiling: skipped again, not submitted twice
    assert deferred.pending == 2 and kernel.calls == [] and launch_core.compiles_pending() == 1
    kernel.go.set()
    launch_core.settle()
    assert launch_core.compiles_pending() == 0 and kernel.compiles == 1
    with launch_core.deferring() as deferred:
        launcher(*ARGS)  # compiled: launched, through Triton's path this once
    assert deferred.pending == 0 and len(kernel.calls) == 1
    launcher(*ARGS)  # outside deferring too
    assert len(kernel.calls) == 2


def test_outside_deferring_a_launch_compiles_in_place(monkeypatch):
    kernel, launcher = _slow_launcher(monkeypatch)
    launcher(*ARGS)
    assert len(kernel.calls) == 1 and kernel.compiles == 0  # (warmup never called)
    monkeypatch.setattr(launch_core, "_ASYNC", None)  # a Triton without async compiles
    with launch_core.deferring() as deferred:
        launcher((1, 1, 1), (FakeTensor(8192),), (6,), (128,), 4)
    assert deferred.pending == 0 and len(kernel.calls) == 2


def test_a_background_compile_error_raises_at_the_next_launch(monkeypatch):
    import pytest

    kernel, launcher = _slow_launcher(monkeypatch, broken=True)
    kernel.go.set()
    with launch_core.deferring():
        launcher(*ARGS)
    launch_core.settle()
    with pytest.raises(RuntimeError, match="ptxas says no"):
        launcher(*ARGS)
    assert kernel.calls == []


def test_compile_threads_from_the_environment(monkeypatch):
    import pytest

    monkeypatch.setenv("BITFUSE_COMPILE_THREADS", "3")
    assert launch_core._compile_threads() == 3
    monkeypatch.delenv("BITFUSE_COMPILE_THREADS")
    assert 1 <= launch_core._compile_threads() <= 8
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("BITFUSE_COMPILE_THREADS", bad)
        with pytest.warns(UserWarning, match="not a positive integer"):
            assert 1 <= launch_core._compile_threads() <= 8
