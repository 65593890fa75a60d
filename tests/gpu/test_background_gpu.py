"""First sights compiled in the background, with this machine's Triton: the call
that starts a compile returns eager's bits, leaving the block waits for it, and
the next call verifies and runs the kernel."""

import pytest
import torch

from bitfuse import policy
from bitfuse.numerics import same_bits
from bitfuse.ops import _launch
from bitfuse.ops import modulate as M

pytestmark = pytest.mark.gpu


def _forget_compiled(fast: _launch.FastLaunch) -> None:
    """Make the next launch a first sight that compiles (Triton's in-memory kernels
    and FastLaunch's entries forgotten; the disk cache may still serve it)."""
    fast.compiled.clear()
    fast.pending.clear()
    fast.fn.device_caches.clear()


@pytest.mark.skipif(_launch._ASYNC is None, reason="this Triton has no async compile mode")
@pytest.mark.parametrize("layout", ["per-sample", "per-token"])
def test_a_first_sight_compiles_in_the_background(layout):
    gen = torch.Generator(device="cuda").manual_seed(7)
    B, S, D = 2, 1031, 2240
    x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    rows = 1 if layout == "per-sample" else S
    scale, shift = (torch.randn(B, rows, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    args = (x, scale, shift)
    ref = M.modulate_reference(*args)
    plan = M.plan_modulate(*args)
    assert not isinstance(plan, str), plan
    _forget_compiled(M._launch)
    policy.reset_verdicts()
    with policy.background_compiles():
        out = policy.gated(M.SPEC, "lossless", plan, args)
        assert M._launch.pending, "the first sight should have started a background compile"
        assert policy.state(M.SPEC, "lossless", plan) is None  # no verdict while compiling
        assert same_bits(out, ref)
    assert _launch.compiles_pending() == 0  # leaving the block waited for it
    out = policy.gated(M.SPEC, "lossless", plan, args)
    assert policy.state(M.SPEC, "lossless", plan) is True
    assert same_bits(out, ref) and not M._launch.pending
    again = policy.gated(M.SPEC, "lossless", plan, args)  # verified: the direct launcher
    assert same_bits(again, ref)


@pytest.mark.skipif(_launch._ASYNC is None, reason="this Triton has no async compile mode")
def test_a_synchronous_launch_waits_for_a_background_compile_of_its_kernel():
    """A launch outside `deferring` of a kernel whose compile is still in flight (Triton
    holds it as a FutureKernel) waits for it instead of failing."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(1, 126, 2240, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale, shift = (torch.randn(1, 1, 2240, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    plan = M.plan_modulate(x, scale, shift)
    _forget_compiled(M._launch)
    with _launch.deferring() as deferred:
        M.launch_modulate(plan)
    assert deferred.pending == 1
    out = M.launch_modulate(plan)
    assert same_bits(out, M.modulate_reference(x, scale, shift))
    _launch.settle()
