"""The first-sight gate and quality tiers (CPU: fast paths are stand-ins)."""

import asyncio
import threading
import warnings

import pytest
import torch

import bitfuse
from bitfuse import policy
from bitfuse.ops.spec import OpSpec


class Plan:
    def __init__(self, key=(torch.bfloat16, 0, "per-sample", "per-sample")):
        self.key = key


def reference(a, b):
    return a * (1 + b)


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 7, generator=g), torch.randn(7, generator=g)


class Fast:
    """A stand-in kernel: right, wrong, or raising, counting its calls; like the real
    launchers it writes into `out` when given one."""

    def __init__(self, args, behaviour="right", fn=reference):
        self.args, self.behaviour, self.calls, self.fn = args, behaviour, 0, fn

    def __call__(self, plan, out=None):
        self.calls += 1
        if self.behaviour == "raise":
            raise RuntimeError("kernel exploded")
        value = self.fn(*self.args)
        if self.behaviour == "wrong":
            value = value.clone()
            value[0, 0] = value[0, 0] + 1
        elif self.behaviour == "skips-a-row":  # a kernel that never writes row 0
            if out is None:
                out = torch.empty_like(value)
            out[1:] = value[1:]
            return out
        if out is None:
            return value
        out.copy_(value)
        return out


def spec(fast, ref=reference, name="op", **kw):
    return OpSpec(name=name, reference=ref, plan=None, launch={"lossless": fast, "high": fast},
                  tiers=("lossless", "high"), **kw)


def test_verifies_once_then_caches():
    args = _args()
    fast = Fast(args)
    calls = {"ref": 0}

    def ref(*a):
        calls["ref"] += 1
        return reference(*a)

    for _ in range(3):
        out = policy.gated(spec(fast, ref), "lossless", Plan(), args)
        assert torch.equal(out, reference(*args))
    assert fast.calls == 4 and calls["ref"] == 1  # first sight runs the fast path twice, the reference once
    (v,) = bitfuse.verdicts()
    assert v.status == "verified" and v.active and v.op == "op" and v.tier == "lossless" and "bfloat16" in v.signature


def test_mismatch_disables_warns_once_and_returns_reference():
    args = _args()
    fast = Fast(args, "wrong")
    s = spec(fast)
    with pytest.warns(policy.FallbackWarning, match="broke its contract"):
        out = policy.gated(s, "lossless", Plan(), args)
    assert torch.equal(out, reference(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for _ in range(3):
            assert torch.equal(policy.gated(s, "lossless", Plan(), args), reference(*args))
    assert fast.calls == 2  # disabled for good after first sight
    (v,) = bitfuse.verdicts()
    assert v.status == "mismatch" and "1 of 35 elements differ bitwise" in v.detail


@pytest.mark.parametrize("probe", ["agrees", "differs", "raises"])
def test_a_probe_runs_once_after_the_call_s_own_check(probe):
    """`OpSpec.probe` runs once, at first sight, after the call's own data agreed: a why
    (or an exception) is a mismatch and the reference runs for good; None verifies."""
    args = _args()
    fast, seen = Fast(args), []

    def check(plan):
        seen.append(plan.key)
        if probe == "raises":
            raise RuntimeError("probe exploded")
        return None if probe == "agrees" else "built operands differ"

    s = spec(fast, probe=check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.FallbackWarning)
        for _ in range(3):
            assert torch.equal(policy.gated(s, "lossless", Plan(), args), reference(*args))
    (v,) = bitfuse.verdicts()
    assert len(seen) == 1
    if probe == "agrees":
        assert v.status == "verified" and fast.calls == 4
    else:
        assert v.status == "mismatch" and fast.calls == 2
        assert v.detail == ("built operands differ" if probe == "differs" else
                            "the probe failed: RuntimeError: probe exploded")


def test_a_signed_zero_is_a_mismatch():
    """Lossless means bitwise: -0.0 where eager gives +0.0 breaks it (torch.equal can't see it)."""
    a = torch.tensor([[0.0, 1.0]])
    b = torch.tensor([0.0, 0.0])

    def negated_zero(a, b):
        out = reference(a, b)
        out[0, 0] = -0.0
        return out

    assert torch.equal(negated_zero(a, b), reference(a, b))
    with pytest.warns(policy.FallbackWarning):
        out = policy.gated(spec(Fast((a, b), fn=negated_zero)), "lossless", Plan(), (a, b))
    assert out[0, 0].item() == 0.0 and not torch.signbit(out[0, 0])
    assert "1 of 2 elements differ bitwise" in bitfuse.verdicts()[0].detail


def test_a_kernel_that_leaves_outputs_unwritten_is_caught():
    """First sight launches into NaN-poisoned outputs: stale memory that happens to hold
    the right values can't pass for a write."""
    args = _args()
    with pytest.warns(policy.FallbackWarning):
        policy.gated(spec(Fast(args, "skips-a-row")), "lossless", Plan(), args)
    assert bitfuse.verdicts()[0].status == "mismatch"


def test_first_sight_returns_eagers_layout():
    """The output returned at first sight has eager's strides, not only its values: a
    channels-last result read by a convolution downstream picks the convolution's
    algorithm (and its bits) by layout. Found on Sana's GLUMBConv, where a contiguous
    first-sight output sent the depthwise convolution to another backend."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 4, 5, generator=g).to(memory_format=torch.channels_last)

    def silu(t):
        return torch.nn.functional.silu(t)

    out = policy.gated(spec(Fast((x,), fn=silu), ref=silu), "lossless", Plan(), (x,))
    ref = silu(x)
    assert ref.stride() != ref.contiguous().stride()  # the case is a real channels-last one
    assert out.stride() == ref.stride() and torch.equal(out, ref)
    assert bitfuse.verdicts()[0].status == "verified"


def test_a_launch_path_wrong_only_after_the_first_call_is_caught():
    """The first launch compiles through Triton; later ones take the direct launcher.
    First sight checks both."""
    args = _args()

    class SecondWrong(Fast):
        def __call__(self, plan, out=None):
            self.behaviour = "right" if self.calls == 0 else "wrong"
            return super().__call__(plan, out)

    with pytest.warns(policy.FallbackWarning):
        out = policy.gated(spec(SecondWrong(args)), "lossless", Plan(), args)
    assert torch.equal(out, reference(*args)) and bitfuse.verdicts()[0].status == "mismatch"


def test_exception_disables_and_returns_reference():
    args = _args()
    fast = Fast(args, "raise")
    s = spec(fast)
    with pytest.warns(policy.FallbackWarning, match="kernel exploded"):
        out = policy.gated(s, "lossless", Plan(), args)
    assert torch.equal(out, reference(*args))
    assert bitfuse.verdicts()[0].status == "error"
    policy.gated(s, "lossless", Plan(), args)
    assert fast.calls == 1


def test_verified_path_raising_later_falls_back_but_reraises_while_compiling(monkeypatch):
    args = _args()
    fast = Fast(args)
    s = spec(fast)
    policy.gated(s, "lossless", Plan(), args)
    fast.behaviour = "raise"
    monkeypatch.setattr(policy, "compiling", lambda: True)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        policy.gated(s, "lossless", Plan(), args)
    monkeypatch.setattr(policy, "compiling", lambda: False)
    with pytest.warns(policy.FallbackWarning):
        out = policy.gated(s, "lossless", Plan(), args)
    assert torch.equal(out, reference(*args))


def test_signatures_are_separate():
    args = _args()
    good, bad = Fast(args), Fast(args, "wrong")
    policy.gated(spec(good), "lossless", Plan(), args)
    with pytest.warns(policy.FallbackWarning):
        policy.gated(spec(bad), "lossless", Plan((torch.bfloat16, 0, "per-token", "per-token")), args)
    policy.gated(spec(good), "lossless", Plan(), args)
    assert good.calls == 3
    assert sorted(v.status for v in bitfuse.verdicts()) == ["mismatch", "verified"]


def _explode(plan, out=None):
    pytest.fail("the fast path ran while verification is forbidden")


@pytest.mark.parametrize("where", ["compiling", "capturing"])
def test_no_verification_while_compiling_or_capturing(monkeypatch, where):
    monkeypatch.setattr(policy, where, lambda: True)
    args = _args()
    out = policy.gated(spec(_explode), "lossless", Plan(), args)
    assert torch.equal(out, reference(*args))
    assert bitfuse.verdicts() == []  # no verdict reached there


def test_verified_path_runs_inside_capture(monkeypatch):
    args = _args()
    fast = Fast(args)
    policy.gated(spec(fast), "lossless", Plan(), args)
    monkeypatch.setattr(policy, "capturing", lambda: True)
    monkeypatch.setattr(policy, "_verify", lambda *a: pytest.fail("verified inside capture"))
    policy.gated(spec(fast), "lossless", Plan(), args)
    assert fast.calls == 3


def test_verify_always_compares_every_call(monkeypatch):
    monkeypatch.setattr(policy, "VERIFY_ALWAYS", True)
    args = _args()
    fast = Fast(args)
    calls = {"ref": 0}

    def ref(*a):
        calls["ref"] += 1
        return reference(*a)

    s = spec(fast, ref)
    for _ in range(3):
        policy.gated(s, "lossless", Plan(), args)
    assert calls["ref"] == 3
    fast.behaviour = "wrong"
    with pytest.warns(policy.FallbackWarning):
        out = policy.gated(s, "lossless", Plan(), args)
    assert torch.equal(out, reference(*args))


# ---------------------------------------------------------------- the high contract


def _identity_spec(fast):
    """An op whose eager result is exact (identity in bf16), so eager's error is 0."""
    return spec(fast, ref=lambda a: a.clone(), name="identity",
                reference64=lambda a: a.double(), terms=lambda a: a.double().abs())


def _bf16():
    return (torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),)


def test_high_accepts_eager_accuracy():
    args = _bf16()
    policy.gated(_identity_spec(Fast(args, fn=lambda a: a.clone())), "high", Plan(), args)
    assert bitfuse.verdicts()[0].status == "verified"


def test_high_rejects_a_mean_error_above_eagers_and_takes_the_fallback():
    """One ULP off everywhere is within the bound but less accurate than eager (exact
    here): the fallback (the lossless path) runs instead."""
    args = _bf16()
    up = Fast(args, fn=lambda a: torch.nextafter(a, torch.full_like(a, float("inf"))))
    with pytest.warns(policy.FallbackWarning, match="mean error"):
        out = policy.gated(_identity_spec(up), "high", Plan(), args, fallback=lambda a: a + 0)
    assert torch.equal(out, args[0])


def test_high_rejects_more_than_one_ulp():
    args = _bf16()

    def two_up(a):
        inf = torch.full_like(a, float("inf"))
        return torch.nextafter(torch.nextafter(a, inf), inf)

    with pytest.warns(policy.FallbackWarning, match="ULP from the float64 value"):
        policy.gated(_identity_spec(Fast(args, fn=two_up)), "high", Plan(), args)


def test_high_accepts_one_rounding_where_eager_rounds_three_times():
    """x * (1 + s) + h in bf16: eager rounds after each op; one fp32 evaluation rounded
    once is closer to the float64 value, so it keeps the contract."""
    g = torch.Generator().manual_seed(2)
    x, s, h = (torch.randn(256, 512, generator=g).to(torch.bfloat16) for _ in range(3))

    def once(x, s, h):
        return (x.float() * (1 + s.float()) + h.float()).to(torch.bfloat16)

    op = OpSpec(name="modulate-ish", reference=lambda x, s, h: x * (1 + s) + h, plan=None,
                launch={"high": Fast((x, s, h), fn=once)}, tiers=("lossless", "high"),
                reference64=lambda x, s, h: x.double() * (1 + s.double()) + h.double(),
                terms=lambda x, s, h: (x.double() * (1 + s.double())).abs().maximum(h.double().abs()))
    policy.gated(op, "high", Plan(), (x, s, h))
    assert bitfuse.verdicts()[0].status == "verified"
    assert not torch.equal(once(x, s, h), x * (1 + s) + h)  # and it is not eager's bits


def test_high_counts_ulps_at_the_terms_scale():
    """Under cancellation an intermediate rounding moves a tiny result by many of its own
    ULPs; the contract measures ULPs at the scale of the terms."""
    a = torch.tensor([1.0, 2.0])
    b = torch.tensor([-1.0 + 2**-20, 3.0])
    fast = Fast((a, b), fn=lambda a, b: torch.tensor([2**-20 + 2**-24, 5.0]))  # 16 ULPs of the result
    op = OpSpec(name="sum", reference=lambda a, b: torch.tensor([2**-20 + 2**-23, 5.0]), plan=None,
                launch={"high": fast}, tiers=("lossless", "high"),
                reference64=lambda a, b: a.double() + b.double(),
                terms=lambda a, b: a.double().abs().maximum(b.double().abs()))
    out = policy.gated(op, "high", Plan(), (a, b))
    assert bitfuse.verdicts()[0].status == "verified"
    assert out[0] == 2**-20 + 2**-24


def test_nan_inputs_do_not_count_as_mismatch():
    x = torch.tensor([[float("nan"), 1.0, float("inf")]])
    b = torch.tensor([0.5, 0.25, -1.0])
    out = policy.gated(spec(Fast((x, b))), "lossless", Plan(), (x, b))
    assert bitfuse.verdicts()[0].status == "verified"
    assert out.isnan()[0, 0] and out[0, 1] == 1.25


def test_threads_verify_once():
    args = _args()
    fast = Fast(args)
    s = spec(fast)
    barrier = threading.Barrier(8)
    results = []

    def worker():
        barrier.wait()
        results.append(policy.gated(s, "lossless", Plan(), args))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(torch.equal(r, reference(*args)) for r in results)
    assert len(bitfuse.verdicts()) == 1 and fast.calls == 2 + 7


# ---------------------------------------------------------------- tiers and environment


def test_quality_context_is_per_thread():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name, tier):
        with bitfuse.quality(tier):
            barrier.wait()
            seen[name] = policy.requested_quality()
            barrier.wait()

    a = threading.Thread(target=worker, args=("a", "high"))
    b = threading.Thread(target=worker, args=("b", "lossless"))
    a.start(), b.start(), a.join(), b.join()
    assert seen == {"a": "high", "b": "lossless"}
    assert policy.requested_quality() is None


def test_quality_context_is_per_task():
    async def request(tier, delay):
        with bitfuse.quality(tier):
            await asyncio.sleep(delay)
            return policy.requested_quality()

    async def main():
        return await asyncio.gather(request("high", 0.02), request("lossless", 0.01), request("high", 0))

    assert asyncio.run(main()) == ["high", "lossless", "high"]


def test_quality_rejects_unknown_tier_and_nests():
    with pytest.raises(ValueError, match="unknown quality tier 'fast'"):
        with bitfuse.quality("fast"):
            pass
    with bitfuse.quality("high"):
        with bitfuse.quality("lossless"):
            assert policy.requested_quality() == "lossless"
        assert policy.requested_quality() == "high"


def test_env_flags(monkeypatch):
    monkeypatch.setenv("BITFUSE_DISABLE", "1")
    monkeypatch.setenv("BITFUSE_VERIFY", "always")
    policy.reload_env()
    assert policy.DISABLED and policy.VERIFY_ALWAYS
    monkeypatch.setenv("BITFUSE_VERIFY", "sometimes")
    with pytest.warns(UserWarning, match="BITFUSE_VERIFY='sometimes'"):
        policy.reload_env()
    assert not policy.VERIFY_ALWAYS
    monkeypatch.delenv("BITFUSE_DISABLE")
    monkeypatch.delenv("BITFUSE_VERIFY")
    policy.reload_env()
    assert not policy.DISABLED and not policy.VERIFY_ALWAYS


def test_a_first_sight_still_compiling_returns_eager_and_waits_for_its_kernel(monkeypatch):
    """Inside background_compiles, a first sight whose kernel is compiling returns
    eager's result and reaches no verdict; the compiles are waited for on leaving
    the block, and the next call is the first sight that verifies."""
    from bitfuse.ops import _launch

    state = {"compiled": False}

    class Launch(Fast):
        def __call__(self, plan, out=None):
            if _launch._defer.get() is not None and not state["compiled"]:
                _launch._defer.get().pending += 1  # what FastLaunch does for a kernel still compiling
                return out
            return super().__call__(plan, out)

    monkeypatch.setattr(_launch, "settle", lambda: state.update(compiled=True))
    policy.reset_verdicts()
    args = _args()
    fast = Launch(args)
    s = spec(fast)
    with policy.background_compiles():
        out = policy.gated(s, "lossless", Plan(), args)
        assert bitfuse.policy.same_bits(out, reference(*args))
        assert policy.state(s, "lossless", Plan()) is None and fast.calls == 0 and not state["compiled"]
    assert state["compiled"]
    out = policy.gated(s, "lossless", Plan(), args)
    assert policy.state(s, "lossless", Plan()) is True and fast.calls == 2
    assert bitfuse.policy.same_bits(out, reference(*args))
    # a high kernel's bits are not eager's: it compiles in place, so no call changes bits later
    state["compiled"] = False
    high = Launch(args)
    h = spec(high, name="high-op")
    with policy.background_compiles():
        policy.gated(h, "high", Plan(), args)
    assert policy.state(h, "high", Plan()) is True and high.calls == 2


def test_background_compiles_nest(monkeypatch):
    """An enabled block inside another changes nothing (only the outermost waits);
    a disabled one compiles in place inside it, even within an enabled block."""
    from bitfuse.ops import _launch

    settled = []
    monkeypatch.setattr(_launch, "settle", lambda: settled.append(policy._background.get()))
    with policy.background_compiles():
        with policy.background_compiles():
            assert policy._background.get() is True
        assert settled == []
        with policy.background_compiles(False):
            assert policy._background.get() is False
            with policy.background_compiles():
                assert policy._background.get() is False
        assert policy._background.get() is True and settled == []
    assert settled == [None] and policy._background.get() is None


def test_a_fact_is_checked_once_and_a_miss_warns_once_and_sticks(monkeypatch):
    """`policy.fact`: a fact of the running build is checked at first sight per signature
    and recorded as a verdict; a miss warns once and stays a miss; an exception in the
    check is an error (False); nothing is checked while tracing or capturing."""
    calls = []

    def holds():
        calls.append(1)
        return None

    assert policy.fact("split", ("a",), holds) and policy.fact("split", ("a",), holds)
    assert len(calls) == 1
    with pytest.warns(policy.FallbackWarning, match="split.*differs here"):
        assert not policy.fact("split", ("b",), lambda: "it differs here")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not policy.fact("split", ("b",), holds)  # kept: no second check, no second warning
    with pytest.warns(policy.FallbackWarning, match="RuntimeError: no"):
        assert not policy.fact("split", ("c",), lambda: (_ for _ in ()).throw(RuntimeError("no")))
    assert [(v.status, v.signature) for v in bitfuse.verdicts()] == [
        ("verified", "split[lossless] a"), ("mismatch", "split[lossless] b"), ("error", "split[lossless] c")]
    for where in ("compiling", "capturing"):
        with monkeypatch.context() as m:
            m.setattr(policy, where, lambda: True)
            assert not policy.fact("split", ("d",), lambda: pytest.fail("checked inside " + where))
    assert policy.fact("split", ("a",), lambda: pytest.fail("checked again"))
    monkeypatch.setattr(policy, "VERIFY_ALWAYS", True)
    assert policy.fact("split", ("a",), holds) and len(calls) == 2
