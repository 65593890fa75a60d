"""`bitfuse run`: the tiny LTX-2 pipeline end to end in every CPU mode, the report,
the videos, and every argument error (each caught before any work)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
av = pytest.importorskip("av")

import bitfuse  # noqa: E402
from bitfuse import run as run_cmd  # noqa: E402
from bitfuse.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()
QUICK = ["--steps", "2", "--no-progress"]


def run(argv, capsys, tmp_path):
    rc = main(["run", "--out", str(tmp_path / "videos"), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def streams(path) -> list[str]:
    with av.open(str(path)) as container:
        return sorted(s.type for s in container.streams)


# ---------------------------------------------------------------- end to end


def test_tiny_pipeline_in_every_cpu_mode(tmp_path, capsys):
    js, png = tmp_path / "run.json", tmp_path / "run.png"
    modes = "eager,lossless,high" + (",graphs,compile" if CUDA else "")
    rc, out, err = run([*QUICK, "--modes", modes, "--json", str(js), "--plot", str(png)], capsys, tmp_path)
    assert rc == 0, err
    report = json.loads(js.read_text())

    c = report["config"]
    assert c["preset"] == "tiny" and c["pipeline"] == "LTX2Pipeline" and c["layers"] == 2 and c["steps"] == 2
    assert (c["height"], c["width"], c["frames"]) == (128, 128, 9)
    assert c["video_tokens"] == 2 * 4 * 4 and c["audio_tokens"] >= 1
    assert c["dtype"] == ("bf16" if CUDA else "fp32")
    for key in ("torch", "triton", "diffusers", "transformers", "av", "bitfuse", "python"):
        assert key in report["versions"]

    runs = {m["mode"]: m for m in report["modes"]}
    assert list(runs) == modes.split(",")
    for m in runs.values():
        assert m["error"] is None
        assert len(m["step_ms"]) == 2 and m["median_step_ms"] > 0 and m["total_ms"] > sum(m["step_ms"]) * 0.5
        assert 0 < m["transformer_share"] < 1 and m["warmup_ms"] > 0
        assert streams(m["video"]) == ["audio", "video"]
    assert runs["eager"]["repeatable"] is True
    for mode in ("lossless", "graphs"):
        if mode in runs:
            m = runs[mode]
            assert m["equal"] and m["video_equal"] and m["audio_equal"] and m["video_differing"] == 0
            assert m["video_values"] == 9 * 3 * 128 * 128
    if not CUDA:  # every site falls back to eager on a CPU, so high is exact here too
        assert runs["high"]["equal"] is True

    # the header first, then the table, then the notes; one no-GPU note; no carriage returns
    assert out.startswith("bitfuse run: LTX-2.0 tiny pipeline")
    assert out.index("text-to-video") < out.index("bit-identical") < out.index("Videos (mp4")
    assert "\r" not in err and "Traceback" not in err
    if not CUDA:
        assert (out + err).count("No CUDA GPU") == 1
        assert "speedup" not in out and "x  " not in out  # CPU times are noise: no ratios shown
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ltx23_image_to_video(tmp_path, capsys):
    import PIL.Image

    image = tmp_path / "first.png"
    PIL.Image.new("RGB", (96, 64), (200, 40, 40)).save(image)
    js = tmp_path / "r.json"
    rc, out, err = run(["--steps", "1", "--no-progress", "--variant", "2.3", "--image", str(image),
                        "--modes", "lossless", "--json", str(js)], capsys, tmp_path)
    assert rc == 0, err
    report = json.loads(js.read_text())
    assert report["config"]["variant"] == "2.3" and report["config"]["pipeline"] == "LTX2ImageToVideoPipeline"
    assert [m["mode"] for m in report["modes"]] == ["eager", "lossless"]  # eager added as the reference
    assert report["modes"][1]["equal"] is True
    assert "image-to-video" in out


def test_identity_check_catches_a_difference(monkeypatch, tmp_path, capsys):
    """A 'lossless' mode that changes one bias must be reported as not identical, exit 1."""

    class Handle:
        def __init__(self, target, **kw):
            self.bias = target.transformer.proj_out.bias
            self.saved = self.bias.detach().clone()
            self.bias.data.add_(1e-2)

        def restore(self):
            self.bias.data.copy_(self.saved)

    monkeypatch.setattr(bitfuse, "accelerate", Handle)
    js = tmp_path / "r.json"
    rc, out, err = run([*QUICK, "--modes", "eager,lossless", "--json", str(js)], capsys, tmp_path)
    assert rc == 1
    lossless = json.loads(js.read_text())["modes"][1]
    assert lossless["equal"] is False and lossless["video_differing"] > 0
    assert "FAIL: lossless" in out and "differs: video" in out


def test_json_to_stdout_is_strict(tmp_path, capsys):
    rc, out, err = run([*QUICK, "--modes", "eager", "--json", "-"], capsys, tmp_path)
    assert rc == 0, err
    report = json.loads(out, parse_constant=lambda name: pytest.fail(f"non-strict JSON constant {name}"))
    assert report["modes"][0]["mode"] == "eager"
    assert "bitfuse run:" in err and "reference" in err  # the table goes to stderr then
    assert not os.path.exists("-")


def test_checkpoint_folder(tmp_path, capsys):
    from bitfuse.pipeline import random_pipeline

    root = tmp_path / "ckpt"
    random_pipeline("tiny", layers=1, seed=3).save_pretrained(str(root))
    js = tmp_path / "r.json"
    rc, out, err = run(["--checkpoint", str(root), *QUICK, "--modes", "eager,lossless", "--height", "64",
                        "--width", "64", "--frames", "9", "--text-tokens", "8", "--json", str(js)], capsys, tmp_path)
    assert rc == 0, err
    report = json.loads(js.read_text())
    assert report["config"]["checkpoint"] == str(root) and report["config"]["layers"] == 1
    assert report["modes"][1]["equal"] is True

    for f in os.listdir(root / "vae"):
        if f.endswith(".safetensors"):
            os.remove(root / "vae" / f)
    os.remove(root / "transformer" / "config.json")
    rc, out, err = run(["--checkpoint", str(root)], capsys, tmp_path)
    _assert_clean_error(rc, err, "is incomplete: missing", "transformer/config.json", "vae/ weights")
    assert len(err.strip().splitlines()) == 1


def test_python_m_bitfuse_run(tmp_path):
    """Without --no-progress: stderr is a pipe here, so no progress bars either."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bitfuse", "run", "--steps", "1", "--modes", "eager,lossless",
                           "--guidance-scale", "1", "--audio-guidance-scale", "1", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("bitfuse run:") and "bit-identical" in proc.stdout
    assert str(tmp_path / "lossless.mp4") in proc.stdout
    assert "\r" not in proc.stderr and "Traceback" not in proc.stderr


def test_bad_environment_is_one_line(tmp_path):
    env = dict(os.environ, BITFUSE_VERIFY="bogus",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "bitfuse", "run", "--steps", "1", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("bitfuse: error:")]
    assert errors == ["bitfuse: error: BITFUSE_VERIFY='bogus': use 'once' (the default) or 'always'"]


# ---------------------------------------------------------------- argument errors, before any work


def _assert_clean_error(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the pipeline is built: the error must come before."""
    monkeypatch.setattr(run_cmd, "_build", lambda s: pytest.fail("the pipeline was built"))


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--preset", "huge"], ["invalid choice: 'huge'", "tiny", "ltx2"]),
        (["--modes", "eager,turbo"], ["unknown mode 'turbo'", "lossless"]),
        (["--modes", ","], ["--modes is empty"]),
        (["--layers", "0"], ["--layers must be at least 1"]),
        (["--steps", "0"], ["--steps must be at least 1"]),
        (["--frames", "-2"], ["--frames must be at least 1"]),
        (["--height", "100"], ["multiples of 32", "100x128"]),
        (["--dtype", "fp8"], ["invalid choice: 'fp8'"]),
        (["--variant", "3.0"], ["invalid choice: '3.0'"]),
        (["--device", "tpu"], ["device"]),
        (["--steps", "two"], ["--steps", "invalid int value"]),
        (["--guidance-scale", "nan"], ["--guidance-scale", "must be a finite number"]),
        (["--audio-guidance-scale", "inf"], ["--audio-guidance-scale", "must be a finite number"]),
        (["--fps", "0"], ["--fps must be positive"]),
        (["--prompt", "a cat"], ["--prompt needs a --checkpoint with a text encoder"]),
        (["--checkpoint", ".", "--layers", "4"], ["--layers apply to the random presets"]),
        (["--image", "/nonexistent.png"], ["--image /nonexistent.png", "cannot read it"]),
        (["--json", "/tmp"], ["--json /tmp: is a directory"]),
        (["--json", "/nonexistent/x.json"], ["--json /nonexistent/x.json: folder /nonexistent does not exist"]),
        (["--plot", "out.txt"], ["--plot out.txt: give a .png, .svg or .pdf name"]),
        (["--plot", "/nonexistent/p.png"], ["folder /nonexistent does not exist"]),
        (["--out", "/nonexistent/videos"], ["--out /nonexistent/videos: folder /nonexistent does not exist"]),
    ],
)
def test_argument_errors(argv, needles, no_work, tmp_path, capsys):
    rc, out, err = run(argv, capsys, tmp_path)
    _assert_clean_error(rc, err, *needles)
    *usage, last = err.strip().splitlines()  # one line, after argparse's usage for its own errors
    assert last.startswith("bitfuse run: error:") and all(line.startswith(("usage:", " ")) for line in usage)


def test_out_is_a_file(no_work, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    rc = main(["run", "--out", str(tmp_path / "f")])
    _assert_clean_error(rc, capsys.readouterr().err, "exists and is not a folder")


@pytest.mark.parametrize("layout", ["missing", "file", "no index", "not ltx2"])
def test_checkpoint_errors(layout, no_work, tmp_path, capsys):
    path = tmp_path / "ckpt"
    if layout == "file":
        path.write_text("")
    elif layout == "no index":
        path.mkdir()
    elif layout == "not ltx2":
        path.mkdir()
        (path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    rc, out, err = run(["--checkpoint", str(path)], capsys, tmp_path)
    needle = {"missing": "no such directory", "file": "not a directory", "no index": "no model_index.json",
              "not ltx2": "not an LTX-2 pipeline (model_index.json names 'FluxPipeline')"}[layout]
    _assert_clean_error(rc, err, "--checkpoint", needle)
    assert len(err.strip().splitlines()) == 1


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv, needle", [
    (["--preset", "ltx2"], "a 3.4B-parameter transformer (12.8 GiB in fp32) over 6,144 video + 126 audio tokens"),
    (["--height", "8192", "--width", "8192"], "131,072 video + 9 audio tokens"),
])
def test_long_cpu_runs_are_refused_with_an_estimate(argv, needle, no_work, tmp_path, capsys):
    rc, out, err = run(argv, capsys, tmp_path)
    _assert_clean_error(rc, err, "on a CPU this is", needle, "hours", "--yes")


def test_more_tokens_than_the_scheduler_can_shift(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(run_cmd, "_run_mode", lambda *a: pytest.fail("a mode ran"))
    rc, out, err = run(["--height", "100000", "--width", "100000", "--yes"], capsys, tmp_path)
    _assert_clean_error(rc, err, "19,531,250 video tokens", "timestep shift", "smaller --height/--width/--frames")


@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("argv, needle", [
    (["--device", "cuda"], "no CUDA GPU"),
    (["--modes", "eager,graphs"], "mode 'graphs' needs a CUDA GPU"),
    (["--modes", "compile"], "mode 'compile' needs a CUDA GPU"),
])
def test_gpu_only_on_a_cpu(argv, needle, no_work, tmp_path, capsys):
    rc, out, err = run(argv, capsys, tmp_path)
    _assert_clean_error(rc, err, needle)


def test_diffusers_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now raises ImportError
    rc, out, err = run(QUICK, capsys, tmp_path)
    _assert_clean_error(rc, err, "diffusers", "pip install 'bitfuse[diffusers]'")


def test_matplotlib_missing(monkeypatch, no_work, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    rc, out, err = run([*QUICK, "--plot", str(tmp_path / "p.png")], capsys, tmp_path)
    _assert_clean_error(rc, err, "--plot needs matplotlib")


@pytest.mark.parametrize("exc, needle", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), "CUDA out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 40000000000000 bytes."), "CPU out of memory"),
])
def test_out_of_memory(exc, needle, monkeypatch, tmp_path, capsys):
    def oom(s):
        raise exc

    monkeypatch.setattr(run_cmd, "_build", oom)
    rc, out, err = run(QUICK, capsys, tmp_path)
    _assert_clean_error(rc, err, needle, "--height/--width/--frames")


def test_help_and_no_command(capsys):
    assert main(["run", "--help"]) == 0
    out, _ = capsys.readouterr()
    for flag in ("--preset", "--layers", "--steps", "--modes", "--guidance-scale", "--checkpoint", "--image",
                 "--prompt", "--json", "--plot", "--out", "--frames", "--dtype", "--device", "--seed", "--yes"):
        assert flag in out
    assert main([]) == 2
