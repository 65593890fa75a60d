import os

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter (CPU tensors, fp32 exact).
# Must be set before bitfuse.ops imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bitfuse import policy  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_policy(monkeypatch):
    """Every test starts from first sight, with the environment's flags off."""
    policy.reset_verdicts()
    monkeypatch.setattr(policy, "DISABLED", False)
    monkeypatch.setattr(policy, "VERIFY_ALWAYS", False)
    yield
    policy.reset_verdicts()
