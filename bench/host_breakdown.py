"""Where the host time of one modulate_site call goes (tiny tensors, GPU idle).

    python3 bench/host_breakdown.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bitfuse.ops.modulate  # noqa: E402,F401
from bitfuse import sites  # noqa: E402
from timing import host_us  # noqa: E402

M = sys.modules["bitfuse.ops.modulate"]


def main():
    x = torch.randn(1, 8, 64, device="cuda", dtype=torch.bfloat16)
    c, h = torch.randn(1, 1, 2, 64, device="cuda", dtype=torch.bfloat16).unbind(2)
    plan = M.plan_modulate(x, c, h)
    out = torch.empty_like(x)
    M.launch_modulate(plan, out=out)
    M.launch_modulate(plan, out=out)
    fl = M._launch
    print("direct launch active:", fl.direct, "cached kernels:", len(fl.compiled))
    (key, k), = list(fl.compiled.items())[:1]
    args = (x, c, h, out, *key[1], *key[3])
    stream = torch._C._cuda_getCurrentRawStream(0)
    from triton import knobs
    rows = {
        "torch.empty": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "x.new_empty": lambda: x.new_empty(x.shape),
        "torch.empty_like": lambda: torch.empty_like(x),
        "x.shape + x.stride()": lambda: (x.shape, x.stride()),
        "x.data_ptr()": lambda: x.data_ptr(),
        "is_compiling": lambda: torch.compiler.is_compiling(),
        "plan_modulate (guard)": lambda: M.plan_modulate(x, c, h),
        "k.run only": lambda: k.run(key[2][0], key[2][1], 1, stream, k.function, k.packed_metadata, None,
                                    knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args),
        "launch_modulate(out=...)": lambda: M.launch_modulate(plan, out=out),
        "launch_modulate": lambda: M.launch_modulate(plan),
        "triton JIT launch": lambda: M._modulate_kernel[key[2]](x, c, h, out, *key[1], **dict(
            zip(("SCALE_PER_ROW", "SHIFT_PER_ROW", "BLOCK_R", "BLOCK_D"), key[3])), num_warps=key[4][0],
            enable_fp_fusion=False),
        "modulate_site": lambda: sites.modulate_site(x, c, h),
        "eager x*(1+c)+h": lambda: x * (1 + c) + h,
        "one aten add": lambda: x + h,
    }
    for name, fn in rows.items():
        print(f"{name:28s} {host_us(fn, n=1000, repeats=3):7.2f} us")
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        sites.modulate_site(x, c, h)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
