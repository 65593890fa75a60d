"""Operands on a CUDA device other than the current one: eager PyTorch runs them
where they are, so the kernels must too (Triton compiles for, and launches on, the
current device). Needs two GPUs."""

import pytest
import torch

from bitfuse import policy, quality, sites
from bitfuse.numerics import within_one_ulp_at

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


class RMSNorm(torch.nn.Module):  # diffusers' RMSNorm without weight, as LTX-2's blocks hold it
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        v = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(v + self.eps)).to(x.dtype)


RMSNorm.__module__ = "diffusers.models.normalization"  # what sites.norm_kind recognises


def operands(device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x, y = (torch.randn(2, 257, 2240, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    c, h, gate = (torch.randn(2, 1, 6, 2240, device=device, dtype=torch.bfloat16, generator=g) * 0.3).unbind(2)[:3]
    return x, y, c, h, gate


@pytest.mark.parametrize("data,current", [(1, 0), (0, 1)])
def test_sites_run_on_the_operands_device(data, current):
    policy.reset_verdicts()
    dev = torch.device("cuda", data)
    ln = torch.nn.LayerNorm(2240, eps=1e-6, elementwise_affine=False)
    rms = RMSNorm()
    with torch.cuda.device(current):
        for seed in range(3):  # first sight (through Triton), then the direct launch
            x, y, c, h, gate = operands(dev, seed)
            got = {
                "modulate": sites.modulate_site(x, c, h),
                "gated_residual": sites.gated_residual_site(x, y, gate),
                "rms": sites.rms_norm_modulate_site(None, rms, x, c, h),
                "layer_norm": sites.layer_norm_modulate_site(None, ln, x, c, h),
            }
            with quality("high"):
                high = sites.rms_norm_modulate_site(None, rms, x, c, h)
            torch.cuda.synchronize(dev)
            assert all(t.device == dev for t in got.values()) and high.device == dev
            assert torch.equal(got["modulate"], x * (1 + c) + h)
            assert torch.equal(got["gated_residual"], x + y * gate)
            assert torch.equal(got["rms"], rms(x) * (1 + c) + h)
            assert torch.equal(got["layer_norm"], ln(x) * (1 + c) + h)
            ref = rms(x) * (1 + c) + h
            assert within_one_ulp_at(high, ref, (rms(x) * (1 + c)).float().abs().maximum(h.float().abs()), 2)
        assert torch.cuda.current_device() == current
    verdicts = policy.verdicts()
    assert verdicts and all(v.status == "verified" for v in verdicts), verdicts
    assert all(f"cuda:{data}" in v.signature for v in verdicts)
