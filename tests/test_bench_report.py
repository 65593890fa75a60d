"""bench/report.py: the README's results block from the result JSONs, and --check."""

import json

import pytest

from bench import report


def _models_result(status="complete"):
    def mode(ms, differing, speedup, compile_speedup, **extra):
        return dict(ms=ms, ms_min=ms - 1, ms_p90=ms + 1, speedup_vs_eager=speedup, speedup_vs_compile=compile_speedup,
                    differing=differing, numel=1000, first_call_s=1.5, peak_mem_gib=37.2, **extra)

    kernels = dict(ms=dict(gemm=500.0, attention=120.0, other=80.0), bitfuse_ms=30.0)
    gpu = dict(samples=40, sm_clock_mhz=dict(median=1980.0, min=1900.0, max=1980.0),
               power_w=dict(median=690.0, min=600.0, max=700.0))
    return dict(
        bench="models", preset="ltx2", about="LTX-2.0 transformer, full width", gpu="NVIDIA H200",
        versions=dict(torch="2.11", triton="3.6", diffusers="0.42.1"), date="2026-12-02T00:00:00+00:00",
        command="python -m bench.models ltx2 --pass-coords", status=status,
        config=dict(layers=48, batch=2, dtype="bfloat16", rounds=5, per_round=2),
        cold_start=dict(cold=dict(lossless=dict(first_call_s=12.0), compile=dict(first_call_s=40.0)),
                        warm=dict(error="exit 1")),
        workloads={"per-sample": dict(describe="B=2, per-sample timestep", inputs=dict(timestep=[2]), modes=dict(
            eager=mode(900.0, 0, 1.0, 0.7, kernels=kernels, gpu=gpu),
            lossless=mode(680.0, 0, 1.32, 0.96, verdicts=dict(verified=40), cpu_ms=12.5, load_1min=[3.0, 9.5]),
            graphs=dict(error="round 2: RuntimeError: capture failed"),
            compile=mode(655.0, 900, 1.37, 1.0),
        ))},
        notes=["clock and power not recorded: NVML unavailable"],
    )


def test_models_section_and_headline(tmp_path):
    path = tmp_path / "ltx2-nvidia-h200-b2.json"
    path.write_text(json.dumps(_models_result()))
    text = "\n".join(report.models_section(str(path)))
    assert "**ltx2** (LTX-2.0 transformer, full width) — NVIDIA H200" in text and "48 layers, batch 2" in text
    assert "`python -m bench.models ltx2 --pass-coords`" in text
    assert "First call in a fresh process (`--cold-start`): cold caches: lossless 12.0 s, compile 40.0 s; " \
           "warm caches: failed (exit 1)." in text
    assert ("| eager | 900.00 (899.00 – 901.00) | 1.00× | 0.70× | reference | 1.5 | 37.2 | "
            "500.0 / 120.0 / 80.0 (30.0) | 1980 MHz, 690 W |  |") in text
    assert "| lossless | 680.00 (679.00 – 681.00) | 1.32× | 0.96× | 0 of 1,000 |" in text and "40 verified |" in text
    assert "| lossless + CUDA graphs | failed: round 2: RuntimeError: capture failed |" in text
    assert "| regional torch.compile | 655.00" in text and "900 of 1,000" in text
    assert "Note: clock and power not recorded" in text
    assert "Host: load average (1 min) 3.0–9.5 over the rounds; the thread's CPU time a forward until the call " \
           "returns (no sync), median ms: lossless 12.50." in text
    (line,) = report.headline(None, [str(path)])[:-1]
    assert line.startswith("- ltx2, 48 layers, per-sample (B=2, per-sample timestep): eager 900.0 ms; ")
    assert "lossless 680.0 ms (1.32×, 0 of 1,000 elements differ)" in line
    assert "regional torch.compile 655.0 ms (1.37×, 900 of 1,000 elements differ)" in line and "graphs" not in line


OPS_ROWS = [
    dict(op="modulate", B=1, S=6144, D=4096, layout="unbind", variant="eager", us=128.0, pct_ceiling=18.0,
         exact=True, rounds_us=[128.0, 128.1]),
    dict(op="modulate", B=1, S=6144, D=4096, layout="unbind", variant="bitfuse lossless", us=25.9, pct_ceiling=91.0,
         exact=True, rounds_us=[25.9, 26.0]),
    dict(op="modulate", B=1, S=6144, D=4096, layout="unbind", variant="compile+emulate", us=25.8, pct_ceiling=91.2,
         exact=True, rounds_us=[25.8, 25.9]),
    dict(op="modulate", B=1, S=6144, D=4096, layout="unbind", variant="torch.compile", us=26.0, pct_ceiling=91.0,
         exact=False, rounds_us=[26.0, 26.0]),
    dict(op="layer_norm_modulate", B=1, S=6144, D=4096, layout="unbind-sample", variant="eager", us=167.0,
         pct_ceiling=14.0, exact=True),
    dict(op="layer_norm_modulate", B=1, S=6144, D=4096, layout="unbind-sample", variant="bitfuse lossless",
         us=29.8, pct_ceiling=79.0, exact=True),
    dict(op="layer_norm_modulate", B=1, S=6144, D=4096, layout="unbind-sample", variant="bitfuse high",
         error="capture: RuntimeError: x"),
]


def _ops_result(rows, host):
    return dict(bench="ops", gpu="NVIDIA H200", torch="2.11", triton="3.6", dtype="bfloat16", copy_ceiling_tbps=4.27,
                date="2026-12-02", host_us=host, rows=rows, skipped=["rotary[split] dense 1x6144x4096"])


def test_ops_section_reads_new_and_earlier_rows(tmp_path):
    path = tmp_path / "ops-nvidia-h200.json"
    path.write_text(json.dumps(_ops_result(OPS_ROWS, {"modulate": {"eager": 24.1, "bitfuse": 19.6}})))
    text = "\n".join(report.ops_section(str(path)))
    assert "Host cost of one call on tiny tensors (µs): modulate: eager 24.1, bitfuse 19.6." in text
    assert "| modulate | 4096 | 6144 | unbind | 128.0 (18%) | 26.0 (91%) ≠ | 25.8 (91%) | 25.9 (91%) |  |" in text
    assert "| layer_norm_modulate | 4096 | 6144 | unbind-sample | 167.0 (14%) |  |  | 29.8 (79%) | error |" in text
    assert "Not run (time budget): rotary[split] dense 1x6144x4096." in text
    assert "Pointwise ops against compile + emulate_precision_casts, 1 shapes, 2 interleaved rounds" in text
    earlier = [dict({k: v for k, v in r.items() if k != "layout"}, params="per-sample") for r in OPS_ROWS]
    path.write_text(json.dumps(_ops_result(earlier, {"eager x*(1+scale)+shift (3 ops)": 32.4})))
    text = "\n".join(report.ops_section(str(path)))
    assert "(µs): eager x*(1+scale)+shift (3 ops) 32.4." in text and "| modulate | 4096 | 6144 | per-sample |" in text
    lines = report.headline(str(path), [])
    assert "- Modulate and gated residual at 6144 tokens and above: 91-91% of the copy ceiling, bit-exact." in lines
    assert any(line.startswith("- layer_norm_modulate, 6144 × 4096, per-sample: eager 167 µs, lossless 29.8 µs")
               for line in lines)


@pytest.fixture
def results(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"# Results\n\nprose\n\n{report.START}\nstale\n{report.END}\n\nafter\n")
    (tmp_path / "results" / "archive").mkdir(parents=True)
    monkeypatch.setattr(report, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(report, "README", str(readme))
    top = tmp_path / "TOP.md"
    top.write_text(f"# top\n\n{report.TOP_START}\nstale\n{report.TOP_END}\n")
    monkeypatch.setattr(report, "TOP_README", str(top))
    return tmp_path


def test_render_and_check(results):
    res = results / "results"
    (res / "ltx2-nvidia-h200-b2.json").write_text(json.dumps(_models_result()))
    (res / "ops-nvidia-h200.json").write_text(json.dumps(_ops_result(OPS_ROWS, {})))
    (res / "archive" / "ltx2-nvidia-h200.json").write_text(json.dumps(dict(bench="ltx2", results={})))
    (res / "a.png").write_bytes(b"")
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0
    text = (results / "README.md").read_text()
    assert text.startswith("# Results\n\nprose\n\n" + report.START + "\n- ltx2, 48 layers") and "stale" not in text
    assert text.endswith(report.END + "\n\nafter\n") and "archive" not in text
    assert text.index("**ltx2**") < text.index("**Ops**") and "Plots: [a.png](results/a.png)" in text
    assert report.main(["--check"]) == 0
    top = (results / "TOP.md").read_text()
    assert "stale" not in top and "| model, shape (one H200 unless named) |" in top and top.count("\n| ") == 2
    (res / "ops-nvidia-h200.json").write_text(json.dumps(_ops_result(OPS_ROWS[:2], {})))
    assert report.main(["--check"]) == 1


def test_the_top_summary_goes_stale_on_its_own(results):
    """A new model result changes the top README's table: --check sees it even when
    bench/README.md would not change otherwise."""
    res = results / "results"
    (res / "ltx2-nvidia-h200-b2.json").write_text(json.dumps(_models_result()))
    assert report.main([]) == 0 and report.main(["--check"]) == 0
    top = results / "TOP.md"
    top.write_text(top.read_text().replace("bit-exact", "edited by hand"))
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0 and "edited by hand" not in top.read_text()


def test_a_readme_without_markers_is_refused(results, capsys):
    (results / "README.md").write_text("no markers")
    assert report.main([]) == 2 and "lacks the results markers" in capsys.readouterr().err


def test_the_top_summary_names_a_gpu_other_than_the_h200(tmp_path):
    """The top table's rows are H200 runs unless a row names its GPU."""
    paths = []
    for name, gpu in (("a.json", "NVIDIA H200"), ("b.json", "NVIDIA H100 80GB HBM3")):
        (tmp_path / name).write_text(json.dumps(dict(_models_result(), gpu=gpu)))
        paths.append(str(tmp_path / name))
    rows = report.summary(paths).splitlines()[2:]
    assert len(rows) == 2 and ", on one " not in rows[0] and ", on one H100 80GB HBM3 |" in rows[1]
