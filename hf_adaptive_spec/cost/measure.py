"""Timed measurement of the verifier's cost curve: chain blocks of each size run against a runner's real cache
(and dropped again), swept several times, the median per size kept."""

from __future__ import annotations

import statistics

import torch

from .. import clock
from .profile import DEFAULT_SIZES, WIDTH_SIZES_MAX, CostProfile

__all__ = ["measure_verifier_cost"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_verifier_cost(runner, sizes=DEFAULT_SIZES, repeats: int = 3) -> CostProfile:
    """Time chain blocks of each size against `runner`'s real cache, then drop them (the cache is unchanged).

    Args:
        runner (`ModelRunner`): the target's runner right after the prefill.
        sizes (sequence of `int`): token counts to measure.
        repeats (`int`): timed sweeps over all sizes (after one warm-up sweep); the median per size is kept.
    """
    batch = runner.slot_valid.shape[0]
    seconds = _time_blocks(runner, list(sizes), repeats, packed=False)
    # kept as measured, not made monotone: on a CPU 16 tokens can really cost less than 12 (GEMM tiling)
    widths = width_seconds = None
    if batch > 1 and runner.lean:  # rows of different sizes run packed: what the width alone costs
        widths = [n for n in sizes if n <= WIDTH_SIZES_MAX]
        width_seconds = _time_blocks(runner, widths, repeats, packed=True)
        width_seconds[0] = seconds[0]  # the same block as T(1)
    return CostProfile(sizes=list(sizes), seconds=seconds, width_sizes=widths, width_seconds=width_seconds)


def _time_blocks(runner, sizes: list, repeats: int, packed: bool) -> list:
    """Median seconds of a chain block of each size against `runner`'s cache (dropped after each forward); with
    `packed`, only each row's first token is real (the block's width alone)."""
    batch = runner.slot_valid.shape[0]
    device = runner.slot_valid.device
    keep_none = torch.zeros(batch, 0, dtype=torch.long, device=device)
    times = {n: [] for n in sizes}
    # sweep the sizes `repeats` times (plus one warm-up sweep) instead of timing each size in a burst: a
    # transient slowdown of a shared machine then hits every size alike instead of inflating one of them
    # (rotated per sweep: the forward right after the largest block runs slow, and must not always be n = 1)
    for sweep in range(repeats + 1):
        shift = sweep % len(sizes)
        for n in sizes[shift:] + sizes[:shift]:
            tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
            parents = (torch.arange(n, device=device) - 1).expand(batch, n)
            valid = torch.ones(batch, n, dtype=torch.bool, device=device)
            if packed:
                valid[:, 1:] = False
            _sync(device)
            start = clock.now()
            runner.forward(tokens, parents, valid)
            _sync(device)
            if sweep:
                times[n].append(clock.now() - start)
            runner.commit(keep_none, keep_none.bool())
    return [statistics.median(times[n]) for n in sizes]
