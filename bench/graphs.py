"""CUDA graphs against eager, side by side: time and bits.

    python3 bench/graphs.py --variant 2.3 --layers 4 --stg mixed     # full-width LTX-2, one GPU
    python3 bench/graphs.py --width tiny --iters 5                   # anywhere (emulated graphs off the GPU)

`bench_graphs(target, kwargs)` is the library part: it times a forward eagerly and
through a GraphRunner under the same tier and checks that the replay is
`torch.equal` to eager. The command runs it on an accelerated LTX-2 (bitfuse
lossless + graphs, the model's hoist included), with or without a spatio-temporal
guidance mask, and prints the times, the equality and the segments per signature.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from typing import Callable

import torch

import bitfuse
from bitfuse import graphs, policy


def _leaves(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaves(v)]
    return []


def _tree_equal(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb))


def _timer(fn: Callable, iters: int, cuda: bool) -> list[float]:
    """Per-call milliseconds."""
    times = []
    if cuda:
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in times]
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_graphs(
    target,
    kwargs: dict | None = None,
    args: tuple = (),
    *,
    tier: str | None = None,
    iters: int = 20,
    warmup_iters: int = 3,
    compare_eager: bool = True,
    **runner_options,
) -> dict:
    """Time a forward eagerly and through CUDA graphs, and check that the replay is
    `torch.equal` to eager under the same tier.

    target: a module (if `wrap_model_for_graphs` or `accelerate(cuda_graphs=True)`
        wrapped it, its runner is used and eager is the forward under it; else its
        forward is graphed by a runner made here with `runner_options`) or a callable.
    tier: run everything inside `bitfuse.quality(tier)` (None: the mounted tier).
    Returns eager_ms / graph_ms (medians of `iters` calls, each including the input
    copy and output clone), speedup, first_call_s (warmup + capture + first replay),
    equal (replay vs eager), graphed, and the runner's report.
    """
    kwargs = dict(kwargs or {})
    runner = graphs.graph_runner_of(target) if isinstance(target, torch.nn.Module) else None
    owned = runner is None
    if owned:
        runner = graphs.GraphRunner(target.forward if isinstance(target, torch.nn.Module) else target,
                                    **runner_options)
    eager = runner.fn
    cuda = any(t.is_cuda for t in _leaves((args, kwargs)))
    scope = policy.quality(tier) if tier is not None else contextlib.nullcontext()
    result: dict = {"tier": tier or "mounted", "iters": iters}
    with scope, torch.no_grad():
        ref = eager(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = runner(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        result["first_call_s"] = time.perf_counter() - t0
        result["equal"] = _tree_equal(out, ref)
        del out, ref
        if compare_eager:
            for _ in range(warmup_iters):
                eager(*args, **kwargs)
            result["eager_ms"] = statistics.median(_timer(lambda: eager(*args, **kwargs), iters, cuda))
        for _ in range(warmup_iters):
            runner(*args, **kwargs)
        times = _timer(lambda: runner(*args, **kwargs), iters, cuda)
        result["graph_ms"] = statistics.median(times)
        result["graph_min_ms"] = min(times)
    if compare_eager:
        result["speedup"] = result["eager_ms"] / result["graph_ms"] if result["graph_ms"] else float("nan")
    result["report"] = runner.report()
    result["graphed"] = result["report"]["graphs"] > 0
    if owned:
        runner.close()  # free the graphs now, not whenever the runner is collected
    return result


_STG = {  # --stg: (STG blocks, perturbation mask per sample of a batch of 2)
    "off": (None, None),
    "default": ([1], None),  # diffusers' default mask: every sample perturbed
    "mixed": ([1], [0.0, 1.0]),
    "all": ([1], [0.0, 0.0]),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="2.3", choices=("2.0", "2.3"))
    parser.add_argument("--width", default="full", choices=("full", "tiny"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--video", default="4,16,48", help="latent frames,height,width (full width)")
    parser.add_argument("--stg", default="mixed", choices=sorted(_STG))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    a = parser.parse_args(argv)

    from bitfuse.models.ltx2_configs import build_model, full_config, make_inputs, tiny_config

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config = full_config(a.layers, a.variant) if a.width == "full" else tiny_config(a.variant, num_layers=a.layers)
    model = build_model(config, device=device, dtype=dtype, seed=0)
    blocks, mask = _STG[a.stg]
    shape = tuple(int(v) for v in a.video.split(",")) if a.width == "full" else (2, 4, 4)
    kwargs = make_inputs(model, 2, shape, per_token=False, stg_blocks=blocks,
                         perturbation_mask=None if mask is None else torch.tensor(mask))
    options = {} if cuda else {"backend": graphs.EmulatedGraphBackend()}
    with bitfuse.accelerate(model, cuda_graphs=True, **options):
        result = bench_graphs(model, kwargs, iters=a.iters)
    if a.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        rows = result["report"]["signatures"]
        print(f"LTX-{a.variant} {a.width} x{a.layers} stg={a.stg} on {device}{'' if cuda else ' (emulated graphs)'}: "
              f"eager {result['eager_ms']:.2f} ms, graphs {result['graph_ms']:.2f} ms "
              f"(x{result['speedup']:.2f}), equal={result['equal']}, "
              f"segments per signature {[r.get('segments') for r in rows]}")
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
