"""Timing helpers shared by the benchmarks.

Device time: the op is captured `calls` times in one CUDA graph, cycling over
several input sets whose total size is several times the L2, so every call
streams from memory, and the graph is replayed many times; the median replay
time over `calls` is the time of one call. This excludes host launch cost
(measured separately by `host_us`) and avoids the artefact of flushing L2 by
writing a buffer before each run (those dirty lines are written back during
the timed kernel). Eager, torch.compile and bitfuse are timed the same way, in interleaved
rounds (`interleaved_us`): every variant once a round, the order rotated each round
(`rotated`), so a drift of clocks or temperature during a run favours none.
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


class GraphTimer:
    """`calls` (one closure per input set) captured once, `per_graph` calls in one
    CUDA graph; `sample(replays)` replays it and returns microseconds per call, one
    value a replay. Several timers can be alive at once, so variants can be timed
    in interleaved rounds (a drift of clocks or temperature during a run then
    does not favour whichever variant runs first)."""

    def __init__(self, calls, per_graph: int | None = None):
        self.per_graph = per_graph or max(len(calls), 16)
        for c in calls:  # warm-up outside capture: compilation, first-sight verdicts
            c()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for i in range(self.per_graph):
                calls[i % len(calls)]()
        self.graph.replay()
        torch.cuda.synchronize()

    def sample(self, replays: int) -> list[float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(replays):
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.per_graph)
        return times

    def close(self):
        self.graph = None
        torch.cuda.empty_cache()


def device_us(calls, per_graph: int | None = None, replays: int = 30) -> float:
    """Median device microseconds of one call. `calls`: one closure per input set."""
    timer = GraphTimer(calls, per_graph)
    try:
        return statistics.median(timer.sample(replays))
    finally:
        timer.close()


def interleaved_us(timers: dict, rounds: int = 6, replays: int = 5) -> dict:
    """Median microseconds per call of each named GraphTimer, sampled in `rounds`
    rounds of `replays` replays each, the order rotated every round."""
    return {n: statistics.median(v for r in per_round for v in r)
            for n, per_round in interleaved_samples(timers, rounds, replays).items()}


def rotated(names: list, r: int) -> list:
    """`names` in round `r`'s order: rotated left by r, so each is first once every
    len(names) rounds."""
    k = r % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def interleaved_samples(timers: dict, rounds: int = 6, replays: int = 5) -> dict:
    """{name: [the `replays` samples of round 0, of round 1, ...]}: every variant
    sampled once a round, the order rotated every round, so two variants can be
    compared round by round (bench/report.py's `paired_rounds`)."""
    names = list(timers)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in rotated(names, r):
            samples[n].append(timers[n].sample(replays))
    return samples


def summary(values) -> dict:
    """median, min and p90 (linear interpolation) of a list of samples, and n."""
    values = sorted(values)
    if not values:
        return dict(median=None, min=None, p90=None, n=0)
    p90 = statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]
    return dict(median=statistics.median(values), min=values[0], p90=p90, n=len(values))


def pooled_rounds(samples: dict) -> dict:
    """{variant: [one list of samples a round]} from `interleaved_samples` over timers
    named (variant, instance): each round's samples of a variant's instances pooled.

    Several instances of a variant (separate captures, so separate output buffers)
    average out where its buffers happen to lie: on the H200 two captures of the
    same compiled function differed by up to 0.4 us (0.4%) in every round of a run."""
    pooled = {}
    for (variant, _), per_round in samples.items():
        rounds = pooled.setdefault(variant, [[] for _ in per_round])
        for r, values in enumerate(per_round):
            rounds[r].extend(values)
    return pooled


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
