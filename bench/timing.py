"""Timing helpers shared by the benchmarks.

Device time: the op is captured `calls` times in one CUDA graph, cycling over
several input sets whose total size is several times the L2, so every call
streams from memory, and the graph is replayed many times; the median replay
time over `calls` is the time of one call. This excludes host launch cost
(measured separately by `host_us`) and avoids the artefact of flushing L2 by
writing a buffer before each run (those dirty lines are written back during
the timed kernel). Eager, torch.compile and bitfuse are timed the same way.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

L2_MULTIPLE_BYTES = 256 * 2**20  # input sets cover at least this much: over 4x the H200's 60 MB L2


def sets_for(bytes_per_call: int, cap: int = 48) -> int:
    """How many distinct input sets to cycle through so they don't fit in L2."""
    return max(2, min(cap, math.ceil(L2_MULTIPLE_BYTES / max(bytes_per_call, 1))))


def device_us(calls, per_graph: int | None = None, replays: int = 30) -> float:
    """Median device microseconds of one call. `calls`: one closure per input set."""
    per_graph = per_graph or max(len(calls), 16)
    for c in calls:  # warm-up outside capture: compilation, first-sight verdicts
        c()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times)


def host_us(fn, n: int = 2000, repeats: int = 5) -> float:
    """Median wall-clock microseconds per call of `fn` on tensors small enough that
    the GPU keeps up: the host cost of a call."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(per)


def copy_ceiling_tbps() -> float:
    """Device-to-device copy bandwidth, bytes read plus written: the faster of a
    stream memcpy (`copy_`, timed with events) and an SM copy kernel timed as
    above. (Inside a CUDA graph `copy_` becomes a memcpy node that runs well
    below the SMs' copy rate, so it can't be the graph-timed ceiling.)"""
    n = 2**29  # 1 GiB of bf16 per buffer
    src = [torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]
    kernel_us = device_us([lambda i=i: torch.mul(src[i], 1, out=dst[i]) for i in range(2)], per_graph=8, replays=15)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    memcpy = []
    for i in range(12):
        start.record()
        dst[i % 2].copy_(src[i % 2])
        end.record()
        end.synchronize()
        memcpy.append(start.elapsed_time(end) * 1e3)
    best_us = min(kernel_us, statistics.median(memcpy[2:]))
    return 2 * n * 2 / (best_us * 1e-6) / 1e12
