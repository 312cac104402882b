"""Pausing drafting within a call (and, with lasting verdicts, across a serving engine's calls): rounds verify the
pending root alone while drafted rounds produce tokens more slowly than root-only ones, with probes to see
whether drafting pays again. Host times only (CPU, `live_scale`); the rates are kept per batch size."""

from __future__ import annotations

from .calibration import PauseState

__all__ = ["DraftingPauses"]


class DraftingPauses:
    """Whether the next round drafts, from this call's measured rates of drafted and root-only rounds.

    Args:
        rows (`int`): the batch's rows now (`at_rows` when it changes).
        live_scale (`bool`): host times are real (a CPU, a timed curve); without them nothing pauses.
        pauses (`dict`, *optional*): `{batch size: PauseState}` that outlives the call (`SpecCalibration.pauses`:
            a serving engine's lasting verdicts, judged with the stricter, plain-leaning settings: their
            exploration is paid once per batch size, not once per call); None: the call's own.
        plain_seconds (callable): the scaled T(1) of the cost curve, the plain rate before a root-only round is
            measured (divided among the rows a root-only round gives a token each).

    Rates of different batch sizes are not comparable (a step's tokens grow with rows), and a serving batch
    changes size every few rounds as requests join and leave: rates that restarted at every change would never
    reach `MIN_DRAFTED_ROUNDS`, so each size keeps its own. Running sums, not running ratios: a mean of
    per-round seconds per token overweights the rounds that accept nothing. One call of a few dozen rounds
    keeps the per-call settings (measured: the serving ones cost a batch-1 call on MT-Bench 10% of its speed,
    its two measured root-only rounds and earlier pauses included).
    """

    def __init__(self, rows: int, live_scale: bool, pauses: dict | None = None, plain_seconds=None):
        self.rows = rows
        self.live_scale = live_scale
        self.plain_seconds = plain_seconds
        self._pauses: dict[int, PauseState] = {} if pauses is None else pauses
        self.lasting = pauses is not None
        self._pause = self._pause_at(rows)

    def at_rows(self, rows: int) -> None:
        """The batch has `rows` rows from now on: its own rates (or the nearest size's verdict)."""
        self._pause = self._pause_at(rows)
        self.rows = rows

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
        return seconds / tokens if tokens else self.plain_seconds() / max(rows, 1)

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
