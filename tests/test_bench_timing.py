"""The benchmark's interleaved timing, on fake timers (no GPU needed)."""

import statistics

import pytest

from bench import report
from bench.report import paired_rounds
from bench.timing import interleaved_samples, interleaved_us, pooled_rounds, rotated, summary


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


def test_samples_per_round_and_the_paired_comparison():
    log = []
    timers = {"a": FakeTimer("a", log, [5, 6, 5, 7, 9, 9]), "b": FakeTimer("b", log, [4, 4, 8, 8, 6, 6])}
    samples = interleaved_samples(timers, rounds=3, replays=2)
    assert samples == {"a": [[5, 6], [5, 7], [9, 9]], "b": [[4, 4], [8, 8], [6, 6]]}
    per_round = {n: [statistics.median(r) for r in v] for n, v in samples.items()}
    assert paired_rounds(per_round["a"], per_round["b"]) == dict(median_diff_us=1.5, rounds=3, rounds_slower=2)


def test_instances_of_a_variant_are_pooled_round_by_round():
    samples = {("a", 0): [[1, 2], [3, 4]], ("a", 1): [[5], [6]], ("b", 0): [[7], [8]]}
    assert pooled_rounds(samples) == {"a": [[1, 2, 5], [3, 4, 6]], "b": [[7], [8]]}


def test_rotation_puts_each_name_first_once_per_cycle():
    names = ["a", "b", "c"]
    assert [rotated(names, r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert rotated([], 3) == []


def test_summary_statistics():
    assert summary([3.0, 1.0, 2.0]) == dict(median=2.0, min=1.0, p90=2.8, n=3)
    assert summary([5.0]) == dict(median=5.0, min=5.0, p90=5.0, n=1)
    assert summary([]) == dict(median=None, min=None, p90=None, n=0)
    ten = summary(range(1, 11))
    assert ten["median"] == 5.5 and ten["p90"] == pytest.approx(9.1)


def test_report_counts_shapes_slower_in_every_round_against_the_control():
    def row(op, variant, us, rounds):
        return dict(op=op, D=2048, S=1024, layout="per-sample", variant=variant, us=us, rounds_us=rounds)

    rows = [row("modulate", "bitfuse lossless", 3.5, [3.5, 3.6, 3.4]),
            row("modulate", "compile+emulate", 3.4, [3.4, 3.5, 3.5]),
            row("gated_residual", "bitfuse lossless", 4.7, [4.7, 4.8, 4.7]),
            row("gated_residual", "compile+emulate", 4.6, [4.6, 4.6, 4.6])]
    (text,) = [line for line in report.against_compile(rows) if line]
    assert "2 shapes, 3 interleaved rounds" in text and "slower by the median at 2 (by at most 0.10 µs)" in text
    assert "slower in every round at 1 (gated_residual 2048×1024 per-sample, +0.10 µs)" in text
    assert "Control" not in text
    # the control: compile + emulate against itself, 0.05 us apart in every round
    rows += [row("modulate", "compile+emulate (control)", 3.45, [3.45, 3.55, 3.55]),
             row("gated_residual", "compile+emulate (control)", 4.6, [4.6, 4.6, 4.6])]
    (text,) = [line for line in report.against_compile(rows) if line]
    assert "Control, compile + emulate captured a second time against itself: slower by the median at 1 " in text
    assert "largest round-by-round gap is 0.05 µs" in text
    assert "by more than that gap at 1 shapes (gated_residual 2048×1024 per-sample)" in text
