"""Kernels: one file per op holding its Triton kernel, planner (the guard),
launcher, registered custom op, eager reference and its `OpSpec`; shared
kernel code in `_launch` (launch core), `_params` (rows and parameters),
`_norm` (the norm kernels' base) and `_act` (activations as aten computes
them); `projections` has no kernel of its own (aten's GEMM on packed weights). Functions here are guarded but ungated: the
kernel where the guard allows it, else the eager reference (the sites add the
first-sight gate and the tiers).

`SPECS` maps each op's name to its declaration; the gate, `bitfuse verify`,
the benchmarks, the fuzz run and the tests iterate over it.
"""

from . import (
    act_cat,
    conv_epilogue,
    gated_residual,
    head_gate,
    layer_norm_modulate,
    linear_attention,
    modulate,
    projections,
    qk_norm_rope,
    rms_norm_modulate,
    rotary,
)
from .spec import TIERS, OpSpec

SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        modulate.SPEC,
        gated_residual.SPEC,
        gated_residual.F32_SPEC,
        head_gate.SPEC,
        *rms_norm_modulate.SPECS.values(),
        rms_norm_modulate.RMS_NORM_SPEC,
        layer_norm_modulate.SPEC,
        layer_norm_modulate.F32_SPEC,
        layer_norm_modulate.AFFINE_SPEC,
        *rotary.SPECS.values(),
        qk_norm_rope.SPEC,
        *conv_epilogue.SPECS.values(),
        *act_cat.SPECS.values(),
        linear_attention.SPEC,
        projections.SPEC,
    )
}

__all__ = ["SPECS", "TIERS", "OpSpec", "modulate", "gated_residual", "head_gate", "rms_norm_modulate", "layer_norm_modulate",
           "rotary", "qk_norm_rope", "conv_epilogue", "act_cat", "linear_attention", "projections"]
