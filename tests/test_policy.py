"""The first-sight gate and quality tiers (CPU: fast paths are stand-ins)."""

import asyncio
import threading
import warnings

import pytest
import torch

import bitfuse
from bitfuse import policy


class Plan:
    def __init__(self, key=(torch.bfloat16, 0, "per-sample", "per-sample")):
        self.key = key


def reference(a, b):
    return a * (1 + b)


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 7, generator=g), torch.randn(7, generator=g)


class Fast:
    """A stand-in fast path: right, wrong, or raising, and counting its calls."""

    def __init__(self, args, behaviour="right"):
        self.args, self.behaviour, self.calls = args, behaviour, 0

    def __call__(self, plan):
        self.calls += 1
        if self.behaviour == "raise":
            raise RuntimeError("kernel exploded")
        out = reference(*self.args)
        if self.behaviour == "wrong":
            out = out.clone()
            out[0, 0] = out[0, 0] + 1
        if self.behaviour == "off-by-one-ulp":
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out


def test_verifies_once_then_caches():
    args = _args()
    fast = Fast(args)
    calls = {"ref": 0}

    def ref(*a):
        calls["ref"] += 1
        return reference(*a)

    for _ in range(3):
        out = policy.gated("op", "exact", Plan(), fast, ref, args)
        assert torch.equal(out, reference(*args))
    assert fast.calls == 4 and calls["ref"] == 1  # first sight runs the fast path twice, the reference once
    (v,) = bitfuse.verdicts()
    assert v.status == "verified" and v.active and v.op == "op" and "bfloat16" in v.signature


def test_mismatch_disables_warns_once_and_returns_reference():
    args = _args()
    fast = Fast(args, "wrong")
    with pytest.warns(policy.FallbackWarning, match="disagreed with eager"):
        out = policy.gated("op", "exact", Plan(), fast, reference, args)
    assert torch.equal(out, reference(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for _ in range(3):
            assert torch.equal(policy.gated("op", "exact", Plan(), fast, reference, args), reference(*args))
    assert fast.calls == 2  # disabled for good after first sight
    (v,) = bitfuse.verdicts()
    assert v.status == "mismatch" and "1 of 35 elements differ" in v.detail


def test_a_launch_path_wrong_only_after_the_first_call_is_caught():
    """The first launch compiles through Triton; later ones take the direct launcher.
    First sight checks both."""
    args = _args()

    class SecondWrong(Fast):
        def __call__(self, plan):
            self.behaviour = "right" if self.calls == 0 else "wrong"
            return super().__call__(plan)

    with pytest.warns(policy.FallbackWarning):
        out = policy.gated("op", "exact", Plan(), SecondWrong(args), reference, args)
    assert torch.equal(out, reference(*args)) and bitfuse.verdicts()[0].status == "mismatch"


def test_exception_disables_and_returns_reference():
    args = _args()
    fast = Fast(args, "raise")
    with pytest.warns(policy.FallbackWarning, match="kernel exploded"):
        out = policy.gated("op", "exact", Plan(), fast, reference, args)
    assert torch.equal(out, reference(*args))
    assert bitfuse.verdicts()[0].status == "error"
    policy.gated("op", "exact", Plan(), fast, reference, args)
    assert fast.calls == 1


def test_verified_path_raising_later_falls_back_but_reraises_while_compiling(monkeypatch):
    args = _args()
    fast = Fast(args)
    policy.gated("op", "exact", Plan(), fast, reference, args)
    fast.behaviour = "raise"
    monkeypatch.setattr(policy, "_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        policy.gated("op", "exact", Plan(), fast, reference, args)
    monkeypatch.setattr(policy, "_compiling", lambda: False)
    with pytest.warns(policy.FallbackWarning):
        out = policy.gated("op", "exact", Plan(), fast, reference, args)
    assert torch.equal(out, reference(*args))


def test_signatures_are_separate():
    args = _args()
    good, bad = Fast(args), Fast(args, "wrong")
    policy.gated("op", "exact", Plan(), good, reference, args)
    with pytest.warns(policy.FallbackWarning):
        policy.gated("op", "exact", Plan((torch.bfloat16, 0, "per-token", "per-token")), bad, reference, args)
    policy.gated("op", "exact", Plan(), good, reference, args)
    assert good.calls == 3
    assert sorted(v.status for v in bitfuse.verdicts()) == ["mismatch", "verified"]


def _explode(plan):
    pytest.fail("the fast path ran while verification is forbidden")


@pytest.mark.parametrize("where", ["_compiling", "_capturing"])
def test_no_verification_while_compiling_or_capturing(monkeypatch, where):
    monkeypatch.setattr(policy, where, lambda: True)
    args = _args()
    out = policy.gated("op", "exact", Plan(), _explode, reference, args)
    assert torch.equal(out, reference(*args))
    assert bitfuse.verdicts() == []  # no verdict reached there


def test_verified_path_runs_inside_capture(monkeypatch):
    args = _args()
    fast = Fast(args)
    policy.gated("op", "exact", Plan(), fast, reference, args)
    monkeypatch.setattr(policy, "_capturing", lambda: True)
    monkeypatch.setattr(policy, "_verify", lambda *a: pytest.fail("verified inside capture"))
    policy.gated("op", "exact", Plan(), fast, reference, args)
    assert fast.calls == 3


def test_verify_always_compares_every_call(monkeypatch):
    monkeypatch.setattr(policy, "VERIFY_ALWAYS", True)
    args = _args()
    fast = Fast(args)
    calls = {"ref": 0}

    def ref(*a):
        calls["ref"] += 1
        return reference(*a)

    for _ in range(3):
        policy.gated("op", "exact", Plan(), fast, ref, args)
    assert calls["ref"] == 3
    fast.behaviour = "wrong"
    with pytest.warns(policy.FallbackWarning):
        out = policy.gated("op", "exact", Plan(), fast, ref, args)
    assert torch.equal(out, reference(*args))


def test_high_mode_accepts_one_ulp_and_rejects_more():
    args = _args()
    close = Fast(args, "off-by-one-ulp")
    policy.gated("op", "high", Plan(), close, reference, args)
    assert bitfuse.verdicts()[0].status == "verified"
    with pytest.warns(policy.FallbackWarning):
        policy.gated("op", "exact", Plan(), close, reference, args)  # the same output is not lossless
    far = Fast(args, "wrong")
    with pytest.warns(policy.FallbackWarning):
        policy.gated("op2", "high", Plan(), far, reference, args)


def test_high_mode_scales_ulps_by_the_terms():
    """Under cancellation an intermediate rounding moves a tiny result by many of
    its own ULPs; the criterion measures ULPs at the scale of the terms."""
    a = torch.tensor([1.0, 2.0])
    b = torch.tensor([-1.0 + 2**-20, 3.0])
    plan = Plan()

    def fast(plan):
        return torch.tensor([2**-20 + 2**-24, 5.0])  # 16 ULPs of the result, far below one ULP of 1.0

    out = policy.gated("sum", "high", plan, fast, lambda a, b: a + b, (a, b),
                       lambda a, b: a.abs().maximum(b.abs()))
    assert bitfuse.verdicts()[0].status == "verified"
    assert out[0] == 2**-20 + 2**-24


def test_nan_inputs_do_not_count_as_mismatch():
    x = torch.tensor([[float("nan"), 1.0, float("inf")]])
    b = torch.tensor([0.5, 0.25, -1.0])
    fast = Fast((x, b))
    out = policy.gated("op", "exact", Plan(), fast, reference, (x, b))
    assert bitfuse.verdicts()[0].status == "verified"
    assert out.isnan()[0, 0] and out[0, 1] == 1.25


def test_threads_verify_once():
    args = _args()
    fast = Fast(args)
    barrier = threading.Barrier(8)
    results = []

    def worker():
        barrier.wait()
        results.append(policy.gated("op", "exact", Plan(), fast, reference, args))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(torch.equal(r, reference(*args)) for r in results)
    assert len(bitfuse.verdicts()) == 1


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
    with pytest.raises(ValueError, match="BITFUSE_VERIFY"):
        policy.reload_env()
    monkeypatch.delenv("BITFUSE_DISABLE")
    monkeypatch.delenv("BITFUSE_VERIFY")
    policy.reload_env()
    assert not policy.DISABLED and not policy.VERIFY_ALWAYS
