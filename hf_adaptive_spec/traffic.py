"""Request traffic, shared by the HTTP load tests (`serving.http_load`: `loadtest`, `bench-served`) and the bench's
arrivals replay (`bench.arrivals`: `bench --arrivals`): seeded arrival times, and the percentiles and summaries of
what the requests saw.

Arrival processes (`arrival_times`), both at a mean rate of `rate` requests per second:

- ``poisson``: one request at a time; exponential gaps of mean ``1 / rate``.
- ``bursty``: bursts of requests; exponential gaps of mean ``burst_size / rate`` between burst starts, the
  requests of a burst `burst_gap` seconds apart (0: at one instant).

Where the two users had drawn their traces differently, each behaviour is an option (`ArrivalOptions`), and each
user names its own, so that the traces of its earlier runs come out again:

- ``burst_sizes``: ``"fixed"``: every burst has `burst_size` requests; ``"random"``: a burst's size is uniform
  in ``1 .. 2 * burst_size - 1`` (mean `burst_size`). The last burst is cut to the number of requests.
- ``first_arrival``: ``"at_zero"``: the first request (or burst) at time 0; ``"after_gap"``: after one gap.
- ``seeding``: ``"seed"``: the numbers come from ``random.Random(seed)``; ``"process_and_seed"``: from
  ``random.Random(f"{process}|{seed}")``, so the two processes of one seed draw different numbers.

Percentiles (`percentile`, `summary`): linear interpolation between order statistics, numpy's default
(``numpy.percentile(values, q, method="linear")``, Hyndman and Fan's type 7): the q-th percentile of n sorted
values sits at rank ``(n - 1) * q / 100``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence, Union

__all__ = ["BURST_SIZE", "BURST_SIZES", "FIRST_ARRIVALS", "PERCENTILE_METHOD", "PROCESSES", "SEEDINGS",
           "ArrivalOptions", "arrival_times", "check_arrivals", "percentile", "summary"]

PROCESSES = ("poisson", "bursty")
BURST_SIZES = ("fixed", "random")
FIRST_ARRIVALS = ("at_zero", "after_gap")
SEEDINGS = ("seed", "process_and_seed")
BURST_SIZE = 4  # (mean) requests per burst of a bursty trace
PERCENTILE_METHOD = "linear"  # numpy's name for the percentile definition below


def _one_of(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}.")


@dataclass(frozen=True)
class ArrivalOptions:
    """How a trace is drawn where the users differ (see the module docstring); every field must be given."""

    burst_sizes: str  # "fixed" | "random"
    first_arrival: str  # "at_zero" | "after_gap"
    seeding: str  # "seed" | "process_and_seed"

    def __post_init__(self):
        _one_of("burst_sizes", self.burst_sizes, BURST_SIZES)
        _one_of("first_arrival", self.first_arrival, FIRST_ARRIVALS)
        _one_of("seeding", self.seeding, SEEDINGS)


def check_arrivals(requests: int, rate: float, process: str, burst_size: int = BURST_SIZE,
                   burst_gap: float = 0.0) -> None:
    """Raise `ValueError`, naming the bad value, unless these settings make a trace."""
    _one_of("the arrival process", process, PROCESSES)
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive, finite number of requests per second; got {rate!r}.")
    if requests < 1:
        raise ValueError(f"requests must be >= 1; got {requests!r}.")
    if burst_size < 1:
        raise ValueError(f"burst_size must be >= 1; got {burst_size!r}.")
    if not burst_gap >= 0:
        raise ValueError(f"burst_gap must be >= 0 seconds; got {burst_gap!r}.")


def arrival_times(requests: int, rate: float, process: str, seed: Union[int, str], options: ArrivalOptions,
                  burst_size: int = BURST_SIZE, burst_gap: float = 0.0) -> list:
    """Send times in seconds from the start of `requests` requests, ascending (see the module docstring).

    Args:
        requests: how many (>= 1).
        rate: mean requests per second (> 0).
        process: ``"poisson"`` or ``"bursty"``.
        seed: the trace is a function of the arguments alone.
        options: `ArrivalOptions`: burst sizes, the first arrival, the seeding.
        burst_size: requests per burst (``burst_sizes="random"``: their mean); bursty only.
        burst_gap: seconds between the requests of a burst; bursty only.
    """
    check_arrivals(requests, rate, process, burst_size, burst_gap)
    rng = random.Random(seed if options.seeding == "seed" else f"{process}|{seed}")
    mean_size = 1 if process == "poisson" else burst_size
    times, clock = [], 0.0
    while len(times) < requests:
        if times or options.first_arrival == "after_gap":
            clock += rng.expovariate(rate / mean_size)
        size = _burst_size(rng, process, burst_size, options.burst_sizes)
        times.extend(clock + i * burst_gap for i in range(min(size, requests - len(times))))
    return sorted(times)


def _burst_size(rng: random.Random, process: str, burst_size: int, burst_sizes: str) -> int:
    if process == "poisson":
        return 1
    return burst_size if burst_sizes == "fixed" else rng.randint(1, 2 * burst_size - 1)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0 <= q <= 100) of `values` by linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be a percentage in [0, 100]; got {q!r}.")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float], quantiles: Sequence[int]) -> dict:
    """``{"mean": ..., "p50": ..., ...}``: the mean and the `percentile` of each of `quantiles` (None each for no
    values)."""
    out = {"mean": sum(values) / len(values) if values else None}
    out.update({f"p{q}": percentile(values, q) for q in quantiles})
    return out
