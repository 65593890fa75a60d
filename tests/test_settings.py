"""`ops._settings`: the torch.backends settings in the keys of the ops that call cuBLAS
or cuDNN. They follow each setting, through either of torch's APIs, and never raise.

The newer `fp32_precision` API leaves torch refusing some legacy getters
(`torch._C._get_cudnn_allow_tf32()` raises after `cudnn.conv.fp32_precision = "ieee"`),
a process-wide state, so those cases run in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from bitfuse.ops._settings import cudnn_settings, gemm_settings


def test_plain_hashable_values():
    gemms = (gemm_settings(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64))
    for values in (cudnn_settings(torch.bfloat16), cudnn_settings(torch.float32), *gemms):
        assert isinstance(values, tuple) and values and hash(values) is not None


def test_tf32_counts_for_fp32_convolutions_only():
    cudnn = torch.backends.cudnn
    before, bf16, fp32 = cudnn.allow_tf32, cudnn_settings(torch.bfloat16), cudnn_settings(torch.float32)
    try:
        cudnn.allow_tf32 = not before
        assert cudnn_settings(torch.bfloat16) == bf16 and cudnn_settings(torch.float32) != fp32
    finally:
        cudnn.allow_tf32 = before


def test_a_getter_that_raises_gives_its_error_not_an_exception(monkeypatch):
    from bitfuse.ops import _settings

    def refuses():
        raise RuntimeError("mixed TF32 APIs")

    monkeypatch.setattr(_settings, "_CUDNN", _settings._CUDNN + (refuses,))
    values = cudnn_settings(torch.bfloat16)
    assert values[-1] == "unreadable (RuntimeError)" and values[:-1] == _settings._read(_settings._CUDNN[:-1])


@pytest.mark.parametrize("flag", ["benchmark", "deterministic"])
def test_cudnn_settings_follow_the_flags(flag):
    cudnn = torch.backends.cudnn
    before, settings = getattr(cudnn, flag), cudnn_settings(torch.bfloat16)
    try:
        setattr(cudnn, flag, not before)
        assert cudnn_settings(torch.bfloat16) != settings
    finally:
        setattr(cudnn, flag, before)
    assert cudnn_settings(torch.bfloat16) == settings


@pytest.mark.parametrize("dtype, flag", [(torch.bfloat16, "allow_bf16_reduced_precision_reduction"),
                                         (torch.float16, "allow_fp16_reduced_precision_reduction"),
                                         (torch.float32, "allow_tf32")])
def test_gemm_settings_follow_the_legacy_flags(dtype, flag):
    """(A legacy TF32 flag set back to False reads as "ieee" where it had read "none",
    the same computation: a new key, verified once more, no harm.)"""
    matmul = torch.backends.cuda.matmul
    before = getattr(matmul, flag)
    try:
        setattr(matmul, flag, not before)
        flipped = gemm_settings(dtype)
        setattr(matmul, flag, before)
        back = gemm_settings(dtype)
        setattr(matmul, flag, not before)
        assert gemm_settings(dtype) == flipped != back
    finally:
        setattr(matmul, flag, before)


@pytest.mark.skipif(not hasattr(torch._C, "_get_fp32_precision_getter"), reason="no fp32_precision API in this torch")
def test_the_newer_api_is_followed_and_nothing_raises():
    code = textwrap.dedent("""
        import torch
        from bitfuse.ops._settings import cudnn_settings, gemm_settings
        conv, fp32 = cudnn_settings(torch.float32), gemm_settings(torch.float32)
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        try:
            torch._C._get_cudnn_allow_tf32()
            legacy_raises = False
        except RuntimeError:
            legacy_raises = True
        conv2, fp32b = cudnn_settings(torch.float32), gemm_settings(torch.float32)
        assert conv2 != conv and fp32b != fp32, (conv, conv2, fp32, fp32b)
        assert not any("unreadable" in str(v) for v in conv2 + fp32b), (conv2, fp32b)
        print("ok", legacy_raises)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "ok"
