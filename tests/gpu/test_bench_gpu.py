"""The benchmarks' GPU paths at small sizes, before spending device time on the real
runs: bench/models.py in every mode on a tiny LTX-2 (graphs capture, regional
compile, the profiler, NVML), one bench/ops.py case, and bench/norm_accuracy.py rows.

    python -m pytest tests/gpu/test_bench_gpu.py -q
"""

import json

import pytest
import torch

from bench import models, norm_accuracy, ops, report
from bitfuse.ops import SPECS

pytestmark = pytest.mark.gpu


def test_models_every_mode_on_a_tiny_ltx2(tmp_path):
    pytest.importorskip("diffusers")
    argv = ["ltx2", "--tiny", "--rounds", "2", "--per-round", "2", "--out", str(tmp_path)]
    assert models.main(argv) == 0
    (path,) = tmp_path.glob("*.json")
    res = json.loads(path.read_text())
    assert res["status"] == "complete" and res["gpu"] == torch.cuda.get_device_name()
    for name, w in res["workloads"].items():
        m = w["modes"]
        assert list(m) == list(models.modes.MODES), name
        for mode, r in m.items():
            assert "error" not in r and "skipped" not in r, (name, mode, r)
            assert r["samples"] == 4 and r["peak_mem_gib"] > 0, (name, mode)
            # graph replays: the split if the profiler traces their kernels, else a note saying it saw none
            assert r["kernels"].get("total_ms", 0) > 0 or (mode == "graphs" and "note" in r["kernels"]), mode
        for mode in ("eager", "lossless", "graphs"):
            assert m[mode]["differing"] == 0, (name, mode)
        for mode in ("lossless", "high", "graphs"):
            assert set(m[mode]["verdicts"]) <= {"verified"}, (name, mode, m[mode].get("verdict_problems"))
        assert m["compile"]["dynamo_frames_in_rounds"] == 0  # the rounds reuse the first call's compiled code
        if not any("clock and power not recorded" in n for n in res["notes"]):
            assert m["eager"]["gpu"]["sm_clock_mhz"]["median"] > 0
    assert "| lossless + CUDA graphs |" in "\n".join(report.models_section(str(path)))


@pytest.mark.parametrize("name, layout", [("modulate", "unbind"), ("layer_norm_modulate", "unbind-sample")])
def test_one_ops_case(name, layout):
    ops.allow_many_recompiles()
    rows = {r["variant"]: r for r in ops.run_case(SPECS[name], layout, (1, 1024, 2048), ceiling=4.0)}
    assert set(rows) == set(ops.variants(SPECS[name]))
    for variant, r in rows.items():
        assert "error" not in r and r["us"] > 0 and len(r["rounds_us"]) == ops.ROUNDS, variant
    lossless = rows["bitfuse lossless"]
    assert lossless["exact"] and lossless["differing"] == 0 and lossless["verdicts"] == ["verified"]
    assert rows["eager"]["exact"]
    if "bitfuse high" in rows:
        assert rows["bitfuse high"]["high_contract"] == "holds" and rows["bitfuse high"]["verdicts"] == ["verified"]


@pytest.mark.parametrize("reference", list(norm_accuracy.REFERENCES))
def test_accuracy_rows(reference):
    row = norm_accuracy.evaluate(reference, torch.bfloat16, "outlier", 256, 4096, "cuda")
    eager, lossless, high = (row["variants"][v] for v in ("eager", "lossless", "high"))
    assert lossless["differ_from_eager"] == 0 and lossless["mean_ulp"] == eager["mean_ulp"]
    assert high["high_contract"] == "holds" and high["mean_ulp"] <= eager["mean_ulp"]
    assert high["max_ulp"] <= 1.0 and eager["nonfinite"] == high["nonfinite"] == 0
