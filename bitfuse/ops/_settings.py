"""The process-wide `torch.backends` settings that steer which kernel cuBLAS or cuDNN
runs, for the ops that call them beside their own kernels (the packed projections'
GEMM, the convolutions before an epilogue): part of those ops' keys, the gate's and
the sites' bound launches, so that a setting changed after first sight (say
`cudnn.benchmark = True`) makes a new key, verified again, instead of a verdict
reached under another setting.

Every value is read through a getter that cannot raise: torch refuses to report
some legacy flags once the newer API has set them (`torch.backends.cudnn.allow_tf32`
after `torch.backends.cudnn.conv.fp32_precision = "ieee"` raises RuntimeError), so
where torch has the newer getter (`fp32_precision`; torch 2.13 here has both) it is read instead,
and an unreadable value becomes its error's name. About 0.1 us a setting."""

from __future__ import annotations

import torch

__all__ = ["gemm_settings", "cudnn_settings"]


def _getter(name: str, *args):
    """A call of `torch._C.<name>(*args)` that returns a value or its error's name, or
    None where this torch has no such function."""
    get = getattr(torch._C, name, None)
    if get is None:
        return None

    def read():
        try:
            return get(*args)
        except Exception as exc:  # noqa: BLE001 - a setting torch will not report: keyed by that
            return f"unreadable ({type(exc).__name__})"

    return read


def _fp32(op: str, legacy: str) -> tuple:
    """The getters of TF32's use for `op` ("matmul", "conv"): the newer per-op and generic
    `fp32_precision` (the op's "none" inherits the generic one), else the legacy flag."""
    if getattr(torch._C, "_get_fp32_precision_getter", None) is not None:
        return (_getter("_get_fp32_precision_getter", "cuda", op), _getter("_get_fp32_precision_getter", "generic", "all"))
    return (_getter(legacy),)


def _present(*getters) -> tuple:
    return tuple(g for g in getters if g is not None)


_BLAS = _present(_getter("_get_blas_preferred_backend"))
_GEMM = {
    torch.bfloat16: _BLAS + _present(_getter("_get_cublas_allow_bf16_reduced_precision_reduction")),
    torch.float16: _BLAS + _present(_getter("_get_cublas_allow_fp16_reduced_precision_reduction"),
                                    _getter("_get_cublas_allow_fp16_accumulation")),
    torch.float32: _BLAS + _present(*_fp32("matmul", "_get_cublas_allow_tf32")),
}
_CUDNN = _present(_getter("_get_cudnn_enabled"), _getter("_get_cudnn_benchmark"), _getter("_get_cudnn_deterministic"),
                  _getter("_get_cudnn_depthwise_kernel"), *_fp32("conv", "_get_cudnn_allow_tf32"))


def gemm_settings(dtype: torch.dtype) -> tuple:
    """The settings a cuBLAS GEMM of `dtype` runs under: the preferred BLAS library and
    `torch.backends.cuda.matmul`'s reduced-precision reductions (bf16, fp16), fp16
    accumulation (fp16) or TF32 (fp32). A tuple of plain values, hashable."""
    return tuple(get() for get in _GEMM.get(dtype, _BLAS))


def cudnn_settings() -> tuple:
    """`torch.backends.cudnn`'s settings: enabled (which backend eager's convolution
    takes), benchmark, deterministic, the depthwise-kernel choice where torch has it,
    and TF32 for convolutions (which algorithm cuDNN runs). A tuple of plain values."""
    return tuple(get() for get in _CUDNN)
