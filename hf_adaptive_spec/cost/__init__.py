"""Verifier cost profile and the marginal-cost criterion (Uni-LaSpec, PAPERS.md section 2).

On a GPU at low load, verifying 16 tokens costs about what verifying 1 does;
on a 2-core CPU with torch's linear the cost jumps once the forward leaves the
small-matrix GEMM path (about 4 tokens) and then grows (with the small-batch
kernel of `ops.cpu_linear` it grows gently up to 24). A tree that is right on one device is
wrong on the other, so the size of what gets verified is chosen from a
MEASURED cost curve:

* `CostProfile`: T(n), seconds of one target forward over n new tokens
  (batch, dtype and device fixed), measured once on the real cache and kept
  in memory and on disk (`$HF_ADAPTIVE_SPEC_CACHE/_verifier_cost/`).
* `AcceptanceCalibrator`: maps the drafter's probability of a node to the
  chance the target accepts it given its parent was accepted, learned online
  from every verified node (the tree forward gives the target's choice after
  each node, on or off the accepted path).
* `choose_prefix`: the paper's rule "add nodes in decreasing survival
  probability pi_i while pi_i * t_token >= dT(n)", taken globally: with
  S(n) the summed pi of the n best nodes it keeps the n maximising
  S(n) - T(n + 1) / t_token over the batch. That is what the marginal rule
  aims at (long-run tokens per second, Dinkelbach form with t_token the
  current seconds per generated token); unlike the greedy local rule it does
  not stop at the first step of a non-convex curve (the CPU's jump at 4
  tokens followed by a flat stretch).
"""

from __future__ import annotations

import hashlib
import json
import os
import contextvars
import statistics
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import clock
from ..ops import cpu_linear, scoped
from ..ops.host import float32
from ..strategies.base import descending_rank

__all__ = ["AcceptanceCalibrator", "Calibration", "CostModel", "CostProfile", "DraftPricing", "LookupCalibrator",
           "choose_nodes", "choose_prefix",
           "measure_cost_curve", "measure_verifier_cost", "prior_profile", "refine_profile", "SpecCalibration",
           "verifier_cost_profile"]

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
WIDTH_SIZES_MAX = 16  # widths measured for packed blocks (beyond: the last slope)
_MEMORY: dict[str, "CostProfile"] = {}


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
                return seconds[i - 1] + frac * (seconds[i] - seconds[i - 1])
        if len(sizes) == 1:
            return seconds[0] * n / sizes[0]
        slope = max((seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]), 0.0)
        return seconds[-1] + slope * (n - sizes[-1])

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


def _profile_key(model, batch_size: int, lean: bool = False) -> str:
    device = model.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    config = model.config.get_text_config()
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
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(profile.to_dict()))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache folder only costs a re-measure next time


# the shape of T(n) / T(1) assumed before anything is measured: on a CPU each extra verified token costs a
# few percent of a step (small-batch kernel; docs/benchmarks.md), on a GPU at low load almost nothing
_PRIOR_SLOPE = {"cpu": 0.05}
_PRIOR_SLOPE_ACCELERATOR = 0.005
_MEASURE: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_adaptive_spec_measure_cost", default=False)


def prior_profile(device, key: str = "") -> CostProfile:
    """A typical cost curve for `device`'s type, in units of one forward's time (its level is learned from the
    first round: `CostModel` rescales a prior profile to the first measured forward)."""
    slope = _PRIOR_SLOPE.get(torch.device(device).type, _PRIOR_SLOPE_ACCELERATOR)
    return CostProfile(sizes=list(DEFAULT_SIZES), seconds=[1.0 + slope * (n - 1) for n in DEFAULT_SIZES], key=key,
                       source="prior")


ENV_COST_PROFILE = "HF_ADAPTIVE_SPEC_COST_PROFILE"


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


class AcceptanceCalibrator:
    """P(target accepts a node | its parent was accepted) as a function of the drafter's node probability.

    Binned over [0, 1] with a prior that trusts the drafter's probability (`prior_weight` pseudo-counts at the
    bin centre), updated from every verified node.
    """

    def __init__(self, num_bins: int = 20, prior_weight: float = 2.0, device=None):
        self.num_bins = num_bins
        centres = (torch.arange(num_bins, device=device, dtype=torch.float32) + 0.5) / num_bins
        self.accepted = centres * prior_weight
        self.total = torch.full((num_bins,), prior_weight, device=device)

    def _bin(self, probs: torch.Tensor) -> torch.Tensor:
        return (probs.float() * self.num_bins).long().clamp(0, self.num_bins - 1)

    def __call__(self, probs: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance for drafter probabilities of any shape."""
        return (self.accepted / self.total)[self._bin(probs)]

    def observe(self, tree, target_choice: torch.Tensor, verified: tuple | None = None) -> None:
        """Learn from one verified tree: node i was right iff its token is the target's choice after its parent
        (nodes on the context-lookup chain are left to `LookupCalibrator`). `verified`: `verified_nodes(tree,
        target_choice)` if already computed."""
        nodes, right = verified if verified is not None else verified_nodes(tree, target_choice)
        if tree.lookup is not None:
            nodes = nodes & (tree.lookup == 0)
        bins = self._bin(tree.probs)[nodes]
        self.total.index_add_(0, bins, torch.ones_like(bins, dtype=torch.float32))
        self.accepted.index_add_(0, bins, right[nodes].float())


class LookupCalibrator:
    """P(target accepts a lookup node | its parent was accepted), per lookup code (its source and class: the
    context's suffix length, `lookup.lookup_code`, or a datastore node's support, `lookup.store_code`) and per
    whether the drafter proposed the same node (agreement).

    Starts at `prior` with `prior_weight` pseudo-counts, updated from every verified lookup node.
    """

    def __init__(self, max_match: int = 31, prior: float = 0.5, prior_weight: float = 2.0, device=None):
        self.max_match = max_match
        self.accepted = torch.full((2, max_match + 1), prior * prior_weight, device=device)
        self.total = torch.full((2, max_match + 1), prior_weight, device=device)

    def _index(self, match: torch.Tensor, agreed: torch.Tensor) -> torch.Tensor:
        return agreed.long() * (self.max_match + 1) + match.clamp(0, self.max_match)

    def __call__(self, match: torch.Tensor, agreed: torch.Tensor) -> torch.Tensor:
        return (self.accepted / self.total).flatten()[self._index(match, agreed)]

    def observe(self, tree, target_choice: torch.Tensor, verified: tuple | None = None) -> None:
        """Learn from the lookup-chain nodes of one verified tree (`verified` as in `AcceptanceCalibrator`)."""
        if tree.lookup is None:
            return
        nodes, right = verified if verified is not None else verified_nodes(tree, target_choice)
        nodes = nodes & (tree.lookup > 0)
        index = self._index(tree.lookup, tree.probs > 0)[nodes]
        self.total.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.float32))
        self.accepted.view(-1).index_add_(0, index, right[nodes].float())


def verified_nodes(tree, target_choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(nodes, right)` `(B, N)`: the real draft nodes of a verified tree, and which of them carry the target's
    choice after their parent."""
    nodes = tree.valid.clone()
    nodes[:, 0] = False
    parent_choice = target_choice.gather(1, tree.parents.clamp_min(0))
    return nodes, (tree.tokens == parent_choice) & nodes


def survival(tree, accept: torch.Tensor) -> torch.Tensor:
    """`(B, N)` pi_i: product of the per-node acceptance `accept` `(B, N)` along each node's path (root = 1),
    multiplied level by level (each node: its parent's pi times its own acceptance, in float32)."""
    accept = torch.where(tree.valid, accept.float(), 0.0)
    pi = accept.clone()
    pi[:, 0] = 1.0
    parents = tree.parents.clamp_min(0)
    for level in range(1, tree.num_levels + 1):  # parents are final once their level is done
        pi = torch.where(tree.valid & (tree.depths == level), pi.gather(1, parents) * accept, pi)
    return pi


def choose_prefix(pi: torch.Tensor, cost_table: torch.Tensor, seconds_per_token) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes to verify: the best count n of highest-pi nodes per row, shared by the batch.

    Args:
        pi (`torch.FloatTensor` of shape `(B, N)`): survival probability of each node (root first, pi = 1;
            padding 0). Along any path pi never grows, so the top-n set is closed under ancestors.
        cost_table (`torch.Tensor` of shape `(M,)`): T(m) for m = 0 .. M - 1 tokens in one forward.
        seconds_per_token (`float` or 0-d tensor): t_token, the current cost of one generated token.

    Gains and costs are summed and compared in float64 (`choose_prefix_host` does the same in Python).

    Returns:
        `(keep, n)`: `keep` `(B, N)` bool (root always kept) and n (0-d tensor, no host sync), the number of
        draft nodes kept per row.
    """
    batch, num_nodes = pi.shape
    draft = pi[:, 1:]
    gain = draft.sort(dim=-1, descending=True).values.double().sum(0).cumsum(0)  # (N - 1,) summed pi of the n best
    gain = torch.cat([gain.new_zeros(1), gain])  # n = 0 .. N - 1
    sizes = torch.arange(1, num_nodes + 1, device=pi.device).clamp_max(cost_table.shape[0] - 1)
    seconds_per_token = torch.as_tensor(seconds_per_token, device=pi.device).double()
    value = gain - cost_table.to(pi.device, torch.float64)[sizes] / seconds_per_token.clamp_min(1e-9)
    n = value.argmax()
    kept = (descending_rank(draft) < n) & (draft > 0)
    return torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=pi.device), kept], dim=1), n


def choose_nodes(pi: torch.Tensor, cost_table: torch.Tensor, width_table: torch.Tensor,
                 seconds_per_token) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes to verify when the forward runs each row's real tokens only (a packed block): per row.

    A packed block over B rows costs what its real tokens cost plus what its width costs (attention and the
    cache run over the padded block). The chain curve T(n) holds both, at x = n tokens per row and width n; the
    width curve T_w(W) (one real token per row) holds the width's share: A(W) = T_w(W) - T_w(1). So with m the
    draft nodes over all rows, x = 1 + m / B and W the widest row's tokens, C(m, W) = T(x) - A(x) + A(W)
    (T(n) again for a full block, W = x = n). A node is worth its own marginal cost, not B times it: the nodes of
    all rows are taken in one descending order of survival probability pi, and the count m that maximises
    S(m) - C(m, W(m)) / t_token is kept. An easy row then verifies a deep chain or a tree while a hard row of
    the same batch verifies its root alone.

    Args:
        pi (`torch.FloatTensor` of shape `(B, N)`): survival probability of each node (root first; padding 0).
            Along a path pi never grows and ties are taken in index order, so the kept set of each row is
            closed under ancestors.
        cost_table (`torch.Tensor` of shape `(M,)`): T(n) for n = 0 .. M - 1 tokens per row (a chain block).
        width_table (`torch.Tensor` of shape `(M,)`): T_w(W) for W = 0 .. M - 1, one real token per row.
        seconds_per_token (`float` or 0-d tensor): t_token.

    Returns:
        `(keep, counts)`: `keep` `(B, N)` bool (roots kept) and `counts` `(B,)` the draft nodes kept per row.
    """
    batch, num_nodes = pi.shape
    device = pi.device
    draft = pi[:, 1:]
    flat = draft.reshape(-1)
    order = flat.argsort(descending=True, stable=True)  # ties: row-major index order, parents first
    gain = torch.cat([flat.new_zeros(1, dtype=torch.float64), flat[order].double().cumsum(0)])  # m = 0 .. B(N-1)
    row_rank = descending_rank(draft).reshape(-1)[order]  # the node's place in its own row's order
    width = torch.cat([row_rank.new_zeros(1), (row_rank + 1).cummax(0).values]) + 1  # W(m): root + deepest row
    last = cost_table.shape[0] - 1
    tokens = 1.0 + torch.arange(gain.shape[0], device=device, dtype=torch.float64) / batch
    low = tokens.floor().long().clamp_max(last - 1)
    frac = tokens - low
    table, widths = cost_table.to(device, torch.float64), width_table.to(device, torch.float64)
    chain = table[low] + frac * (table[low + 1] - table[low])
    width_share = widths[low] + frac * (widths[low + 1] - widths[low])  # A(x) + T_w(1)
    cost = chain - width_share + widths[width.clamp_max(last)]
    seconds_per_token = torch.as_tensor(seconds_per_token, device=device).double().clamp_min(1e-9)
    m = (gain - cost / seconds_per_token).argmax()
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[order] = torch.arange(flat.shape[0], device=device) < m
    kept = chosen.view_as(draft) & (draft > 0)
    return torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=device), kept], dim=1), kept.sum(-1)


def choose_prefix_host(pi: list[float], costs: list[float], seconds_per_token: float) -> tuple[list[bool], int]:
    """`choose_prefix` for one row on the host: `pi` `[N]` (root first), `costs` `[M]` the scaled cost table,
    `seconds_per_token` > 0; the same float64 sums and comparisons, ties to the lower index."""
    draft = pi[1:]
    order = sorted(range(len(draft)), key=lambda i: -draft[i])  # stable: ties keep index order
    best_n, best_value, gain = 0, None, 0.0
    for n in range(len(pi)):
        if n:
            gain += draft[order[n - 1]]
        value = gain - costs[min(n + 1, len(costs) - 1)] / seconds_per_token
        if best_value is None or value > best_value:
            best_n, best_value = n, value
    kept = [False] * len(draft)
    for node in order[:best_n]:
        kept[node] = draft[node] > 0
    return [True] + kept, best_n


@dataclass
class Calibration:
    """What the cost rule learns online in one setting (drafter, strategy, verifier): drafter and lookup
    acceptance, and the profile's live scale."""

    acceptance: AcceptanceCalibrator
    lookup: LookupCalibrator
    scale: float = 1.0
    profile: CostProfile | None = None  # what `scale` is relative to

    @classmethod
    def fresh(cls, device=None) -> "Calibration":
        with torch.inference_mode(False):  # ordinary tensors: updated in place by later calls in any mode
            return cls(AcceptanceCalibrator(device=device), LookupCalibrator(device=device))


class SpecCalibration:
    """What the cost rule learns across `generate` calls, in an object the caller owns.

    One answer gives a few dozen rounds, too few to learn the per-bin acceptance of the drafter's probabilities
    from the priors each time. Pass the same object to several calls (``generate(...,
    spec_calibration=calibration)``) and each continues from what the earlier ones learned, per drafter and per
    setting (strategy, verifier cost profile); a call without one starts from the priors and keeps nothing.
    Only the size of what is verified depends on it, never a token (greedy outputs equal plain greedy either
    way). `reset()` forgets everything; a drafter's entries go with the drafter.

    With `cost_profile`, the rule prices verification on that curve as given instead of the machine's measured
    one, and nothing follows this machine's timings (no live rescaling of the curve, no pricing of drafting by
    its measured time, no pausing of drafting): the size of what is verified then depends only on the drafter's
    probabilities, the same on any machine at any load. `HF_ADAPTIVE_SPEC_COST_PROFILE` gives calls without a
    `spec_calibration` such a fixed curve (`flat`: every size costs the same, so every node that can be
    accepted is kept; or the path of a JSON file `{"sizes": [...], "seconds": [...]}`).

    Examples:
        >>> calibration = hf_adaptive_spec.SpecCalibration()  # doctest: +SKIP
        >>> for inputs in requests:  # doctest: +SKIP
        ...     target.generate(**inputs, assistant_model=drafter, spec_strategy="sage",
        ...                     spec_calibration=calibration)
    """

    def __init__(self, cost_profile: CostProfile | None = None):
        if cost_profile is not None and not isinstance(cost_profile, CostProfile):
            raise TypeError(f"SpecCalibration(cost_profile=...) takes a CostProfile, got {type(cost_profile).__name__}.")
        self.cost_profile = cost_profile
        self._per_drafter = weakref.WeakKeyDictionary()  # drafter module -> {setting: Calibration}

    @classmethod
    def from_env(cls) -> "SpecCalibration | None":
        """The fixed-curve calibration `HF_ADAPTIVE_SPEC_COST_PROFILE` asks for (a fresh one per call), or None."""
        value = os.environ.get(ENV_COST_PROFILE, "").strip()
        if not value:
            return None
        if value == "flat":
            return cls(CostProfile(sizes=[1, 256], seconds=[1.0, 1.0]))
        try:
            data = json.loads(Path(value).expanduser().read_text())
            profile = CostProfile(sizes=list(data["sizes"]), seconds=list(data["seconds"]),
                                  width_sizes=data.get("width_sizes"), width_seconds=data.get("width_seconds"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{ENV_COST_PROFILE}={value!r} is neither 'flat' nor a readable JSON file "
                             f"with 'sizes' and 'seconds': {exc}") from exc
        return cls(profile)

    def get(self, drafter, setting: str, device) -> Calibration:
        """The `Calibration` of `drafter` (a module) in `setting`, made on first use."""
        per_drafter = self._per_drafter.setdefault(drafter, {})
        if setting not in per_drafter:
            per_drafter[setting] = Calibration.fresh(device)
        return per_drafter[setting]

    def settings(self) -> list:
        """The settings learned so far, over all drafters still alive."""
        return [setting for per_drafter in self._per_drafter.values() for setting in per_drafter]

    def reset(self) -> None:
        """Forget everything learned."""
        self._per_drafter = weakref.WeakKeyDictionary()


class CostModel:
    """What the loop gives a cost-aware strategy: the profile, calibration, and the running t_token.

    On a CPU the profile is also rescaled by the verification times the loop measures (`scale`, a running
    ratio of measured to profiled seconds): the profile is measured once per machine and kept on disk, often
    right after start-up, when a CPU can run a forward markedly slower than a few seconds later, and a
    profile slower than the machine is now overprices every extra node against the live t_token. Its shape
    is kept, its level follows the machine. On a GPU host times of a forward are launch times, so the
    profile is used as measured.
    """

    def __init__(self, profile: CostProfile, max_tokens: int, device, smoothing: float = 0.3,
                 live_scale: bool | None = None, calibration: Calibration | None = None, timed: bool = True,
                 rows: int = 1, packed: bool = False):
        self.profile = profile
        self.rows = rows  # rows of the batch the profile prices (one forward gives each of them a token)
        # the verification forward runs each row's real tokens only (`lean.LeanForward`): with a width curve,
        # every row gets its own count of nodes (`choose_nodes`)
        self.packed = packed
        self._set_widths(profile, max_tokens, device)
        # untimed (a fixed curve, `SpecCalibration(cost_profile=...)`): a round is priced at its size's cost on
        # the curve instead of its measured time, and the curve is never rescaled
        self.timed = timed
        self._seconds = [profile.time(n) for n in range(max_tokens + 2)]  # host copy: no device read per round
        self.table = torch.tensor(self._seconds, dtype=torch.float64, device=device)
        if calibration is None:
            calibration = Calibration.fresh(device)
        if calibration.profile is not profile:  # a scale is relative to the profile it was learned against
            calibration.profile, calibration.scale = profile, 1.0
        self.calibration = calibration
        self.calibrator = calibration.acceptance
        self.lookup_calibrator = calibration.lookup
        # before any round: a plain decoding step per token of each row (a device scalar: updating it needs no
        # host sync); a step gives every row a token, so at batch b a token costs T(1) / b
        self.seconds_per_token = torch.tensor(profile.time(1) / rows, dtype=torch.float32, device=device)
        self.smoothing = smoothing
        self.live_scale = timed and (torch.device(device).type == "cpu" if live_scale is None else live_scale)
        # pausing the drafter (CPU only, where host times are real): running seconds and tokens of drafted
        # rounds and of rounds that verify the root alone, both measured in this call (ratios of running sums,
        # not running ratios: a mean of per-round seconds per token overweights the rounds that accept nothing)
        self._drafted = [0.0, 0.0]  # seconds, tokens
        self._plain = [0.0, 0.0]
        self._drafted_rounds = 0
        self._paused_in_a_row = 0
        self.observed: dict[int, list[float]] = {}  # verification seconds by block size, this call's rounds

    def _set_widths(self, profile: CostProfile, max_tokens: int, device) -> None:
        """T_w(W) for W = 0 .. max_tokens + 1 (T_w(0) = 0) on the host (`_widths`) and as `width_table`; both
        None without a packed forward or a width curve (then the batch shares one count)."""
        widths = profile.width_profile() if self.packed else None
        self._widths = None if widths is None else [widths.time(w) for w in range(max_tokens + 2)]
        self.width_table = None if widths is None else torch.tensor(self._widths, dtype=torch.float64, device=device)

    def use_profile(self, profile: CostProfile, rows: int) -> None:
        """Price on `profile` from now on, the profile of a batch of `rows` (the batch changed size): this call's
        forwards first correct the profile they ran against (`refine_profile`); the live scale and the drafted /
        undrafted rates restart."""
        self.rows = rows
        if profile is self.profile:
            return
        self.refine_profile()
        self.profile = profile
        self._seconds = [profile.time(n) for n in range(len(self._seconds))]
        self.table = torch.tensor(self._seconds, dtype=torch.float64, device=self.table.device)
        self._set_widths(profile, len(self._seconds) - 2, self.table.device)
        self.calibration.profile, self.calibration.scale = profile, 1.0
        self.observed = {}
        self._drafted, self._plain = [0.0, 0.0], [0.0, 0.0]
        self._drafted_rounds = self._paused_in_a_row = 0

    # a paused call drafts again every `PROBE_EVERY` rounds, to see whether drafting pays again
    PROBE_EVERY = 8
    MIN_DRAFTED_ROUNDS = 8
    RATE_SMOOTHING = 0.1
    MARGIN = 1.05

    @property
    def drafted_rate(self) -> float | None:
        """Seconds per generated token of this call's drafted rounds (recent rounds weigh more)."""
        seconds, tokens = self._drafted
        return seconds / tokens if tokens else None

    def plain_rate(self, active_rows: int | None = None) -> float:
        """Seconds per token of this call's root-only rounds; before any, the profile's scaled T(1) shared by the
        `active_rows` that a root-only round gives a token each (default: every row of the batch)."""
        seconds, tokens = self._plain
        rows = self.rows if active_rows is None else active_rows
        return seconds / tokens if tokens else self.scale * self._seconds[1] / max(rows, 1)

    def pause_drafting(self, active_rows: int | None = None) -> bool:
        """True when the next round should verify the root alone, without drafting: this call's drafted rounds
        produce tokens more slowly (by `MARGIN`) than undrafted ones (a plain step through the same loop). On a
        hard prompt the cost rule already trims every node, but the drafter's forward and the tree are still
        paid each round; this stops paying them, drafting again every `PROBE_EVERY` rounds to re-measure.
        `active_rows`: rows still decoding (what a root-only round yields), by default the batch's."""
        drafted = self.drafted_rate
        if not self.live_scale or drafted is None or self._drafted_rounds < self.MIN_DRAFTED_ROUNDS:
            return False
        if drafted <= self.MARGIN * self.plain_rate(active_rows) or self._paused_in_a_row >= self.PROBE_EVERY - 1:
            self._paused_in_a_row = 0
            return False
        self._paused_in_a_row += 1
        return True

    def observe_rate(self, drafted: bool, round_seconds: float, tokens: int) -> None:
        """One round's seconds and tokens (host values), into the drafted or the undrafted running sums."""
        if not self.live_scale:
            return
        sums = self._drafted if drafted else self._plain
        self._drafted_rounds += drafted
        keep = 1.0 - self.RATE_SMOOTHING
        sums[0] = keep * sums[0] + round_seconds
        sums[1] = keep * sums[1] + tokens

    @property
    def scale(self) -> float:
        return self.calibration.scale

    @scale.setter
    def scale(self, value: float) -> None:
        self.calibration.scale = value

    def prune(self, tree) -> tuple[torch.Tensor, torch.Tensor]:
        """`(keep (B, N), n)` for `tree` (see `choose_prefix`); for one CPU row without padding nodes the survival
        products and the choice run on host lists (the same float32 / float64 arithmetic), as `ops` does for
        the per-round tree ops."""
        accept = self.acceptance(tree)
        if tree.tokens.shape[0] == 1 and tree.tokens.device.type == "cpu" and bool(tree.valid.all()):
            return self._prune_host(tree.parents[0].tolist(), accept[0].tolist(), tree.tokens.device)
        pi = survival(tree, accept)
        if self.width_table is not None and tree.tokens.shape[0] > 1:
            return choose_nodes(pi, self.table * self.scale, self.width_table * self.scale, self.seconds_per_token)
        return choose_prefix(pi, self.table * self.scale, self.seconds_per_token)

    def block_seconds(self, tree) -> float:
        """What the profile says the verification forward of `tree` costs (unscaled): a packed block by its real
        tokens and width (`choose_nodes`), otherwise by its width."""
        width = min(tree.tokens.shape[1], len(self._seconds) - 1)
        if self.width_table is None or tree.tokens.shape[0] == 1:
            return self._seconds[width]
        # choose_nodes' cost of m = valid - B draft nodes: T(x) - T_w(x) + T_w(W), x tokens per row
        tokens = min(int(tree.valid.sum()) / tree.tokens.shape[0], len(self._seconds) - 2)
        low, frac = int(tokens), tokens - int(tokens)
        widths = self._widths
        chain = self._seconds[low] + frac * (self._seconds[low + 1] - self._seconds[low])
        return chain - (widths[low] + frac * (widths[low + 1] - widths[low])) + widths[width]

    def acceptance(self, tree) -> torch.Tensor:
        """`(B, N)` each node's calibrated chance of acceptance given its parent: the drafter's calibrated
        probability, or on the lookup chain its own rate (the higher of both where the drafter agrees)."""
        accept = self.calibrator(tree.probs)
        if tree.lookup is not None:
            agreed = tree.probs > 0
            rate = self.lookup_calibrator(tree.lookup, agreed)
            accept = torch.where(tree.lookup > 0, torch.where(agreed, torch.maximum(rate, accept), rate), accept)
        return accept

    def _prune_host(self, parents: list[int], accept: list[float], device) -> tuple[torch.Tensor, torch.Tensor]:
        """`survival` and `choose_prefix` on one row's lists (same float32 products, float64 sums)."""
        pi = [1.0]
        for node in range(1, len(parents)):
            pi.append(float32(pi[parents[node]] * accept[node]))
        costs = [seconds * self.scale for seconds in self._seconds[: len(parents) + 1]]  # T(n + 1) for n < N
        keep, n = choose_prefix_host(pi, costs, max(float(self.seconds_per_token), 1e-9))
        return torch.tensor([keep], device=device), torch.tensor(n, device=device)

    def observe(self, tree, target_choice: torch.Tensor, round_seconds: float, tokens: torch.Tensor,
                verify_seconds: float | None = None) -> None:
        """Learn from a verified round: calibration from its nodes, t_token from its time and `tokens` (0-d),
        and (with `live_scale`) the profile's scale from `verify_seconds`, the time of its verification forward
        over the `tree`'s `N` tokens."""
        verified = verified_nodes(tree, target_choice)
        self.calibrator.observe(tree, target_choice, verified)
        self.lookup_calibrator.observe(tree, target_choice, verified)
        if not self.timed:
            round_seconds = self._seconds[min(tree.tokens.shape[1], len(self._seconds) - 1)]
        rate = round_seconds / tokens.clamp_min(1)
        # a prior profile's level is arbitrary: the first measured round sets the level outright
        first = self.profile.source == "prior" and not self.observed
        smoothing = 1.0 if first else self.smoothing
        self.seconds_per_token = torch.where(
            tokens > 0, self.seconds_per_token + smoothing * (rate - self.seconds_per_token),
            self.seconds_per_token)
        if verify_seconds is not None and self.live_scale:
            ratio = verify_seconds / self.block_seconds(tree)
            self.scale += smoothing * (ratio - self.scale)
            if self.width_table is None or tree.tokens.shape[0] == 1 or bool(tree.valid.all()):
                # a block the chain curve prices as it is (a packed one is priced by the model above)
                self.observed.setdefault(tree.tokens.shape[1], []).append(verify_seconds)

    def refine_profile(self) -> CostProfile:
        """At the end of a call: store the profile corrected by this call's measured forwards, where they
        disagree with it (`refine_profile`; host times, so only with `live_scale`)."""
        if not self.live_scale:
            return self.profile
        return refine_profile(self.profile, self.observed)


class DraftPricing:
    """Prices drafting itself, level by level, for an independent drafter (greedy, with a `CostModel`).

    Before the drafter runs the children a strategy chose to expand (one more drafter forward), it checks that
    what they are expected to add pays for it: the expected accepted tokens of their own children, approximated
    by each expanded node's survival probability pi times its own calibrated acceptance (a drafter sure of a
    node tends to be sure of the next), times the live seconds per token t_token, against the drafter forward
    at that width (measured online, per width) plus the verification time those children add on the target's
    curve. The strategy still shapes each level (SAGE: depth and width from its entropy); this decides how far
    drafting goes. Trimming after drafting (`CostModel.prune`) still applies to what was drafted.

    Args:
        cost (`CostModel`): the calibration, the target's curve and t_token.
        draft_seconds (callable, *optional*): `width -> seconds` of one drafter forward, fixed (tests); by
            default measured from the drafter's own forwards (`observe_draft`), free until the first one.
    """

    SMOOTHING = 0.3

    def __init__(self, cost: "CostModel", draft_seconds=None):
        self.cost = cost
        self._fixed = draft_seconds
        self._measured: dict[int, float] = {}
        self.stopped_levels = 0  # levels not drafted because they would not pay (for statistics)

    def draft_seconds(self, width: int) -> float:
        if self._fixed is not None:
            return float(self._fixed(width))
        if width in self._measured:
            return self._measured[width]
        if not self._measured:
            return 0.0
        nearest = min(self._measured, key=lambda measured: abs(measured - width))
        return self._measured[nearest]

    def forget_timings(self) -> None:
        """Measure the drafter's forwards afresh (the batch changed size)."""
        self._measured = {}

    def observe_draft(self, width: int, seconds: float) -> None:
        """One drafter forward over `width` expanded children took `seconds`."""
        previous = self._measured.get(width)
        self._measured[width] = seconds if previous is None else previous + self.SMOOTHING * (seconds - previous)

    def survival(self, parent_survival: torch.Tensor, level) -> torch.Tensor:
        """`(B, W)` pi of the level's children: their parent's pi times their calibrated acceptance."""
        accept = self.cost.calibrator(level.probs)
        return parent_survival.gather(1, level.parent) * accept * level.valid

    def pays(self, survival: torch.Tensor, level, tree_width: int) -> bool:
        """Whether running the level's `grow` children through the drafter pays (see the class docstring).

        Args:
            survival (`torch.Tensor` of shape `(B, W)`): pi of the level's children (`survival`).
            level (`drafters.levels.Level`): the level, with the children to expand.
            tree_width (`int`): nodes the tree holds so far, this level included (the verification width).
        """
        grow_survival = survival.gather(1, level.grow) * level.grow_valid
        grow_accept = self.cost.calibrator(level.probs.gather(1, level.grow))
        gain = float((grow_survival * grow_accept).sum())
        width = level.num_grow
        table = self.cost._seconds
        verify = self.cost.scale * (table[min(tree_width + width, len(table) - 1)]
                                    - table[min(tree_width, len(table) - 1)])
        if self.cost.width_table is not None and level.grow_valid.shape[0] > 1:
            # a packed forward (`choose_nodes`): the children cost their real share of the padded block
            verify *= float(level.grow_valid.sum()) / max(level.grow_valid.numel(), 1)
        paid = gain * float(self.cost.seconds_per_token) >= self.draft_seconds(width) + max(verify, 0.0)
        self.stopped_levels += not paid
        return paid
