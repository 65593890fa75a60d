"""bench/ops.py and bench/norm_accuracy.py on the CPU: the cases drawn from the specs,
bytes moved, the bitwise checks (kernels under Triton's interpreter, fp32), arguments,
tables and the accuracy JSON the report reads."""

import json
import os

import pytest
import torch

from bench import norm_accuracy, ops, report
from bitfuse.ops import SPECS, _params, cases

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")


@pytest.fixture
def cpu_kernels(monkeypatch):
    monkeypatch.setattr(_params, "INTERPRET_ON_CPU", True)


def test_cases_come_from_the_declarations():
    specs = list(SPECS.values())
    default = ops.plan_cases(specs)
    assert len(default) == sum(len(s.layouts) for s in specs)
    assert {(s.name, layout) for s, layout, _ in default} == {(s.name, lay) for s in specs for lay in s.layouts}
    assert all(shape == ops.MAIN_SHAPE for _, _, shape in default)
    quick = ops.plan_cases(specs, quick=True)
    assert [(s.name, layout) for s, layout, _ in quick] == [(s.name, s.layouts[0]) for s in specs]
    sweep = ops.plan_cases(specs, sweep=True)
    extra = len(ops.SWEEP_SHAPES) - (ops.MAIN_SHAPE in ops.SWEEP_SHAPES)
    assert len(sweep) == len(default) + sum(min(2, len(s.layouts)) * extra for s in specs)
    wide = ops.plan_cases(specs, quick=True, widths=[3072, 4096, 5120])
    first = (specs[0], specs[0].layouts[0])
    assert wide[:3] == [first + (ops.MAIN_SHAPE,), first + ((1, 8192, 3072),), first + ((1, 4915, 5120),)]
    assert len(wide) == 3 * len(specs)
    assert ops.variants(SPECS["modulate"])[-1] == "bitfuse lossless"
    assert ops.variants(SPECS["layer_norm_modulate"])[-2:] == ["bitfuse lossless", "bitfuse high"]


def _args(name, layout, B=2, S=3, D=256, dtype=torch.float32):
    return SPECS[name].make_args(cases.Case(B, S, D, dtype, layout, "randn", 0, "cpu"))


def test_bytes_moved_counts_each_operand_once():
    x, scale, shift = args = _args("modulate", "per-sample")
    out = SPECS["modulate"].reference(*args)
    assert ops.bytes_moved(args, out) == (2 * 3 * 256 * 2 + 2 * 256 * 2) * 4
    folded = _args("modulate", "folded")
    assert len(ops.tensors_in(folded)) == 5  # x, and a table row and a temb view per parameter
    assert ops.bytes_moved(folded, out) == (2 * 3 * 256 * 2 + 2 * (256 + 2 * 256)) * 4
    q, freqs, rope_type, k = rot = _args("rotary[interleaved]", "shared")
    out = SPECS["rotary[interleaved]"].reference(*rot)
    assert ops.bytes_moved(rot, out) == (4 * q.numel() + 2 * freqs[0].numel()) * 4
    assert ops.bytes_moved((x, x), x) == x.numel() * 4  # the same tensor passed twice


def test_check_is_bitwise_over_tuples():
    a = torch.tensor([1.0, 0.0])
    b = torch.tensor([1.0, -0.0])
    assert ops.check((a, a), (a, a)) == dict(exact=True, differing=0, max_ulp=0)
    assert ops.check((a, a), (a, b)) == dict(exact=False, differing=1, max_ulp=0)


def test_without_a_kernel_the_row_says_why():
    args = _args("modulate", "per-sample")
    ref = SPECS["modulate"].reference(*args)
    assert ops.check_bitfuse(SPECS["modulate"], "lossless", args, ref) == dict(
        error="no kernel for this case (eager fallback): CPU tensor")


@interpreter
@pytest.mark.parametrize("name, layout", [("modulate", "unbind"), ("gated_residual", "folded"),
                                          ("rms_norm_modulate[diffusers]", "per-sample"),
                                          ("rotary[split]", "strided")])
def test_bitfuse_rows_check_the_kernel_and_record_the_verdict(cpu_kernels, name, layout):
    args = _args(name, layout)
    ref = SPECS[name].reference(*args)
    row = ops.check_bitfuse(SPECS[name], "lossless", args, ref)
    assert row == dict(exact=True, differing=0, max_ulp=0, verdicts=["verified"])


def test_arguments(capsys):
    assert [s.name for s in ops.parse_args(["--ops", "modulate,rms_norm"]).specs] == ["modulate", "rms_norm"]
    assert [s.name for s in ops.parse_args([]).specs] == [n for n, s in SPECS.items() if s.bandwidth_bound]
    assert "projections" in SPECS and "projections" not in ops.MEMORY_OPS  # a GEMM: no copy ceiling to measure
    for argv, message in ((["--ops", "modulate,fused"], "unknown or not memory-bound op(s) fused"),
                          (["--ops", "projections"], "unknown or not memory-bound op(s) projections"),
                          (["--quick", "--sweep"], "not allowed with argument")):
        with pytest.raises(SystemExit) as exc:
            ops.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_ops_needs_a_gpu(capsys):
    assert ops.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_summary_table():
    def row(variant, us=None, exact=True):
        r = dict(op="modulate", layout="unbind", S=6144, D=4096, variant=variant)
        return r if us is None else dict(r, us=us, pct_ceiling=90.0, exact=exact)

    text = ops.summary_table([row("eager", 128.0), row("torch.compile", 26.0, exact=False),
                              row("compile+emulate"), row("bitfuse lossless", 25.9)])
    line = text.splitlines()[1]
    assert line.startswith("modulate") and "128.0  90.0% =" in line and "26.0  90.0% x" in line
    assert "error" in line and line.count("%") == 3


# ---------------------------------------------------------------- norm accuracy


@interpreter
def test_accuracy_row_under_the_interpreter(cpu_kernels):
    row = norm_accuracy.evaluate("diffusers", torch.float32, "outlier", 4, 256, "cpu")
    assert row["op"] == "rms_norm_modulate[diffusers]" and row["numel"] == 4 * 256
    eager, lossless = row["variants"]["eager"], row["variants"]["lossless"]
    assert lossless["differ_from_eager"] == 0 and lossless["max_ulp_from_eager"] == 0
    assert lossless["mean_ulp"] == eager["mean_ulp"] and eager["nonfinite"] == 0
    assert set(row["variants"]["high"]) >= {"mean_ulp", "max_ulp", "differ_from_eager", "high_contract"}


def test_accuracy_json_and_table_on_the_cpu(tmp_path, capsys):
    assert norm_accuracy.main(["--device", "cpu", "--S", "3", "--D", "256", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "norm-accuracy-cpu.json").read_text())
    assert res["shape"] == [1, 3, 256] and res["layout"] == "unbind-sample"
    assert len(res["rows"]) == len(norm_accuracy.REFERENCES) * len(norm_accuracy.DTYPES) * len(norm_accuracy.DATA)
    r = res["rows"][0]
    assert r["variants"]["lossless"] == dict(error="no kernel for this case: CPU tensor")
    assert r["variants"]["eager"]["differ_from_eager"] == 0 and r["variants"]["eager"]["mean_ulp"] >= 0
    assert (tmp_path / "norm-accuracy-cpu.txt").read_text().startswith("cpu, torch ")
    assert "diffusers  bfloat16 randn   eager" in capsys.readouterr().out
    text = "\n".join(report.accuracy_section(str(tmp_path / "norm-accuracy-cpu.json")))
    assert "| diffusers | bfloat16 | randn | " in text and "no kernel for this case: CPU tensor" in text
