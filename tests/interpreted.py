"""What the CPU kernel tests share: the marker for tests that need Triton's
interpreter, and plans for CPU tensors so that the kernels run in it."""

from __future__ import annotations

import contextlib
import os

import pytest

from bitfuse.ops import _params
from bitfuse.ops._launch import HAS_TRITON

interpreter = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter (CPU runs)"
)


@contextlib.contextmanager
def cpu_kernels():
    """Plans for CPU tensors, to run the kernels in Triton's interpreter."""
    old, _params.INTERPRET_ON_CPU = _params.INTERPRET_ON_CPU, True
    try:
        yield
    finally:
        _params.INTERPRET_ON_CPU = old
