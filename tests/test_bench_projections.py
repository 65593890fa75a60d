"""bench/projections.py on the CPU: its cases and arguments (the timings need a GPU)."""

import pytest
import torch

from bench import projections as bp
from bitfuse import sites
from bitfuse.ops import projections


def test_arguments(capsys):
    assert bp.parse_args([]).names == list(bp.CASES)
    assert bp.parse_args(["--cases", "sana-self,wan"]).names == ["sana-self", "wan"]
    with pytest.raises(SystemExit) as exc:
        bp.parse_args(["--cases", "sana-self,nope"])
    assert exc.value.code == 2 and "unknown case(s) nope" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["sana-self", "sana-caption"])
def test_the_cases_pack_as_accelerate_packs(name):
    """Sana's q, k, v pack end to end; its caption k, v with 64 zero rows between (the
    2240-element bf16 biases), as `accelerate` lays them out."""
    B, S, K, widths, bias = bp.CASES[name]
    mods = bp.linears(K, widths, bias, device="cpu")
    assert sites.pack_linears(*mods)
    assert projections.layout([m.weight for m in mods])[0] == ((0, 2240, 4480) if not bias else (0, 2304))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_needs_a_gpu(capsys):
    assert bp.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
