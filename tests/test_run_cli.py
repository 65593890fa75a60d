"""`bitfuse run`: the tiny preset end to end, the report, and every argument error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")

import bitfuse  # noqa: E402
from bitfuse import denoise  # noqa: E402
from bitfuse.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()
QUICK = ["--steps", "2", "--no-progress"]


def run(argv, capsys):
    rc = main(["run", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- end to end


def test_tiny_end_to_end_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "out" / "run.json", tmp_path / "run.png"
    rc, out, err = run([*QUICK, "--json", str(js), "--plot", str(png)], capsys)
    assert rc == 0, err
    report = json.loads(js.read_text())

    c = report["config"]
    assert c["preset"] == "tiny" and c["layers"] == 2 and c["steps"] == 2
    assert c["cfg"] is True and c["batch"] == 2
    assert c["modes"] == ["eager", "lossless", "high"]
    assert c["video_tokens"] == 2 * 4 * 4 and c["audio_tokens"] >= 1
    assert c["dtype"] == ("bf16" if CUDA else "fp32")
    assert report["device_name"]
    for key in ("torch", "triton", "diffusers", "bitfuse", "python"):
        assert key in report["versions"]
    assert report["versions"]["torch"] == torch.__version__

    modes = {m["mode"]: m for m in report["modes"]}
    assert list(modes) == ["eager", "lossless", "high"]
    for m in modes.values():
        assert m["error"] is None
        assert len(m["step_ms"]) == 2 and all(t > 0 for t in m["step_ms"])
        assert m["median_step_ms"] > 0 and m["total_ms"] >= m["median_step_ms"]
        assert m["warmup_ms"] > 0 and m["speedup"] > 0
        for key in ("equal", "max_ulp", "max_abs", "step0_max_ulp", "fast_paths", "verdicts"):
            assert key in m
    assert modes["eager"]["repeatable"] is True
    assert modes["lossless"]["equal"] is True and modes["lossless"]["max_ulp"] == 0
    if not CUDA:  # everything falls back to eager on a CPU, so high is exact here too
        assert modes["high"]["equal"] is True
        assert "fast paths need" in err and "CUDA" in err
    assert "warm-up" in out and "bit-identical" in out and "lossless" in out

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ltx23_variant_lossless(capsys, tmp_path):
    js = tmp_path / "r.json"
    rc, out, err = run(["--steps", "1", "--no-progress", "--variant", "2.3", "--modes", "lossless",
                        "--json", str(js)], capsys)
    assert rc == 0, err
    report = json.loads(js.read_text())
    assert report["config"]["variant"] == "2.3"
    assert [m["mode"] for m in report["modes"]] == ["eager", "lossless"]  # eager added as the reference
    assert report["modes"][1]["equal"] is True


def test_identity_check_catches_a_difference(monkeypatch, capsys, tmp_path):
    """A 'lossless' mode that changes one bias must be reported as not identical, exit 1."""

    class Handle:
        def __init__(self, model):
            self.bias = model.proj_out.bias
            self.saved = self.bias.detach().clone()
            self.bias.data.add_(1e-2)

        def restore(self):
            self.bias.data.copy_(self.saved)

    monkeypatch.setattr(bitfuse, "accelerate", lambda model, **kw: Handle(model))
    js = tmp_path / "r.json"
    rc, out, err = run(["--steps", "2", "--no-progress", "--modes", "eager,lossless", "--json", str(js)], capsys)
    assert rc == 1
    lossless = json.loads(js.read_text())["modes"][1]
    assert lossless["equal"] is False and lossless["max_abs"] > 0 and lossless["max_ulp"] > 0
    assert "FAIL: lossless" in out


@pytest.mark.parametrize("layout", ["transformer", "pipeline"])
def test_checkpoint_loads_a_local_transformer(layout, tmp_path, capsys):
    from bitfuse.models.ltx2_configs import build_model, tiny_config

    root = tmp_path / "ckpt"
    build_model(tiny_config(num_layers=1), seed=3).save_pretrained(
        str(root if layout == "transformer" else root / "transformer")
    )
    js = tmp_path / "r.json"
    rc, out, err = run(["--checkpoint", str(root), "--steps", "1", "--no-progress", "--modes", "eager,lossless",
                        "--json", str(js)], capsys)
    assert rc == 0, err
    report = json.loads(js.read_text())
    assert report["config"]["checkpoint"] == str(root) and report["config"]["layers"] == 1
    assert report["modes"][1]["equal"] is True


def test_python_m_bitfuse_run_no_cfg():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "bitfuse", "run", "--steps", "1", "--no-cfg", "--modes", "eager,lossless",
         "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "batch 1 (no CFG)" in proc.stdout and "bit-identical" in proc.stdout
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- argument errors


def _assert_clean_error(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--preset", "huge"], ["unknown preset 'huge'", "tiny", "ltx2"]),
        (["--modes", "eager,turbo"], ["unknown mode 'turbo'", "lossless"]),
        (["--modes", ","], ["--modes is empty"]),
        (["--layers", "0"], ["--layers must be at least 1"]),
        (["--steps", "0"], ["--steps must be at least 1"]),
        (["--frames", "-2"], ["--frames must be at least 1"]),
        (["--dtype", "fp8"], ["unknown dtype 'fp8'"]),
        (["--variant", "3.0"], ["unknown variant '3.0'"]),
        (["--device", "tpu"], ["device"]),
        (["--steps", "two"], ["--steps", "invalid int value"]),
    ],
)
def test_argument_errors(argv, needles, capsys):
    rc, out, err = run(argv, capsys)
    _assert_clean_error(rc, err, *needles)


def test_checkpoint_missing(tmp_path, capsys):
    rc, out, err = run(["--checkpoint", str(tmp_path / "nope")], capsys)
    _assert_clean_error(rc, err, "--checkpoint", "no such file or directory")


def test_checkpoint_not_ltx2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    rc, out, err = run(["--checkpoint", str(tmp_path)], capsys)
    _assert_clean_error(rc, err, "not an LTX-2 transformer", "FluxTransformer2DModel")


def test_checkpoint_without_config(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"")
    rc, out, err = run(["--checkpoint", str(tmp_path)], capsys)
    _assert_clean_error(rc, err, "not an LTX-2 transformer", "config.json")
    rc, out, err = run(["--checkpoint", str(tmp_path / "weights.bin")], capsys)
    _assert_clean_error(rc, err, "not a directory")


def test_diffusers_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now raises ImportError
    rc, out, err = run(QUICK, capsys)
    _assert_clean_error(rc, err, "diffusers", "pip install bitfuse[diffusers]")


def test_matplotlib_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, out, err = run([*QUICK, "--plot", str(tmp_path / "p.png")], capsys)
    _assert_clean_error(rc, err, "--plot needs matplotlib")
    assert not (tmp_path / "p.png").exists()


def test_out_of_memory(monkeypatch, capsys):
    def oom(s):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(denoise, "_build_model", oom)
    rc, out, err = run(QUICK, capsys)
    _assert_clean_error(rc, err, "CUDA out of memory", "fewer --layers", "--frames")


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(capsys):
    rc, out, err = run(["--device", "cuda"], capsys)
    _assert_clean_error(rc, err, "--device cuda", "no CUDA GPU")


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_graphs_mode_without_cuda(capsys):
    rc, out, err = run(["--modes", "eager,graphs"], capsys)
    _assert_clean_error(rc, err, "mode 'graphs' needs a CUDA GPU")


def test_help_and_no_command(capsys):
    assert main(["run", "--help"]) == 0
    out, _ = capsys.readouterr()
    for flag in ("--preset", "--layers", "--steps", "--modes", "--guidance-scale", "--no-cfg", "--checkpoint",
                 "--json", "--plot", "--frames", "--dtype", "--device", "--seed"):
        assert flag in out
    assert main([]) == 2
