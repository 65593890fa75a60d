"""The process-wide `torch.backends` settings that steer which kernel cuBLAS or cuDNN
runs, for the ops that call them beside their own kernels (the packed projections'
GEMM, the convolutions before an epilogue): part of those ops' keys, the gate's and
the sites' bound launches, so that a setting changed after first sight (say
`cudnn.benchmark = True`) makes a new key, verified again, instead of a verdict
reached under another setting.

Every value is read through a getter that cannot raise: torch refuses to report
some legacy flags once the newer API has set them (`torch.backends.cudnn.allow_tf32`
after `torch.backends.cudnn.conv.fp32_precision = "ieee"` raises RuntimeError), so
where torch has the newer getter (`_get_fp32_precision_getter`) it is read instead,
and an unreadable value becomes its error's name."""

from __future__ import annotations

import functools

import torch

__all__ = ["gemm_settings", "cudnn_settings"]


def _getter(name: str, *args):
    """`torch._C.<name>` with `args` bound (a zero-argument call), or None where this
    torch has no such function."""
    get = getattr(torch._C, name, None)
    if get is None:
        return None
    return functools.partial(get, *args) if args else get


def _fp32(op: str, legacy: str) -> tuple:
    """The getters of TF32's use for `op` ("matmul", "conv"): the newer per-op and generic
    `fp32_precision` (the op's "none" inherits the generic one), else the legacy flag."""
    if getattr(torch._C, "_get_fp32_precision_getter", None) is not None:
        return (_getter("_get_fp32_precision_getter", "cuda", op), _getter("_get_fp32_precision_getter", "generic", "all"))
    return (_getter(legacy),)


def _present(*getters) -> tuple:
    return tuple(g for g in getters if g is not None)


def _read(getters: tuple) -> tuple:
    """Each getter's value; where one raises (a torch that refuses to report it), its
    error's name instead. One `try` around plain C calls: free unless one raises."""
    try:
        return tuple([get() for get in getters])
    except Exception:  # noqa: BLE001 - the slow path, value by value
        values = []
        for get in getters:
            try:
                values.append(get())
            except Exception as exc:  # noqa: BLE001 - a setting torch will not report: keyed by that
                values.append(f"unreadable ({type(exc).__name__})")
        return tuple(values)


_BLAS = _present(_getter("_get_blas_preferred_backend"))
_GEMM = {
    torch.bfloat16: _BLAS + _present(_getter("_get_cublas_allow_bf16_reduced_precision_reduction")),
    torch.float16: _BLAS + _present(_getter("_get_cublas_allow_fp16_reduced_precision_reduction"),
                                    _getter("_get_cublas_allow_fp16_accumulation")),
    torch.float32: _BLAS + _present(*_fp32("matmul", "_get_cublas_allow_tf32")),
}
_CUDNN = _present(_getter("_get_cudnn_enabled"), _getter("_get_cudnn_benchmark"), _getter("_get_cudnn_deterministic"),
                  _getter("_get_cudnn_depthwise_kernel"))
_CUDNN_FP32 = _CUDNN + _present(*_fp32("conv", "_get_cudnn_allow_tf32"))


def gemm_settings(dtype: torch.dtype) -> tuple:
    """The settings a cuBLAS GEMM of `dtype` runs under: the preferred BLAS library and
    `torch.backends.cuda.matmul`'s reduced-precision reductions (bf16, fp16), fp16
    accumulation (fp16) or TF32 (fp32). A tuple of plain values, hashable."""
    return _read(_GEMM.get(dtype, _BLAS))


def cudnn_settings(dtype: torch.dtype) -> tuple:
    """`torch.backends.cudnn`'s settings for a convolution of `dtype`: enabled (which
    backend eager's convolution takes), benchmark, deterministic and the depthwise-kernel
    choice where torch has it (which algorithm cuDNN runs), and for fp32 TF32's use.
    A tuple of plain values, hashable."""
    return _read(_CUDNN_FP32 if dtype == torch.float32 else _CUDNN)
