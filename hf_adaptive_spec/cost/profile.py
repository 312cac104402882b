"""The verifier's cost profile: T(n), seconds of one target forward over n new tokens, and the prior curve
assumed before anything is measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

__all__ = ["DEFAULT_SIZES", "WIDTH_SIZES_MAX", "CostProfile", "between", "prior_profile"]

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
WIDTH_SIZES_MAX = 16  # widths measured for packed blocks (beyond: the last slope)


def between(table, low, frac):
    """The value `frac` of the way from `table[low]` to `table[low + 1]`: linear interpolation in a list of
    floats (`low` an int), or in a tensor at a tensor of indices `low` with matching fractions `frac`."""
    return table[low] + frac * (table[low + 1] - table[low])


@dataclass
class CostProfile:
    """T(n) of one verification forward over n new tokens, measured at `sizes` (ascending, starting at 1).

    Fields:
        sizes: the token counts measured.
        seconds: median seconds of a forward at each size.
        key: what the profile is valid for (model, dtype, device, batch size, threads).
        source: "measured" (timed sweeps, `measure_verifier_cost`), "prior" (`prior_profile`: a typical shape,
            nothing measured yet) or "rounds" (corrected from the verification forwards of real rounds).
        width_sizes, width_seconds: for a batch whose forward packs its real tokens (`lean.LeanForward`), the
            time of a block of width W in which each row has only its first token (what the width alone costs:
            attention and the cache over the padded block); None when not measured.
    """

    sizes: list
    seconds: list
    key: str = ""
    source: str = "measured"
    width_sizes: list | None = None
    width_seconds: list | None = None

    def __post_init__(self):
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"CostProfile.sizes must be ascending distinct ints >= 1, got {self.sizes}.")
        if len(self.sizes) != len(self.seconds) or any(s <= 0 for s in self.seconds):
            raise ValueError("CostProfile needs one positive time per size.")
        if (self.width_sizes is None) != (self.width_seconds is None):
            raise ValueError("CostProfile.width_sizes and width_seconds go together.")
        if self.width_sizes is not None:
            widths = list(self.width_sizes)
            if not widths or widths != sorted(set(widths)) or widths[0] != 1 or len(widths) != len(self.width_seconds) \
                    or any(s <= 0 for s in self.width_seconds):
                raise ValueError(f"CostProfile.width_sizes must be ascending distinct ints from 1 with one positive "
                                 f"time each, got {self.width_sizes} / {self.width_seconds}.")
        if self.source not in ("measured", "prior", "rounds"):
            raise ValueError(f"CostProfile.source must be 'measured', 'prior' or 'rounds', got {self.source!r}.")

    def time(self, n: int) -> float:
        """T(n), linear between measured sizes, extended by the last slope beyond the largest."""
        sizes, seconds = self.sizes, self.seconds
        if n <= sizes[0]:
            return seconds[0] * max(n, 0) / sizes[0] if n < sizes[0] else seconds[0]
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                frac = (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
                return between(seconds, i - 1, frac)
        if len(sizes) == 1:
            return seconds[0] * n / sizes[0]
        slope = max((seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]), 0.0)
        return seconds[-1] + slope * (n - sizes[-1])

    def times(self, count: int) -> list:
        """`[T(0), ..., T(count - 1)]` (made once per curve and count: a call's cost model reads the same one)."""
        return list(_times(tuple(self.sizes), tuple(self.seconds), count))

    def width_profile(self) -> "CostProfile | None":
        """The width curve as a profile of its own (None: not measured)."""
        if self.width_sizes is None:
            return None
        return CostProfile(list(self.width_sizes), list(self.width_seconds))

    def table(self, max_tokens: int, device=None) -> torch.Tensor:
        """`(max_tokens + 1,)` float tensor: entry n is T(n) (T(0) = 0)."""
        return torch.tensor([self.time(n) for n in range(max_tokens + 1)], dtype=torch.float32, device=device)

    def to_dict(self) -> dict:
        return asdict(self)


# the shape of T(n) / T(1) assumed before anything is measured: on a CPU each extra verified token costs a
# few percent of a step (small-batch kernel; docs/benchmarks.md), on a GPU at low load almost nothing
_PRIOR_SLOPE = {"cpu": 0.05}
_PRIOR_SLOPE_ACCELERATOR = 0.005

def prior_profile(device, key: str = "") -> CostProfile:
    """A typical cost curve for `device`'s type, in units of one forward's time (its level is learned from the
    first round: `CostModel` rescales a prior profile to the first measured forward)."""
    slope = _PRIOR_SLOPE.get(torch.device(device).type, _PRIOR_SLOPE_ACCELERATOR)
    return CostProfile(sizes=list(DEFAULT_SIZES), seconds=[1.0 + slope * (n - 1) for n in DEFAULT_SIZES], key=key,
                       source="prior")


@lru_cache(maxsize=64)
def _times(sizes: tuple, seconds: tuple, count: int) -> tuple:
    profile = CostProfile(list(sizes), list(seconds))
    return tuple(profile.time(n) for n in range(count))
