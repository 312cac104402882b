"""The shared traffic module: seeded arrival processes and each option of them, and the percentile and summary both
the HTTP load tests and the bench's arrivals replay report. Seeded: the same numbers on every machine."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from hf_adaptive_spec import traffic
from hf_adaptive_spec.bench import arrivals as bench_arrivals
from hf_adaptive_spec.traffic import ArrivalOptions, arrival_times, percentile, summary

FIXED_AT_ZERO = ArrivalOptions(burst_sizes="fixed", first_arrival="at_zero", seeding="seed")
RANDOM_AFTER_GAP = ArrivalOptions(burst_sizes="random", first_arrival="after_gap", seeding="process_and_seed")
EVERY_OPTIONS = [ArrivalOptions(sizes, first, seeding) for sizes in traffic.BURST_SIZES
                 for first in traffic.FIRST_ARRIVALS for seeding in traffic.SEEDINGS]


def _bursts(times: list) -> list:
    """Sizes of the runs of equal times, in order."""
    sizes = [1]
    for before, after in zip(times, times[1:]):
        if after == before:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


@pytest.mark.parametrize("options", EVERY_OPTIONS)
@pytest.mark.parametrize("process", traffic.PROCESSES)
def test_traces_are_seeded_ascending_and_keep_the_mean_rate(process, options):
    trace = arrival_times(4000, 2.0, process, 7, options)
    assert trace == arrival_times(4000, 2.0, process, 7, options)
    assert trace != arrival_times(4000, 2.0, process, 8, options)
    assert len(trace) == 4000 and trace == sorted(trace)
    assert (trace[0] == 0.0) == (options.first_arrival == "at_zero")
    assert len(trace) / trace[-1] == pytest.approx(2.0, rel=0.1)


def test_poisson_gaps_are_exponential():
    trace = arrival_times(20_000, 4.0, "poisson", 3, FIXED_AT_ZERO)
    gaps = [b - a for a, b in zip(trace, trace[1:])]
    assert len(set(trace)) == len(trace)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean


def test_fixed_bursts_have_burst_size_requests_burst_gap_apart():
    trace = arrival_times(41, 2.0, "bursty", 0, FIXED_AT_ZERO, burst_size=4, burst_gap=0.01)
    bursts = [trace[i:i + 4] for i in range(0, 41, 4)]
    for burst in bursts[:-1]:
        assert [t - burst[0] for t in burst] == pytest.approx([0.0, 0.01, 0.02, 0.03])
    assert len(bursts[-1]) == 1  # the last burst is cut to the requests asked for
    together = arrival_times(4001, 2.0, "bursty", 0, FIXED_AT_ZERO, burst_size=4)
    assert _bursts(together) == [4] * 1000 + [1]
    starts = together[::4]
    assert statistics.mean(b - a for a, b in zip(starts, starts[1:])) == pytest.approx(2.0, rel=0.05)


def test_random_bursts_are_uniform_around_burst_size():
    sizes = _bursts(arrival_times(8000, 2.0, "bursty", 1, RANDOM_AFTER_GAP, burst_size=4))
    assert set(sizes[:-1]) == set(range(1, 8))  # uniform in 1 .. 2 * 4 - 1
    assert statistics.mean(sizes[:-1]) == pytest.approx(4.0, rel=0.05)
    assert max(_bursts(arrival_times(50, 2.0, "bursty", 1, FIXED_AT_ZERO, burst_size=1))) == 1


def test_first_arrival_and_seeding_options():
    at_zero = ArrivalOptions("fixed", "at_zero", "seed")
    after_gap = ArrivalOptions("fixed", "after_gap", "seed")
    # the same numbers, one gap earlier: the first gap of a trace from time 0 is the second arrival
    zero, gap = arrival_times(10, 1.0, "poisson", 2, at_zero), arrival_times(10, 1.0, "poisson", 2, after_gap)
    assert zero[0] == 0.0 and gap[0] > 0 and gap[:9] == zero[1:]
    keyed = ArrivalOptions("fixed", "at_zero", "process_and_seed")
    assert arrival_times(10, 1.0, "poisson", "poisson|2", at_zero) == arrival_times(10, 1.0, "poisson", 2, keyed)
    poisson, bursty = (arrival_times(10, 1.0, kind, 2, at_zero, burst_size=1) for kind in traffic.PROCESSES)
    assert poisson == bursty  # bursts of one are Poisson arrivals: the seed alone picks the numbers
    poisson, bursty = (arrival_times(10, 1.0, kind, 2, keyed, burst_size=1) for kind in traffic.PROCESSES)
    assert poisson != bursty  # keyed by the process too


@pytest.mark.parametrize("kind", traffic.PROCESSES)
def test_the_bench_and_the_load_generator_draw_from_the_shared_generator(kind):
    """Each user is `traffic.arrival_times` with its own options, and no other code."""
    http_load = pytest.importorskip("hf_adaptive_spec.serving.http_load")
    assert bench_arrivals.make_arrivals(kind, 2.0, 40, seed=3) == arrival_times(
        40, 2.0, kind, 3, bench_arrivals.ARRIVAL_OPTIONS)
    assert http_load.arrival_times(40, 2.0, kind, 3) == arrival_times(40, 2.0, kind, 3, http_load.ARRIVAL_OPTIONS)
    assert bench_arrivals.ARRIVAL_OPTIONS == RANDOM_AFTER_GAP and http_load.ARRIVAL_OPTIONS == FIXED_AT_ZERO
    shared = ArrivalOptions("random", "after_gap", "process_and_seed")
    assert http_load.arrival_times(40, 2.0, kind, 3) != arrival_times(40, 2.0, kind, 3, shared)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="arrival process must be one of poisson, bursty; got 'uniform'"):
        arrival_times(3, 1.0, "uniform", 0, FIXED_AT_ZERO)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"rate must be a positive, finite number .*got {bad!r}"):
            arrival_times(3, bad, "poisson", 0, FIXED_AT_ZERO)
    with pytest.raises(ValueError, match="requests must be >= 1; got 0"):
        arrival_times(0, 1.0, "poisson", 0, FIXED_AT_ZERO)
    with pytest.raises(ValueError, match="burst_size must be >= 1; got 0"):
        arrival_times(3, 1.0, "bursty", 0, FIXED_AT_ZERO, burst_size=0)
    with pytest.raises(ValueError, match="burst_gap must be >= 0 seconds; got -0.5"):
        arrival_times(3, 1.0, "bursty", 0, FIXED_AT_ZERO, burst_gap=-0.5)
    with pytest.raises(ValueError, match="burst_sizes must be one of fixed, random; got 'even'"):
        ArrivalOptions("even", "at_zero", "seed")
    with pytest.raises(ValueError, match="first_arrival must be one of at_zero, after_gap; got 'late'"):
        ArrivalOptions("fixed", "late", "seed")
    with pytest.raises(ValueError, match="seeding must be one of seed, process_and_seed; got 'time'"):
        ArrivalOptions("fixed", "at_zero", "time")


def test_percentile_is_numpys_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0 and percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)  # rank 0.9 * 4 = 3.6: 4 + 0.6 * (5 - 4)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        sample = rng.exponential(size=n).tolist()
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(sample, q) == pytest.approx(np.percentile(sample, q, method=traffic.PERCENTILE_METHOD))
    for bad in (-1, 100.5):
        with pytest.raises(ValueError, match=f"q must be a percentage in \\[0, 100\\]; got {bad}"):
            percentile(values, bad)


def test_summary():
    assert summary([4.0, 1.0, 3.0, 2.0, 5.0], (50, 90)) == pytest.approx({"mean": 3.0, "p50": 3.0, "p90": 4.6})
    assert summary([], (50, 99)) == {"mean": None, "p50": None, "p99": None}
