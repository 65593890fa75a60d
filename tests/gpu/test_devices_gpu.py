"""Operands on a CUDA device other than the current one: eager PyTorch runs them
where they are, so the kernels must too (Triton compiles for, and launches on, the
current device). Needs two GPUs."""

import pytest
import torch

from bitfuse import policy, quality, sites
from bitfuse.numerics import high_contract, same_bits
from bitfuse.ops._norm import modulated64, modulated_terms64, rms_norm64

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
            assert same_bits(got["modulate"], x * (1 + c) + h)
            assert same_bits(got["gated_residual"], x + y * gate)
            assert same_bits(got["rms"], rms(x) * (1 + c) + h)
            assert same_bits(got["layer_norm"], ln(x) * (1 + c) + h)
            n64 = rms_norm64(x, 1e-6)
            assert high_contract(high, rms(x) * (1 + c) + h, modulated64(n64, c, h), modulated_terms64(n64, c, h)) is None
        assert torch.cuda.current_device() == current
    verdicts = policy.verdicts()
    assert verdicts and all(v.status == "verified" for v in verdicts), verdicts
    assert all(f"cuda:{data}" in v.signature for v in verdicts)
