"""`bitfuse run --context-parallel`: the launch errors, each before any work (the
runs themselves need several GPUs: tests/gpu/test_parallel_gpu.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("av")

from bitfuse import run as run_cmd
from bitfuse.cli import main


@pytest.fixture
def no_work(monkeypatch):
    monkeypatch.setattr(run_cmd, "_build", lambda s: pytest.fail("the pipeline was built"))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _error(argv, capsys, tmp_path) -> str:
    rc = main(["run", "--out", str(tmp_path / "videos"), *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_without_torchrun(no_work, capsys, tmp_path):
    last = _error(["--context-parallel", "ulysses"], capsys, tmp_path)
    assert "launch with torchrun --nproc-per-node N -m bitfuse run ... --context-parallel ulysses" in last


def test_one_process(no_work, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    last = _error(["--context-parallel", "ring"], capsys, tmp_path)
    assert "with one process has nothing to split" in last and "N >= 2" in last


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU error")
def test_no_gpu(no_work, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert "needs CUDA GPUs (NCCL)" in _error(["--context-parallel", "ulysses"], capsys, tmp_path)


def test_options_need_context_parallel(no_work, capsys, tmp_path):
    assert "--cp-anything apply with --context-parallel" in _error(["--cp-anything"], capsys, tmp_path)


def test_graphs_and_compile_are_refused(no_work, monkeypatch):
    cp = {"kind": "ulysses", "world": 2}
    for mode in ("graphs", "compile"):
        with pytest.raises(run_cmd.UsageError, match=f"mode '{mode}' does not run with --context-parallel"):
            run_cmd._mode_list(f"eager,{mode}", torch.device("cuda"), cp)
    assert run_cmd._mode_list(None, torch.device("cuda"), cp) == ["eager", "lossless", "high"]


def test_sizes_that_do_not_split_are_usage_errors(monkeypatch):
    from bitfuse.pipeline import transformer_config

    class Pipe:
        text_encoder = None

        class transformer:
            config = type("C", (), transformer_config("ltx2", "2.0", 1))

    s = {"cp": {"kind": "ulysses", "world": 4, "anything": False}, "text_tokens": 256}
    with pytest.raises(run_cmd.UsageError, match=r"ulysses over 4 GPUs: .*126 audio tokens do not divide by 4"
                                                 r".*--cp-anything"):
        run_cmd._check_cp_sizes(Pipe, s, 6144, 126)
    run_cmd._check_cp_sizes(Pipe, dict(s, cp=dict(s["cp"], anything=True)), 6144, 126)
    run_cmd._check_cp_sizes(Pipe, dict(s, cp=dict(s["cp"], world=2)), 6144, 126)
