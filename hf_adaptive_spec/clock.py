"""The clock every timing-driven decision reads (the cost rule's live scale, drafting prices and pauses).

`now()` is `time.perf_counter()` unless a `use_clock` block holds another clock for this context: tests of
timing-driven behaviour run under a fake clock that only advances by fixed costs they inject, so what they
check never follows how fast or busy the machine is.
"""

from __future__ import annotations

import contextlib
import contextvars
import time

__all__ = ["now", "use_clock"]

_CLOCK = contextvars.ContextVar("hf_adaptive_spec_clock", default=time.perf_counter)


def now() -> float:
    """Seconds on the active clock (`time.perf_counter` by default)."""
    return _CLOCK.get()()


@contextlib.contextmanager
def use_clock(clock):
    """Inside the block, `now()` reads `clock()` (a callable returning seconds) in this context."""
    if not callable(clock):
        raise TypeError(f"use_clock takes a callable returning seconds, got {type(clock).__name__}.")
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)
