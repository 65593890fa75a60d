"""`bitfuse verify`'s verdict per path, on the CPU with stand-in ops: a lossless path
that differs from its reference is a mismatch, unless its spec says why its bits may
differ per problem (the gate then gives that problem the reference: an eager fallback)."""

import torch

from bitfuse import verify
from bitfuse.ops.spec import OpSpec


class Plan:
    key = "stand-in"


def _spec(differs: bool, may_differ=None, probe=None) -> OpSpec:
    def make_args(case):
        gen = torch.Generator().manual_seed(case.seed)
        return (torch.randn(case.B, case.S, case.D, generator=gen).to(case.dtype),)

    def launch(plan, out=None):
        x = plan.x
        y = x * 2
        if differs:
            y = y.clone()
            y.view(-1)[0] = y.view(-1)[0] + 1
        if out is not None:
            out.copy_(y)
            return out
        return y

    def plan(x, tier="lossless"):
        p = Plan()
        p.x = x
        return p

    return OpSpec(name="stand-in", reference=lambda x: x * 2, plan=plan, launch={"lossless": launch},
                  make_args=make_args, layouts=("none",), may_differ=may_differ, probe=probe)


SHAPES = [(1, 3, 8), (2, 5, 16)]


def test_an_exact_path_is_verified():
    r = verify.check(_spec(False), "lossless", torch.float32, "none", SHAPES)
    assert r["status"] == "verified", r


def test_a_difference_is_a_mismatch():
    r = verify.check(_spec(True), "lossless", torch.float32, "none", SHAPES)
    assert r["status"] == "mismatch" and "1 of 24 differ" in r["detail"], r


def test_a_declared_per_problem_difference_is_an_eager_fallback():
    why = "the library picks its kernel per problem"
    r = verify.check(_spec(True, why), "lossless", torch.float32, "none", SHAPES)
    assert r["status"] == "eager fallback" and why in r["detail"] and "1 of 24 differ" in r["detail"], r
    # and where the bits agree, such a path is verified like any other
    assert verify.check(_spec(False, why), "lossless", torch.float32, "none", SHAPES)["status"] == "verified"


def test_only_the_projections_declare_per_problem_bits():
    from bitfuse.ops import SPECS

    assert {name for name, spec in SPECS.items() if spec.may_differ} == {"projections"}


def test_the_spec_s_probe_runs_as_the_gate_runs_it():
    """After each shape's data agreed, `OpSpec.probe(plan)`: None keeps the path verified;
    a why is a mismatch (an eager fallback for a path whose bits may differ per
    problem); a probe that raises is reported, not raised."""
    seen = []

    def probe(plan):
        seen.append(plan.x.shape)
        return None

    assert verify.check(_spec(False, probe=probe), "lossless", torch.float32, "none", SHAPES)["status"] == "verified"
    assert seen == [torch.Size(s) for s in SHAPES]
    r = verify.check(_spec(False, probe=lambda plan: "built operands differ"), "lossless", torch.float32, "none", SHAPES)
    assert r == dict(status="mismatch", detail="B=1 S=3 D=8: built operands differ")
    r = verify.check(_spec(False, "per problem", probe=lambda plan: "built operands differ"), "lossless",
                     torch.float32, "none", SHAPES)
    assert r["status"] == "eager fallback"

    def raising(plan):
        raise RuntimeError("probe exploded")

    r = verify.check(_spec(False, probe=raising), "lossless", torch.float32, "none", SHAPES)
    assert r["status"] == "mismatch" and "the probe failed: RuntimeError: probe exploded" in r["detail"]
