"""The clock every timing-driven decision reads (the cost rule's live scale, drafting prices and pauses).

`now()` is `time.perf_counter()` unless a `use_clock` block holds another clock: for its own context, or
(`threads=True`) for every thread whose context holds none, such as a serving engine's worker, which does not
inherit the context of the thread that started it. Tests of timing-driven behaviour run under a fake clock
that only advances by fixed costs they inject, so what they check never follows how fast or busy the machine
is.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time

__all__ = ["now", "use_clock"]

_CLOCK = contextvars.ContextVar("hf_adaptive_spec_clock", default=None)
# the clock of contexts that hold none of their own (a `use_clock(..., threads=True)` block), innermost last
_PROCESS: list = []
_PROCESS_LOCK = threading.Lock()


def now() -> float:
    """Seconds on the active clock (`time.perf_counter` by default)."""
    clock = _CLOCK.get()
    if clock is None:
        clock = _PROCESS[-1] if _PROCESS else time.perf_counter
    return clock()


@contextlib.contextmanager
def use_clock(clock, threads: bool = False):
    """Inside the block, `now()` reads `clock()` (a callable returning seconds) in this context; with
    `threads=True` also in every other thread whose context holds no clock of its own."""
    if not callable(clock):
        raise TypeError(f"use_clock takes a callable returning seconds, got {type(clock).__name__}.")
    if not isinstance(threads, bool):
        raise TypeError(f"use_clock(threads=...) takes True or False, got {threads!r}.")
    token = _CLOCK.set(clock)
    if threads:
        with _PROCESS_LOCK:
            _PROCESS.append(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)
        if threads:
            with _PROCESS_LOCK:
                _PROCESS.reverse()
                _PROCESS.remove(clock)  # the innermost entry of this clock
                _PROCESS.reverse()
