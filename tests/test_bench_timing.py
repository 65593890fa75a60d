"""The benchmark's interleaved timing, on fake timers (no GPU needed)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from timing import interleaved_us  # noqa: E402


class FakeTimer:
    def __init__(self, name, log, values):
        self.name, self.log, self.values = name, log, list(values)

    def sample(self, replays):
        self.log.append(self.name)
        return [self.values.pop(0) for _ in range(replays)]


def test_rounds_rotate_the_order_and_every_variant_gets_the_same_samples():
    log = []
    timers = {n: FakeTimer(n, log, range(100 * i, 100 * i + 6)) for i, n in enumerate("abc")}
    medians = interleaved_us(timers, rounds=3, replays=2)
    assert log == list("abc" "bca" "cab")  # each variant first once
    assert medians == {"a": 2.5, "b": 102.5, "c": 202.5}  # median of its own six samples
