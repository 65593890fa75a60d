"""The LTX-2 pipeline at full width on the GPU (random weights, 2 transformer layers,
121 frames at 512x768: 6144 video tokens): each mode's decoded video and audio
against the stock pipeline's, bit for bit where the mode promises it, the
pipeline stock again after each mode, and `bitfuse run` end to end with its mp4s.
About a minute on an H200, most of it Triton JIT, graph capture and compilation."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
av = pytest.importorskip("av")

from bitfuse import modes, policy  # noqa: E402
from bitfuse.cli import main  # noqa: E402
from bitfuse.numerics import same_bits  # noqa: E402
from bitfuse.pipeline import is_ltx23, random_pipeline, random_prompt  # noqa: E402

pytestmark = pytest.mark.gpu

CALL = dict(height=512, width=768, num_frames=121, num_inference_steps=2, output_type="pt", return_dict=False)


def build(variant):
    pipe = random_pipeline("ltx2", variant, layers=2, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, **kwargs):
    return pipe(**CALL, **random_prompt(pipe, 256), use_cross_timestep=is_ltx23(pipe.transformer),
                generator=torch.Generator("cuda").manual_seed(0), **kwargs)


@pytest.fixture(scope="module")
def ltx20():
    pipe = build("2.0")
    return pipe, generate(pipe)


@pytest.mark.parametrize("mode", ["lossless", "graphs", "high", "compile"])
def test_mode_against_the_stock_pipeline(mode, ltx20):
    pipe, (ref_video, ref_audio) = ltx20
    assert ref_video.shape == (1, 121, 3, 512, 768) and torch.isfinite(ref_video).all()
    # compile: CFG only, one transformer call a step (the STG and modality-isolation calls pass other
    # arguments, and each would be compiled again)
    kwargs = dict(stg_scale=0.0, modality_scale=1.0) if mode == "compile" else {}
    policy.reset_verdicts()
    with modes.entered(mode, pipe):
        generate(pipe, **kwargs)  # first sight, capture, compilation
        video, audio = generate(pipe, **kwargs)
    if mode in modes.BIT_IDENTICAL:
        assert same_bits(video, ref_video) and same_bits(audio, ref_audio)
        statuses = {v.status for v in policy.verdicts()}
        assert statuses == {"verified"}, policy.verdicts()  # the fast paths ran, and kept their contract
    else:
        assert video.shape == ref_video.shape and torch.isfinite(video).all() and torch.isfinite(audio).all()
    video, audio = generate(pipe)  # undone: stock again
    assert same_bits(video, ref_video) and same_bits(audio, ref_audio)


def test_ltx23_lossless_with_graphs():
    pipe = build("2.3")
    ref_video, ref_audio = generate(pipe)
    with modes.entered("graphs", pipe):
        generate(pipe)
        video, audio = generate(pipe)
    assert same_bits(video, ref_video) and same_bits(audio, ref_audio)


def test_bitfuse_run_ltx2_preset(tmp_path, capsys):
    js = tmp_path / "r.json"
    rc = main(["run", "--preset", "ltx2", "--layers", "2", "--steps", "2", "--modes", "eager,lossless,graphs",
               "--no-progress", "--out", str(tmp_path), "--json", str(js)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(js.read_text())
    assert report["config"]["video_tokens"] == 6144 and report["config"]["dtype"] == "bf16"
    for m in report["modes"][1:]:
        assert m["equal"] and m["fast_paths"]["verified"] > 0 and m["speedup"] > 0
    with av.open(report["modes"][1]["video"]) as container:
        assert sorted(s.type for s in container.streams) == ["audio", "video"]
    assert "speedup" in out and "bit-identical" in out and "No CUDA GPU" not in out
