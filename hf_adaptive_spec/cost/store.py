"""Where cost profiles are kept: in memory, on disk under their key (`$HF_ADAPTIVE_SPEC_CACHE/_verifier_cost/`,
or `$HF_ADAPTIVE_SPEC_COST_CACHE`), measured when asked (`measure_cost_curve`,
`HF_ADAPTIVE_SPEC_COST_REFRESH=1`) and corrected by the times of real rounds (`refine_profile`)."""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import statistics
import threading
from pathlib import Path

import torch

from ..adapters.compat import text_config
from ..ops import cpu_linear, scoped
from .measure import measure_verifier_cost
from .profile import DEFAULT_SIZES, CostProfile, prior_profile

__all__ = ["measure_cost_curve", "refine_profile", "verifier_cost_profile"]

_MEMORY: dict[str, "CostProfile"] = {}


def _profile_key(model, batch_size: int, lean: bool = False) -> str:
    device = model.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    config = text_config(model)
    shape = f"{config.hidden_size}x{config.num_hidden_layers}"
    attn = getattr(model.config, "_attn_implementation", "")
    kernels = "|cpu-small-linear" if cpu_linear.active() else ""  # another cost curve
    kernels += "|lean" if lean else ""  # so is the lean forward's (less Python per forward)
    kernels += "|append"  # rounds append to the cache in place (`runner.InPlaceAppend`): not the cat's curve
    return (f"{type(model).__name__}|{name}|{shape}|{model.dtype}|{device_name}|{attn}|batch{batch_size}|"
            f"threads{torch.get_num_threads()}{kernels}")


def _cost_dir() -> Path:
    """`$HF_ADAPTIVE_SPEC_COST_CACHE` if set, else `_verifier_cost/` in the model cache."""
    if os.environ.get("HF_ADAPTIVE_SPEC_COST_CACHE"):
        return Path(os.environ["HF_ADAPTIVE_SPEC_COST_CACHE"]).expanduser()
    from ..locations import default_cache_root

    return default_cache_root() / "_verifier_cost"


def _profile_path(key: str) -> Path:
    return _cost_dir() / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _store(profile: CostProfile, use_disk: bool = True) -> None:
    """Keep `profile` in memory and (atomically) on disk under its key."""
    _MEMORY[profile.key] = profile
    if not use_disk:
        return
    path = _profile_path(profile.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer: threads too
        tmp.write_text(json.dumps(profile.to_dict()))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache folder only costs a re-measure next time


_MEASURE: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_adaptive_spec_measure_cost", default=False)


def measure_cost_curve(on: bool = True):
    """Inside a `with` block, a cost-aware call with no stored curve measures the full curve (timed sweeps, tens
    of seconds for a 1.5B target on 2 CPU cores) instead of starting from `prior_profile`. `hf_adaptive_spec.
    prepare` uses it; a user's call never measures unless asked."""
    return scoped(_MEASURE, bool(on))


def verifier_cost_profile(runner, sizes=DEFAULT_SIZES, repeats: int = 3, use_disk: bool = True,
                          measure: bool | None = None) -> CostProfile:
    """The target's cost profile, from memory, else from disk; when there is none, measured now (and stored) if
    `measure`, else `prior_profile`, which the rounds then correct (`refine_profile`).

    `measure` defaults to True inside `measure_cost_curve` (`hf_adaptive_spec.prepare`), where only a measured
    profile is taken from memory or disk, and on an accelerator, where the sweeps take a fraction of a second.
    Set `HF_ADAPTIVE_SPEC_COST_REFRESH=1` to measure again.
    """
    key = _profile_key(runner.model, runner.slot_valid.shape[0], runner.lean)
    device = runner.slot_valid.device
    asked = _MEASURE.get() or os.environ.get("HF_ADAPTIVE_SPEC_COST_REFRESH") == "1"
    if measure is None:
        measure = asked or device.type != "cpu"
    usable = ("measured",) if asked else ("measured", "rounds", "prior")
    if os.environ.get("HF_ADAPTIVE_SPEC_COST_REFRESH") != "1":
        profile = _MEMORY.get(key)
        if profile is not None and profile.source in usable and not (measure and profile.source == "prior"):
            return profile
        path = _profile_path(key)
        if use_disk and path.exists():
            try:
                data = json.loads(path.read_text())
                profile = CostProfile(**data) if data.get("key") == key else None
            except (OSError, ValueError, TypeError):
                profile = None
            if profile is not None and profile.source in usable:
                _MEMORY[key] = profile
                return profile
    if measure:
        profile = measure_verifier_cost(runner, sizes, repeats)
        profile.key = key
        _store(profile, use_disk)
        return profile
    profile = prior_profile(device, key)  # kept in memory only, until rounds have measured it
    _MEMORY[key] = profile
    return profile


# a profile is corrected once rounds measured at least this many verification forwards, when their times
# disagree with it by more than the tolerance (overall, or at one size seen at least `_MIN_PER_SIZE` times)
_MIN_OBSERVED = 8
_MIN_PER_SIZE = 3
_TOLERANCE = 0.25


def refine_profile(profile: CostProfile, observed: dict, use_disk: bool = True) -> CostProfile:
    """`profile` corrected by verification times measured in rounds, stored in its place; or `profile` itself.

    A profile is measured once per machine and kept on disk: measured while the machine was busy, it
    overprices every node for good. Rounds time their verification forward anyway, so: with `observed`
    `{n: [seconds, ...]}` (forwards over n new tokens), the median ratio of measured to profiled time rescales
    the whole curve, and each size seen `_MIN_PER_SIZE` times takes its own median. Nothing changes while the
    rounds agree with the profile within `_TOLERANCE`.
    """
    count = sum(len(times) for times in observed.values())
    if count < _MIN_OBSERVED:
        return profile
    prior = profile.source == "prior"  # a guessed shape: replaced by what was measured, however close
    ratios = [seconds / profile.time(n) for n, times in observed.items() for seconds in times]
    ratio = statistics.median(ratios)
    medians = {n: statistics.median(times) for n, times in observed.items() if len(times) >= _MIN_PER_SIZE}

    def off(measured, expected):
        return abs(measured / expected - 1.0) > _TOLERANCE

    if not prior and not off(ratio, 1.0) and not any(off(seconds, profile.time(n)) for n, seconds in medians.items()):
        return profile
    points = {n: seconds * ratio for n, seconds in zip(profile.sizes, profile.seconds)}
    points.update(medians)
    sizes = sorted(points)
    width_seconds = None if profile.width_seconds is None else [seconds * ratio for seconds in profile.width_seconds]
    if width_seconds is not None:
        width_seconds[0] = points[1] if 1 in points else width_seconds[0]
    refined = CostProfile(sizes=sizes, seconds=[points[n] for n in sizes], key=profile.key, source="rounds",
                          width_sizes=profile.width_sizes, width_seconds=width_seconds)
    if profile.key:
        _store(refined, use_disk)
    return refined
