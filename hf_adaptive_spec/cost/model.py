"""The cost model a cost-aware strategy gets from the loop: the profile (rescaled live on a CPU), the calibration,
the running seconds per generated token, the pruning of a drafted tree (`prune`), and the pausing of drafting
when drafted rounds produce tokens more slowly than undrafted ones."""

from __future__ import annotations

import torch

from ..ops.host import float32
from .calibration import Calibration, PauseState, verified_nodes
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
        # pausing the drafter (CPU only, where host times are real): running seconds and tokens of drafted
        # rounds and of rounds that verify the root alone, both measured in this call (ratios of running sums,
        # not running ratios: a mean of per-round seconds per token overweights the rounds that accept nothing),
        # per batch size: a serving batch changes size every few rounds as requests join and leave, and rates
        # that restarted at every change would never reach `MIN_DRAFTED_ROUNDS` (rates of different sizes are
        # not comparable: a step's tokens grow with rows). `pauses` (`SpecCalibration.pauses`) keeps them across
        # calls.
        self._pauses: dict[int, PauseState] = {} if pauses is None else pauses
        # verdicts that outlive the call (a serving engine) are judged with the stricter, plain-leaning settings
        # (`SERVING_*`): their exploration is paid once per batch size, not once per call; one call of a few dozen
        # rounds keeps the per-call settings (measured: the serving ones cost a batch-1 call on MT-Bench 10% of
        # its speed, its two measured root-only rounds and earlier pauses included)
        self.lasting = pauses is not None
        self._pause = self._pause_at(rows)
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
        self._pause = self._pause_at(rows)
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

    # a paused call drafts again after `PROBE_EVERY` rounds, to see whether drafting pays again; each probe that
    # finds no gain doubles the interval, up to `MAX_PROBE_EVERY` (a probe costs more than a plain step when
    # drafting does not pay: under saturation fixed probes every 8 rounds cost about 3% of throughput)
    PROBE_EVERY = 8
    MAX_PROBE_EVERY = 32
    MIN_DRAFTED_ROUNDS = 8
    # root-only rounds measured at a batch size before drafted rounds are judged against them: without them the
    # plain rate is the profile's, and a profile slower than the machine would keep drafting (never measuring)
    MIN_PLAIN_ROUNDS = 2
    # drafted rounds in a row whose trees the rule trimmed to the root alone, after which drafting pauses
    EMPTY_ROUNDS = 2
    RATE_SMOOTHING = 0.1
    # drafting goes on while drafted rounds produce tokens faster than root-only rounds by `KEEP_MARGIN`, and a
    # pause ends once they are faster by `RESUME_MARGIN`: near equal rates a round's noise (+-10% on 2 cores)
    # would flip the verdict, and a drafted round costs the load more than its own seconds show, so equal
    # rates lean to plain steps (measured on a saturated server: drafting streaks on rates 2-5% better than a
    # plain rate measured earlier lost 9% of throughput)
    KEEP_MARGIN = 1.02
    RESUME_MARGIN = 1.05
    # while drafting, one root-only round every this many drafted rounds keeps the plain rate current
    REFRESH_PLAIN_EVERY = 64
    # a call's own verdicts (no `keep_pauses`): drafting goes on within 5% of the plain rate (the curve's T(1)
    # before a root-only round is measured), probes every `PROBE_EVERY` rounds
    CALL_MARGIN = 1 / 1.05

    def _pause_at(self, rows: int) -> PauseState:
        """The pause state of batch size `rows`; a size not seen yet starts with the verdict of the nearest size
        that has one (drafting pays or not: neighbouring sizes share it far more often than not, and a batch
        that shrinks or grows one row at a time would otherwise relearn it at each size), its own rates empty."""
        state = self._pauses.get(rows)
        if state is None:
            judged = [size for size, other in self._pauses.items()
                      if other.drafted_rounds >= self.MIN_DRAFTED_ROUNDS and other.plain_rounds >= self.MIN_PLAIN_ROUNDS]
            nearest = min(judged, key=lambda size: (abs(size - rows), size), default=None)
            inherited = nearest is not None and self._pauses[nearest].pausing
            state = self._pauses[rows] = PauseState(pausing=inherited, inherited=inherited,
                                                    probe_every=self.PROBE_EVERY)
        return state

    @property
    def drafted_rate(self) -> float | None:
        """Seconds per generated token of this call's drafted rounds (recent rounds weigh more)."""
        seconds, tokens = self._pause.drafted
        return seconds / tokens if tokens else None

    def plain_rate(self, active_rows: int | None = None) -> float:
        """Seconds per token of this call's root-only rounds; before any, the profile's scaled T(1) shared by the
        `active_rows` that a root-only round gives a token each (default: every row of the batch)."""
        seconds, tokens = self._pause.plain
        rows = self.rows if active_rows is None else active_rows
        return seconds / tokens if tokens else self.scale * self._seconds[1] / max(rows, 1)

    def pause_drafting(self, active_rows: int | None = None) -> bool:
        """True when the next round should verify the root alone, without drafting: this call's drafted rounds
        produce tokens more slowly than undrafted ones (a plain step through the same loop, `MIN_PLAIN_ROUNDS` of
        which are run to measure it, and one every `REFRESH_PLAIN_EVERY` drafted rounds to keep it current;
        drafting goes on while drafted rounds are faster by `KEEP_MARGIN`, and a pause ends once they are faster
        by `RESUME_MARGIN`). On a hard prompt or a saturated batch the cost rule already trims
        most nodes, but the drafter's forward and the tree are still paid each round; this stops paying them,
        drafting again after `PROBE_EVERY` rounds to re-measure (twice as long after each probe that finds no
        gain, up to `MAX_PROBE_EVERY`). `active_rows`: rows still decoding (what a root-only round yields), by
        default the batch's.

        Sooner: once `EMPTY_ROUNDS` drafted rounds in a row kept no draft node after trimming (`observe_trim`),
        drafting buys nothing at this load; it pauses at once, probing the same way. With lasting verdicts (a
        serving engine), a batch larger than a size paused on its own measurements pauses without probes
        (`_paused_below`)."""
        pause = self._pause
        if self.live_scale and pause.trimmed_empty >= self.EMPTY_ROUNDS:
            return self._paused_round()
        if self.lasting and self.live_scale and self._paused_below(self.rows):
            return True  # no probe here: the smaller size's probes tell when drafting pays again
        drafted = self.drafted_rate
        unmeasured = not self.live_scale or drafted is None or pause.drafted_rounds < self.MIN_DRAFTED_ROUNDS
        if unmeasured and self.live_scale and pause.inherited:  # an inherited pause goes on until measured
            return self._paused_round()
        pause.inherited = False
        if self.lasting and not unmeasured and pause.plain_rounds < self.MIN_PLAIN_ROUNDS:
            return True  # measure a root-only round at this batch size
        margin = (self.RESUME_MARGIN if pause.pausing else self.KEEP_MARGIN) if self.lasting else self.CALL_MARGIN
        if unmeasured or drafted * margin <= self.plain_rate(active_rows):
            pause.pausing, pause.paused_in_a_row, pause.probe_every = False, 0, self.PROBE_EVERY
            return (self.lasting and not unmeasured  # refresh the plain rate
                    and pause.drafted_since_plain >= self.REFRESH_PLAIN_EVERY)
        return self._paused_round()

    def _paused_below(self, rows: int) -> bool:
        """Whether a batch size under `rows` is paused on its own measurements (lasting verdicts only). Drafting
        pays less as rows are added (each verified node costs more of a forward that is already compute-bound), so
        a larger batch does not pay for probes of its own while a smaller one finds no gain: at a full serving
        batch, probes and noisy verdicts were most of the drafted rounds left."""
        return any(size < rows and state.pausing and not state.inherited
                   and state.drafted_rounds >= self.MIN_DRAFTED_ROUNDS and state.plain_rounds >= self.MIN_PLAIN_ROUNDS
                   for size, state in self._pauses.items())

    def _paused_round(self) -> bool:
        """One round of a pause: True (verify the root alone), or False for a probe every `probe_every` rounds."""
        pause = self._pause
        if not pause.pausing:
            pause.pausing, pause.paused_in_a_row, pause.probe_every = True, 0, self.PROBE_EVERY
        elif pause.paused_in_a_row == 0 and pause.drafted_rounds >= self.MIN_DRAFTED_ROUNDS:
            # the probe just drafted and drafting still does not pay (an inherited pause probes at the first
            # interval until its own drafted rounds are enough to judge)
            pause.probe_every = min(2 * pause.probe_every, self.MAX_PROBE_EVERY if self.lasting else self.PROBE_EVERY)
        if pause.paused_in_a_row >= pause.probe_every - 1:
            pause.paused_in_a_row = 0
            return False
        pause.paused_in_a_row += 1
        return True

    def observe_trim(self, kept_nodes: int) -> None:
        """A drafted round's draft nodes left after trimming, over the active rows (a host value): a round that
        keeps none paid the drafter for nothing."""
        self._pause.trimmed_empty = self._pause.trimmed_empty + 1 if kept_nodes == 0 else 0

    def observe_rate(self, drafted: bool, round_seconds: float, tokens: int) -> None:
        """One round's seconds and tokens (host values), into the drafted or the undrafted running sums."""
        if not self.live_scale:
            return
        sums = self._pause.drafted if drafted else self._pause.plain
        self._pause.drafted_rounds += drafted
        self._pause.plain_rounds += not drafted
        self._pause.drafted_since_plain = self._pause.drafted_since_plain + 1 if drafted else 0
        keep = 1.0 - self.RATE_SMOOTHING
        sums[0] = keep * sums[0] + round_seconds
        sums[1] = keep * sums[1] + tokens

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
        if tree.tokens.shape[0] == 1 and tree.tokens.device.type == "cpu" and bool(tree.valid.all()):
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
