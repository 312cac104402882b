"""The cost model a cost-aware strategy gets from the loop: the profile (rescaled live on a CPU), the calibration,
the running seconds per generated token and the pruning of a drafted tree (`prune`); it holds the call's
`DraftingPauses` (`cost.pauses`: drafting paused when drafted rounds produce tokens more slowly than undrafted
ones)."""

from __future__ import annotations

import torch

from ..ops.host import float32
from ..trees.tree import one_cpu_row
from .calibration import Calibration, verified_nodes
from .pauses import DraftingPauses
from .profile import CostProfile, between
from .selection import choose_nodes, choose_prefix, choose_prefix_host, survival
from .store import refine_profile

__all__ = ["CostModel"]


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
                 rows: int = 1, packed: bool = False, pauses: dict | None = None):
        self.profile = profile
        self.rows = rows  # rows of the batch the profile prices (one forward gives each of them a token)
        # the verification forward runs each row's real tokens only (`lean.LeanForward`): with a width curve,
        # every row gets its own count of nodes (`choose_nodes`)
        self.packed = packed
        self._set_widths(profile, max_tokens, device)
        # untimed (a fixed curve, `SpecCalibration(cost_profile=...)`): a round is priced at its size's cost on
        # the curve instead of its measured time, and the curve is never rescaled
        self.timed = timed
        self._seconds = profile.times(max_tokens + 2)  # host copy: no device read per round
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
        # t_token of each batch size the batch had (a serving batch changes size every few rounds as requests join
        # and leave; a token's price at 1 row is several times its price at 8)
        self._token_seconds: dict[int, torch.Tensor] = {}
        self.smoothing = smoothing
        self.live_scale = timed and (torch.device(device).type == "cpu" if live_scale is None else live_scale)
        # pausing the drafter (CPU only, where host times are real; `DraftingPauses`)
        self.pauses = DraftingPauses(rows, live_scale=self.live_scale, pauses=pauses,
                                     plain_seconds=lambda: self.scale * self._seconds[1])
        self.observed: dict[int, list[float]] = {}  # verification seconds by block size, this call's rounds

    def _set_widths(self, profile: CostProfile, max_tokens: int, device) -> None:
        """T_w(W) for W = 0 .. max_tokens + 1 (T_w(0) = 0) on the host (`_widths`) and as `width_table`; both
        None without a packed forward or a width curve (then the batch shares one count)."""
        widths = profile.width_profile() if self.packed else None
        self._widths = None if widths is None else widths.times(max_tokens + 2)
        self.width_table = None if widths is None else torch.tensor(self._widths, dtype=torch.float64, device=device)

    def use_profile(self, profile: CostProfile, rows: int) -> None:
        """Price on `profile` from now on, the profile of a batch of `rows` (the batch changed size): this call's
        forwards first correct the profile they ran against (`refine_profile`); the live scale restarts; the
        drafted / undrafted rates and t_token continue those of the last time the batch had `rows` rows (else they
        restart, t_token at the profile's T(1) / rows, as a call starts)."""
        self.pauses.at_rows(rows)
        if rows != self.rows:
            self._token_seconds[self.rows] = self.seconds_per_token
            known = self._token_seconds.get(rows)
            self.seconds_per_token = known if known is not None else torch.tensor(
                profile.time(1) / rows, dtype=torch.float32, device=self.table.device)
        self.rows = rows
        if profile is self.profile:
            return
        self.refine_profile()
        self.profile = profile
        self._seconds = profile.times(len(self._seconds))
        self.table = torch.tensor(self._seconds, dtype=torch.float64, device=self.table.device)
        self._set_widths(profile, len(self._seconds) - 2, self.table.device)
        self.calibration.profile, self.calibration.scale = profile, 1.0
        self.observed = {}

    @property
    def host_table(self) -> list:
        """T(n) for n = 0 .. max_tokens + 1 on the host, as the profile gives it (unscaled)."""
        return self._seconds

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
        if one_cpu_row(tree):
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
        chain = between(self._seconds, low, frac)
        return chain - between(widths, low, frac) + widths[width]

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
        if one_cpu_row(tree):
            self._calibrate_host(tree, target_choice)
        else:
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

    def _calibrate_host(self, tree, target_choice: torch.Tensor) -> None:
        """Both calibrators' `observe` for one CPU row with no padding nodes, on host lists (the same cells)."""
        tokens, parents, probs = tree.tokens[0].tolist(), tree.parents[0].tolist(), tree.probs[0].tolist()
        choice = target_choice[0].tolist()
        lookup = tree.lookup[0].tolist() if tree.lookup is not None else None
        drafted, drafted_right, looked, looked_right = [], [], [], []
        for node in range(1, len(tokens)):
            right = float(tokens[node] == choice[parents[node]])
            if lookup is None or lookup[node] == 0:
                drafted.append(self.calibrator.host_bin(probs[node]))
                drafted_right.append(right)
            if lookup is not None and lookup[node] > 0:
                looked.append(self.lookup_calibrator.host_index(lookup[node], probs[node] > 0))
                looked_right.append(right)
        self.calibrator.add(drafted, drafted_right)
        self.lookup_calibrator.add(looked, looked_right)

    def refine_profile(self) -> CostProfile:
        """At the end of a call: store the profile corrected by this call's measured forwards, where they
        disagree with it (`refine_profile`; host times, so only with `live_scale`)."""
        if not self.live_scale:
            return self.profile
        return refine_profile(self.profile, self.observed)
