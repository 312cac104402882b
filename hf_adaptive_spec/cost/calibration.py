"""What the cost rule learns online: the drafter's and the lookup chain's acceptance (calibrators), per setting
(`Calibration`), and across `generate` calls in an object the caller owns (`SpecCalibration`)."""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..ops.host import float32
from .profile import CostProfile

__all__ = ["ENV_COST_PROFILE", "AcceptanceCalibrator", "Calibration", "LookupCalibrator", "PauseState",
           "SpecCalibration", "verified_nodes"]

ENV_COST_PROFILE = "HF_ADAPTIVE_SPEC_COST_PROFILE"


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

    def host_bin(self, prob: float) -> int:
        """`_bin` of one float32 probability held as a Python float (the same float32 product, truncated)."""
        return min(max(int(float32(prob * self.num_bins)), 0), self.num_bins - 1)

    def add(self, index: list, right: list) -> None:
        """Count verified nodes given as host lists: their bins and whether each was right."""
        if index:
            index = torch.tensor(index, device=self.total.device)
            self.total.index_add_(0, index, torch.ones(index.shape[0], device=self.total.device))
            self.accepted.index_add_(0, index, torch.tensor(right, dtype=torch.float32, device=self.total.device))


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

    def host_index(self, match: int, agreed: bool) -> int:
        """`_index` of one node from host values."""
        return int(agreed) * (self.max_match + 1) + min(max(match, 0), self.max_match)

    def add(self, index: list, right: list) -> None:
        """Count verified lookup nodes given as host lists: their flat cells and whether each was right."""
        if index:
            index = torch.tensor(index, device=self.total.device)
            self.total.view(-1).index_add_(0, index, torch.ones(index.shape[0], device=self.total.device))
            self.accepted.view(-1).index_add_(0, index, torch.tensor(right, dtype=torch.float32,
                                                                     device=self.total.device))


def verified_nodes(tree, target_choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(nodes, right)` `(B, N)`: the real draft nodes of a verified tree, and which of them carry the target's
    choice after their parent."""
    nodes = tree.valid.clone()
    nodes[:, 0] = False
    parent_choice = target_choice.gather(1, tree.parents.clamp_min(0))
    return nodes, (tree.tokens == parent_choice) & nodes


@dataclass
class PauseState:
    """What the pausing of drafting (`DraftingPauses.pause_drafting`) knows at one batch size: the running seconds
    and tokens of drafted rounds and of rounds that verified the root alone, and where the pause stands."""

    drafted: list = field(default_factory=lambda: [0.0, 0.0])  # seconds, tokens (running sums)
    plain: list = field(default_factory=lambda: [0.0, 0.0])
    drafted_rounds: int = 0
    plain_rounds: int = 0
    drafted_since_plain: int = 0  # drafted rounds since the last root-only one (its rate grows stale)
    paused_in_a_row: int = 0
    pausing: bool = False  # in a pause (rounds verify the root alone, but for probes)
    inherited: bool = False  # the pause is the nearest batch size's verdict, not yet this size's own
    probe_every: int = 0  # rounds between probes while pausing (0: the rule's first interval)
    trimmed_empty: int = 0  # drafted rounds in a row whose trimmed trees kept no draft node


@dataclass
class Calibration:
    """What the cost rule learns online in one setting (drafter, strategy, verifier): drafter and lookup
    acceptance, and the profile's live scale."""

    acceptance: AcceptanceCalibrator
    lookup: LookupCalibrator
    scale: float = 1.0
    profile: CostProfile | None = None  # what `scale` is relative to
    depths: object = None  # `planning.DepthAcceptance` of planned rounds (made by the first one)

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

    With `keep_pauses=True` whether drafting pays at each batch size (`DraftingPauses.pause_drafting`) is kept
    across calls too: what a serving engine wants, whose batches open and close with the load while the load decides.
    By default each call judges it afresh from its own rounds: one hard prompt must not pause the next one's
    drafting.

    Examples:
        >>> calibration = hf_adaptive_spec.SpecCalibration()  # doctest: +SKIP
        >>> for inputs in requests:  # doctest: +SKIP
        ...     target.generate(**inputs, assistant_model=drafter, spec_strategy="sage",
        ...                     spec_calibration=calibration)
    """

    def __init__(self, cost_profile: CostProfile | None = None, keep_pauses: bool = False):
        if cost_profile is not None and not isinstance(cost_profile, CostProfile):
            raise TypeError(f"SpecCalibration(cost_profile=...) takes a CostProfile, got {type(cost_profile).__name__}.")
        if not isinstance(keep_pauses, bool):
            raise TypeError(f"SpecCalibration(keep_pauses=...) takes True or False, got {keep_pauses!r}.")
        self.cost_profile = cost_profile
        self.keep_pauses = keep_pauses
        self._per_drafter = weakref.WeakKeyDictionary()  # drafter module -> {setting: Calibration}
        self._pauses = weakref.WeakKeyDictionary()  # drafter module -> {strategy: {batch size: PauseState}}

    @classmethod
    def from_env(cls, keep_pauses: bool = False) -> "SpecCalibration | None":
        """The fixed-curve calibration `HF_ADAPTIVE_SPEC_COST_PROFILE` asks for (a fresh one per call), or None."""
        value = os.environ.get(ENV_COST_PROFILE, "").strip()
        if not value:
            return None
        if value == "flat":
            return cls(CostProfile(sizes=[1, 256], seconds=[1.0, 1.0]), keep_pauses=keep_pauses)
        try:
            data = json.loads(Path(value).expanduser().read_text())
            profile = CostProfile(sizes=list(data["sizes"]), seconds=list(data["seconds"]),
                                  width_sizes=data.get("width_sizes"), width_seconds=data.get("width_seconds"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{ENV_COST_PROFILE}={value!r} is neither 'flat' nor a readable JSON file "
                             f"with 'sizes' and 'seconds': {exc}") from exc
        return cls(profile, keep_pauses=keep_pauses)

    def get(self, drafter, setting: str, device) -> Calibration:
        """The `Calibration` of `drafter` (a module) in `setting`, made on first use."""
        per_drafter = self._per_drafter.setdefault(drafter, {})
        if setting not in per_drafter:
            per_drafter[setting] = Calibration.fresh(device)
        return per_drafter[setting]

    def pauses(self, drafter, strategy: str) -> dict | None:
        """`{batch size: PauseState}` of `drafter` under `strategy` when `keep_pauses` (whether drafting pays at
        each batch size, kept across calls), else None (each call judges afresh)."""
        if not self.keep_pauses:
            return None
        return self._pauses.setdefault(drafter, {}).setdefault(strategy, {})

    def settings(self) -> list:
        """The settings learned so far, over all drafters still alive."""
        return [setting for per_drafter in self._per_drafter.values() for setting in per_drafter]

    def reset(self) -> None:
        """Forget everything learned."""
        self._per_drafter = weakref.WeakKeyDictionary()
        self._pauses = weakref.WeakKeyDictionary()
