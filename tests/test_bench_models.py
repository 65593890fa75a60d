"""bench/models.py on the CPU: arguments, presets, kernel classes, comparisons, the
sampler, the interleaved mode runner (on a toy model with a fake `modes.enter`), and
the whole flow on a tiny LTX-2 (graphs and compile are skipped on a CPU)."""

import inspect
import json
import time
import types

import pytest
import torch

from bench import models, report
from bitfuse import modes

# ---------------------------------------------------------------- arguments


def test_defaults_are_the_pipelines_shape():
    args = models.parse_args(["ltx2"])
    assert args.batch == 2 and args.layers is None and args.rounds == 5 and args.per_round == 3
    assert args.modes == list(modes.MODES) and args.device == torch.device("cuda", 0)
    assert args.dtype is torch.bfloat16
    assert models.default_tag(args) == "b2"
    assert models.parse_args(["ltx2.3", "--stg"]).batch == 1
    assert models.parse_args(["flux"]).batch == 1
    quick = models.parse_args(["ltx2", "--layers", "4", "--batch", "1", "--pass-coords"])
    assert models.default_tag(quick) == "4l-b1-coords"
    cpu = models.parse_args(["ltx2", "--tiny", "--device", "cpu"])
    assert cpu.dtype is torch.float32 and models.default_tag(cpu) == "b2-tiny"


def test_eager_always_runs_first_and_modes_keep_their_order():
    args = models.parse_args(["ltx2", "--modes", "compile", "lossless"])
    assert args.modes == ["eager", "lossless", "compile"]


@pytest.mark.parametrize("argv, message", [
    ([], "name a preset"),
    (["ltx2", "--stg"], "--stg does not apply to preset ltx2"),
    (["ltx2.3", "--stg", "--batch", "2"], "batch 1"),
    (["ltx2.3", "--stg", "--per-token"], "choose one workload"),
    (["flux", "--per-token"], "--per-token does not apply to preset flux"),
    (["qwenimage", "--video", "1", "2", "3"], "--video/--audio-tokens/--text-tokens does not apply"),
    (["ltx2", "--pixels", "64"], "--pixels does not apply to preset ltx2"),
    (["ltx2", "--rounds", "0"], "must be at least 1"),
    (["ltx2", "--layers", "x"], "not an integer"),
    (["ltx2", "--modes", "fast"], "invalid choice"),
    (["sd3"], "invalid choice"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        models.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- presets


def test_registry():
    assert list(models.PRESETS) == ["ltx2", "ltx2.3", "flux", "flux2", "qwenimage", "wan", "wan2.2-5b", "sana"]
    for p in models.PRESETS.values():
        assert p.module.startswith("bitfuse.models.") and p.module.endswith("_configs")
    assert "stg" in models.PRESETS["ltx2.3"].options and "stg" not in models.PRESETS["ltx2"].options


class FakeConfigs:
    """A configs module that records what the preset asks of it."""

    def __init__(self, make_inputs_params=("height", "width")):
        self.calls = []

        def make_inputs(model, batch=1, **kw):
            self.calls.append(dict(batch=batch, **kw))
            return {"x": torch.zeros(batch, 1)}

        make_inputs.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
             for n in ("model", "batch", *make_inputs_params)])
        self.make_inputs = make_inputs

    def tiny_config(self, *a, **kw):
        return {"tiny": True, "args": a, **kw}

    def full_config(self, *a, **kw):
        return {"full": True, "args": a, **kw}

    def build_model(self, config, *, device, dtype, seed):
        return types.SimpleNamespace(config=types.SimpleNamespace(num_layers=48), built=(config, device, dtype, seed))


def _ltx2_calls(argv):
    args = models.parse_args(argv)
    fake = FakeConfigs()
    preset = models.PRESETS[args.preset]
    config, model = preset.build(fake, args)
    workloads = preset.workloads(fake, model, args)
    return config, workloads, fake.calls


def test_ltx2_workloads_are_the_pipelines_calls():
    config, workloads, calls = _ltx2_calls(["ltx2", "--pass-coords", "--per-token"])
    assert config == {"full": True, "args": (48, "2.0")}
    assert list(workloads) == ["per-sample", "per-token"]
    base = dict(video_tokens_shape=(16, 16, 24), audio_tokens=126, text_tokens=256, pass_coords=True,
                use_cross_timestep=False, seed=0)
    assert calls[0] == dict(batch=2, **base)
    assert calls[1] == dict(batch=2, per_token=True, **base)
    config, workloads, calls = _ltx2_calls(["ltx2.3", "--layers", "4", "--video", "2", "3", "4"])
    assert config == {"full": True, "args": (4, "2.3")}
    assert calls[0]["use_cross_timestep"] is True and calls[0]["video_tokens_shape"] == (2, 3, 4)


def test_ltx23_stg_call_without_and_with_a_mask():
    _, workloads, calls = _ltx2_calls(["ltx2.3", "--stg"])
    assert list(workloads) == ["stg", "stg-mask"]
    assert calls[0]["batch"] == 1 and calls[0]["stg_blocks"] == [28] and "perturbation_mask" not in calls[0]
    assert calls[1]["stg_blocks"] == [28] and torch.equal(calls[1]["perturbation_mask"], torch.zeros(1))
    assert "perturbation_mask=None" in workloads["stg"][0]


@pytest.mark.parametrize("params, expect", [(("height", "width"), dict(height=1328, width=1328)), ((), {})])
def test_hook_presets_pass_pixels_where_make_inputs_takes_them(params, expect):
    args = models.parse_args(["qwenimage", "--layers", "3"])
    fake = FakeConfigs(params)
    preset = models.PRESETS["qwenimage"]
    config, model = preset.build(fake, args)
    assert config == {"full": True, "args": (3,)}
    workloads = preset.workloads(fake, model, args)
    assert list(workloads) == ["default"] and fake.calls == [dict(batch=1, **expect)]


def test_pixels_sets_the_image_side_and_the_tag():
    args = models.parse_args(["sana", "--pixels", "64"])
    fake = FakeConfigs()
    preset = models.PRESETS["sana"]
    _, model = preset.build(fake, args)
    (describe, _), = preset.workloads(fake, model, args).values()
    assert fake.calls == [dict(batch=2, height=64, width=64)] and describe == "B=2, 64 x 64"
    assert models.default_tag(args) == "b2-64px" and models.default_tag(models.parse_args(["sana"])) == "b2"


def test_a_missing_configs_module_is_one_line(monkeypatch, capsys, tmp_path):
    missing = models.Preset("flux", "bitfuse.models.no_such_configs", "", None, None, 1)
    with pytest.raises(models.PresetUnavailable, match="needs bitfuse.models.no_such_configs"):
        models.load_configs(missing)
    monkeypatch.setitem(models.PRESETS, "flux", missing)
    assert models.main(["flux", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("preset 'flux' needs bitfuse.models.no_such_configs, which this checkout does not have yet")
    assert not list(tmp_path.iterdir())


def test_a_configs_module_missing_a_dependency_is_not_hidden(monkeypatch):
    def fail(name):
        raise ModuleNotFoundError("No module named 'diffusers'", name="diffusers")

    monkeypatch.setattr(models.importlib, "import_module", fail)
    with pytest.raises(ModuleNotFoundError, match="diffusers"):
        models.load_configs(models.PRESETS["ltx2"])


# ---------------------------------------------------------------- kernels, comparisons, sampler


@pytest.mark.parametrize("name, cls, ours", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm", False),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm", False),
    ("triton_tem_fused_mm_0", "gemm", False),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(Flash_fwd_params)",
     "attention", False),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention", False),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention", False),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >", "other",
     False),
    ("triton_poi_fused_add_mul_0", "other", False),
    ("_modulate_kernel", "other", True),
    ("_rms_norm_modulate_exact_kernel", "other", True),
])
def test_kernel_classes(name, cls, ours):
    assert models.kernel_class(name) == cls
    assert models.is_bitfuse_kernel(name) == ours


def test_kernel_split_per_forward():
    split = models.split_kernels([("nvjet_a", 4000.0), ("flash_fwd", 1000.0), ("_modulate_kernel", 600.0),
                                  ("elementwise", 400.0), ("nvjet_a", 2000.0)], forwards=2)
    assert split["ms"] == {"gemm": 3.0, "attention": 0.5, "other": 0.5}
    assert split["total_ms"] == 4.0 and split["bitfuse_ms"] == 0.3
    assert split["top"][0] == ["nvjet_a", 3.0]


def test_comparison_is_bitwise():
    a = torch.tensor([1.0, 0.0, float("nan"), 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, -0.0, float("nan"), 2.015625], dtype=torch.bfloat16)
    assert models.compare([a, a], [a, a]) == dict(differing=0, numel=8, max_ulp=0)
    assert models.compare([a], [b]) == dict(differing=2, numel=4, max_ulp=1)  # -0.0 counts; NaN equals NaN
    assert models.compare([a], [a, a])["differing"] is None
    assert models.tensors_of((a, [b, {"k": a}], None)) == [a, b, a]


def test_merging_keeps_the_worst_and_not_comparable():
    rec = {}
    models._merge(rec, dict(differing=0, numel=4, max_ulp=0))
    models._merge(rec, dict(differing=3, numel=4, max_ulp=2))
    models._merge(rec, dict(differing=1, numel=4, max_ulp=1))
    assert rec == dict(differing=3, numel=4, max_ulp=2)
    models._merge(rec, dict(differing=None, numel=4, max_ulp=None))
    models._merge(rec, dict(differing=0, numel=4, max_ulp=0))
    assert rec["differing"] is None and rec["max_ulp"] is None


def _wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_sampler_files_samples_under_the_mode_running():
    values = iter(range(10_000))

    def read():
        v = next(values)
        return (1980.0 - v, 500.0 + v, 40)

    s = models.GpuSampler(torch.device("cpu"), interval=0.001, read=read).start()
    try:
        with s.tagged("eager"):
            assert _wait_for(lambda: len(s.samples.get("eager", [])) >= 3)
        n = len(s.samples["eager"])
        time.sleep(0.02)  # untagged: nothing sampled
        untagged = sum(len(v) for v in s.samples.values())
        with s.tagged("lossless"):
            assert _wait_for(lambda: len(s.samples.get("lossless", [])) >= 3)
    finally:
        s.stop()
    assert untagged <= n + 1  # at most the sample in flight when the tag was cleared
    summ = s.summary("eager")
    assert summ["samples"] == len(s.samples["eager"]) and summ["temperature_c"]["median"] == 40
    assert summ["sm_clock_mhz"]["max"] == 1980.0 and summ["power_w"]["min"] == 500.0
    assert s.summary("compile") is None and s.why is None


def test_sampler_without_nvml_or_with_a_failing_read_says_why():
    assert models.GpuSampler(torch.device("cpu")).why == "not a CUDA device"

    def read():
        raise OSError("driver gone")

    s = models.GpuSampler(torch.device("cpu"), interval=0.001, read=read).start()
    with s.tagged("eager"):
        assert _wait_for(lambda: s.why is not None)
    s.stop()
    assert "driver gone" in s.why and s.summary("eager") is None


# ---------------------------------------------------------------- the mode runner


class Toy(torch.nn.Module):
    """Output depends on the mode entered: lossless equals eager, high differs everywhere."""

    def __init__(self):
        super().__init__()
        self.mode = "eager"
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return (x * 2 + (1.0 if self.mode == "high" else 0.0), x[:1])


def fake_enter(log, fail=None):
    def enter(mode, model):
        log.append(("enter", mode))
        if mode == "compile":
            raise modes.ModeError("mode 'compile' needs a CUDA GPU")
        if fail and fail(mode, log):
            raise RuntimeError(f"{mode} broke")
        model.mode = mode

        def undo():
            log.append(("undo", mode))
            model.mode = "eager"

        return undo

    return enter


def _workload(log, fail=None, rounds=3, modes_=("eager", "lossless", "high", "graphs", "compile")):
    args = types.SimpleNamespace(modes=list(modes_), rounds=rounds, per_round=2, profile=True,
                                 device=torch.device("cpu"))
    saves = []
    rec = {}
    w = models.Workload(Toy(), {"x": torch.arange(6.0)}, args, models.GpuSampler(torch.device("cpu")),
                        lambda: saves.append(1), rec, enter=fake_enter(log, fail))
    return w, rec, saves


def test_rounds_rotate_and_every_mode_keeps_its_own_samples():
    log = []
    w, rec, saves = _workload(log)
    w.run()
    m = rec["modes"]
    assert m["compile"] == {"skipped": "mode 'compile' needs a CUDA GPU"}
    entered = [mode for what, mode in log if what == "enter"]
    first, rounds = entered[:5], entered[5:]
    assert first == ["eager", "lossless", "high", "graphs", "compile"]
    live = ["eager", "lossless", "high", "graphs"]
    assert rounds == live + live[1:] + live[:1] + live[2:] + live[:2]
    assert [what for what, _ in log].count("undo") == 4 + 12  # every entry that succeeded was undone
    for mode in live:
        assert len(m[mode]["rounds_ms"]) == 3 and all(len(r) == 2 for r in m[mode]["rounds_ms"])
        assert len(m[mode]["rounds_cpu_ms"]) == 3 and all(len(r) == 2 for r in m[mode]["rounds_cpu_ms"])
        assert len(m[mode]["load_1min"]) == 3 and m[mode]["cpu_ms"] >= 0
        assert m[mode]["samples"] == 6 and m[mode]["ms_min"] <= m[mode]["ms"] <= m[mode]["ms_p90"]
        assert m[mode]["speedup_vs_eager"] == pytest.approx(m["eager"]["ms"] / m[mode]["ms"])
        assert m[mode]["speedup_vs_compile"] is None
        assert len(m[mode]["reentry_s"]) == 3 and "first_call_s" in m[mode]
    assert m["eager"]["differing"] == 0 and m["lossless"]["differing"] == 0 and m["graphs"]["differing"] == 0
    assert m["high"]["differing"] == 6 and m["high"]["numel"] == 7 and m["high"]["differing_per_round"] == [6] * 3
    assert m["lossless"]["verdicts"] == {}  # toy: no bitfuse site reached a verdict
    assert "kernels" not in m["eager"]  # no profile off the GPU
    assert len(saves) >= 5 + 3


def test_a_failing_mode_is_recorded_and_the_others_go_on():
    log = []
    w, rec, _ = _workload(log, fail=lambda mode, log: mode == "graphs" and len(log) > 12, rounds=4)
    w.run()
    m = rec["modes"]
    assert m["graphs"]["error"].startswith("round ") and "RuntimeError: graphs broke" in m["graphs"]["error"]
    assert len(m["graphs"].get("rounds_ms", [])) < 4 and len(m["lossless"]["rounds_ms"]) == 4
    after = log[[i for i, e in enumerate(log) if e == ("enter", "graphs")][-1] + 1:]
    assert ("enter", "graphs") not in after and ("enter", "lossless") in after


def test_the_reference_failing_stops_the_workload():
    w, rec, _ = _workload([], fail=lambda mode, log: mode == "eager")
    with pytest.raises(RuntimeError, match="eager, the reference, failed"):
        w.run()


# ---------------------------------------------------------------- the whole flow on a tiny LTX-2

diffusers = pytest.importorskip("diffusers")


def _smoke(tmp_path, *extra):
    return models.main(["ltx2", "--tiny", "--device", "cpu", "--rounds", "2", "--per-round", "1", "--out",
                        str(tmp_path), "--modes", "eager", "lossless", "compile", *extra])


def test_cpu_smoke_writes_the_json_the_report_reads(tmp_path, capsys):
    assert _smoke(tmp_path, "--per-token") == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name == "ltx2-cpu-b2-tiny.json"
    res = json.loads(path.read_text())
    assert res["bench"] == "models" and res["status"] == "complete" and res["preset"] == "ltx2"
    assert res["command"].startswith("python -m bench.models ltx2 --tiny")
    assert res["config"]["layers"] == 2 and res["config"]["batch"] == 2 and res["config"]["params"] > 0
    assert list(res["workloads"]) == ["per-sample", "per-token"]
    for w in res["workloads"].values():
        assert w["inputs"]["timestep"] in ([2], [2, 32])
        assert set(w["modes"]) == {"eager", "lossless", "compile"} and "skipped" in w["modes"]["compile"]
        assert w["modes"]["lossless"]["differing"] == 0 and w["modes"]["lossless"]["samples"] == 2
    assert any("clock and power not recorded" in n for n in res["notes"])
    assert "[per-token] B=2, per-token timestep" in capsys.readouterr().out
    text = "\n".join(report.models_section(str(path)))
    assert "| lossless | " in text and "0 of 608" in text and "skipped: mode 'compile'" in text


def test_a_run_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    def interrupted(self, mode, r):
        raise models.Interrupted("signal 15")

    monkeypatch.setattr(models.Workload, "visit", interrupted)
    assert _smoke(tmp_path) == 1
    (path,) = tmp_path.glob("*.json")
    res = json.loads(path.read_text())
    assert res["status"] == "interrupted (signal 15)"
    assert res["workloads"]["per-sample"]["modes"]["lossless"]["first_call_s"] > 0


def test_cold_start_children(tmp_path):
    argv = ["ltx2", "--tiny", "--device", "cpu", "--modes", "eager", "lossless"]
    cs = models.cold_start(argv + ["--cold-start"], timeout_s=300)
    for phase in ("cold", "warm"):
        assert cs[phase]["lossless"]["differing"] == 0 and cs[phase]["lossless"]["first_call_s"] > 0
        assert cs[phase]["lossless"]["second_call_s"] > 0
        assert "compile" not in cs[phase] and cs[phase]["triton_cache"].endswith("triton")
    assert "first calls, cold (empty Triton and Inductor caches): eager" in models.cold_start_text(cs)


@pytest.mark.parametrize("preset", ["wan", "wan2.2-5b"])
def test_wan_presets_run_on_a_cpu(tmp_path, preset):
    """The Wan presets' whole flow on tiny models (full size: 32,760 and 27,280 tokens)."""
    assert models.main([preset, "--tiny", "--device", "cpu", "--rounds", "1", "--per-round", "1", "--out",
                        str(tmp_path), "--modes", "eager", "lossless"]) == 0
    (path,) = tmp_path.glob("*.json")
    res = json.loads(path.read_text())
    assert res["status"] == "complete" and res["preset"] == preset
    (w,) = res["workloads"].values()
    assert w["modes"]["lossless"]["differing"] == 0
    from bitfuse.models import wan_configs

    assert models.WAN_VIDEO["2.1-14b"] == (480, 832, 81) and wan_configs.video_tokens("2.1-14b", 480, 832, 81) == 32760
    assert wan_configs.video_tokens("2.2-5b", *models.WAN_VIDEO["2.2-5b"]) == 27280


def test_source_digest_names_what_ran(tmp_path, monkeypatch):
    """The digest of the package's sources: the same for the same files, another for a
    changed one, blind to anything but .py files; a result records it beside the commit."""
    (tmp_path / "bitfuse" / "ops").mkdir(parents=True)
    (tmp_path / "bitfuse" / "a.py").write_text("x = 1\n")
    (tmp_path / "bitfuse" / "ops" / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(models, "ROOT", str(tmp_path))
    first = models.source_digest()
    assert len(first) == 16 and models.source_digest() == first
    (tmp_path / "bitfuse" / "notes.txt").write_text("not code")
    assert models.source_digest() == first
    (tmp_path / "bitfuse" / "ops" / "b.py").write_text("y = 3\n")
    assert models.source_digest() != first
    assert set(models.versions()) >= {"torch", "commit", "source"}
