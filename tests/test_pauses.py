"""Pausing drafting (`cost.pauses.DraftingPauses`): verdicts from the measured rates of drafted and root-only rounds,
probes, per batch size, within a call and across calls (`SpecCalibration(keep_pauses=True)`); rates injected."""

import pytest
import torch

from hf_adaptive_spec import cost
from hf_adaptive_spec.cost import CostModel, CostProfile
from hf_adaptive_spec.cost.pauses import DraftingPauses



def test_pauses_alone_price_the_plain_rate_by_the_curve_until_measured():
    """The controller on its own: before a root-only round the plain rate is the curve's scaled T(1) shared by the
    rows; without host times (`live_scale` False) nothing pauses, whatever the rates."""
    pauses = DraftingPauses(4, live_scale=True, plain_seconds=lambda: 0.08)
    assert pauses.plain_rate() == pytest.approx(0.02) and pauses.plain_rate(active_rows=2) == pytest.approx(0.04)
    pauses.observe_rate(False, round_seconds=0.05, tokens=4)
    assert pauses.plain_rate() == pytest.approx(0.0125)
    blind = DraftingPauses(1, live_scale=False, plain_seconds=lambda: 0.01)
    for _ in range(3 * DraftingPauses.MIN_DRAFTED_ROUNDS):
        blind.observe_rate(True, round_seconds=9.0, tokens=1)
        blind.observe_trim(0)
    assert not any(blind.pause_drafting() for _ in range(20)) and blind.drafted_rate is None


@pytest.mark.measured_cost
def test_drafting_pauses_while_it_does_not_pay_and_probes_again():
    """Verdicts that outlive the call (`pauses`, a serving engine's): probes back off, the plain rate is measured."""
    model = CostModel(CostProfile(sizes=[1, 2], seconds=[0.04, 0.05]), max_tokens=8, device="cpu", smoothing=0.5,
                      pauses={})
    assert not model.pauses.pause_drafting()  # nothing measured yet
    for _ in range(DraftingPauses.MIN_DRAFTED_ROUNDS):
        model.pauses.observe_rate(True, round_seconds=0.06, tokens=1)  # drafted rounds: 60 ms per token
    assert model.pauses.drafted_rate == pytest.approx(0.06)
    assert model.pauses.plain_rate() == pytest.approx(0.04)  # none measured: the profile's T(1)
    assert model.pauses.pause_drafting()  # no root-only round measured yet: one is run to measure it
    for _ in range(DraftingPauses.MIN_PLAIN_ROUNDS):
        model.pauses.observe_rate(False, round_seconds=0.045, tokens=1)  # a root-only round: 45 ms per token
    assert model.pauses.plain_rate() == pytest.approx(0.045)
    intervals = [DraftingPauses.PROBE_EVERY * 2 ** k for k in range(3)] + [DraftingPauses.MAX_PROBE_EVERY] * 2
    assert intervals[:3] == [8, 16, 32] and DraftingPauses.MAX_PROBE_EVERY == 32
    decisions = [model.pauses.pause_drafting() for _ in range(sum(intervals))]
    # drafts once (a probe) after PROBE_EVERY rounds, then twice as long after each probe that finds no gain
    assert decisions == [d for n in intervals for d in [True] * (n - 1) + [False]]
    for _ in range(30):
        model.pauses.observe_rate(True, round_seconds=0.06, tokens=3)  # drafting pays again: 20 ms per token
    assert not any(model.pauses.pause_drafting() for _ in range(10))
    for _ in range(30):
        model.pauses.observe_rate(True, round_seconds=0.06, tokens=1)  # and stops paying: probes start at PROBE_EVERY again
    decisions = [model.pauses.pause_drafting() for _ in range(DraftingPauses.PROBE_EVERY)]
    assert decisions == [True] * (DraftingPauses.PROBE_EVERY - 1) + [False]
    gpu = CostModel(CostProfile(sizes=[1], seconds=[1.0]), max_tokens=8, device="cpu", live_scale=False)
    for _ in range(10):
        gpu.pauses.observe_rate(True, round_seconds=9.0, tokens=1)
    assert not gpu.pauses.pause_drafting()  # host times are launch times there: never paused


@pytest.mark.measured_cost
def test_a_pause_ends_only_when_drafting_is_clearly_faster():
    """Drafting goes on while drafted rounds are faster than root-only ones by `KEEP_MARGIN`; a pause ends only
    once they are faster by `RESUME_MARGIN` (equal rates do not flap, and lean to plain steps); while drafting, a
    root-only round every `REFRESH_PLAIN_EVERY` drafted rounds keeps the plain rate current; the pause of one
    batch size survives the batch's other sizes."""
    assert 1.0 < DraftingPauses.KEEP_MARGIN < DraftingPauses.RESUME_MARGIN
    model = CostModel(CostProfile(sizes=[1, 2], seconds=[0.04, 0.05]), max_tokens=8, device="cpu", rows=1,
                      pauses={})
    for _ in range(DraftingPauses.MIN_PLAIN_ROUNDS):
        model.pauses.observe_rate(False, round_seconds=0.05, tokens=1)  # root-only rounds: 50 ms per token
    for _ in range(DraftingPauses.MIN_DRAFTED_ROUNDS):
        model.pauses.observe_rate(True, round_seconds=0.047, tokens=1)  # drafted rounds: 6% faster
    assert not model.pauses.pause_drafting()  # faster beyond KEEP_MARGIN: drafting goes on
    for _ in range(DraftingPauses.REFRESH_PLAIN_EVERY - DraftingPauses.MIN_DRAFTED_ROUNDS):
        model.pauses.observe_rate(True, round_seconds=0.047, tokens=1)
    assert model.pauses.pause_drafting()  # one root-only round refreshes the plain rate, without a pause
    model.pauses.observe_rate(False, round_seconds=0.05, tokens=1)
    assert not model.pauses.pause_drafting()
    for _ in range(40):
        model.pauses.observe_rate(True, round_seconds=0.0495, tokens=1)  # 1% faster: not enough to go on
    assert model.pauses.pause_drafting()
    for _ in range(40):
        model.pauses.observe_rate(True, round_seconds=0.0485, tokens=1)  # 3% faster: within the resume margin
    assert model.pauses.pause_drafting()
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.08, 0.09]), rows=2)  # a request joins
    # two rows while one row finds no gain: paused, without probes of its own (`_paused_below`)
    assert all(model.pauses.pause_drafting() for _ in range(4 * DraftingPauses.MAX_PROBE_EVERY))
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.04, 0.05]), rows=1)  # and leaves
    assert model.pauses.pause_drafting()  # the pause of one row goes on
    model.pauses.observe_rate(False, round_seconds=0.05, tokens=1)  # a paused round
    for _ in range(40):
        model.pauses.observe_rate(True, round_seconds=0.045, tokens=1)  # 10% faster: drafting again
    assert not model.pauses.pause_drafting()


def _judged(model: CostModel, rows: int, drafted_seconds: float, plain_seconds: float) -> None:
    """Measured rounds at `rows` rows: drafted ones at `drafted_seconds`, root-only ones at `plain_seconds`."""
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.01 * rows, 0.012 * rows]), rows=rows)
    for _ in range(DraftingPauses.MIN_PLAIN_ROUNDS):
        model.pauses.observe_rate(False, round_seconds=plain_seconds, tokens=rows)
    for _ in range(DraftingPauses.MIN_DRAFTED_ROUNDS):
        model.pauses.observe_rate(True, round_seconds=drafted_seconds, tokens=rows)


@pytest.mark.measured_cost
def test_a_larger_batch_does_not_probe_while_a_smaller_one_finds_no_gain():
    """Lasting verdicts: drafting pays less as rows are added, so a batch larger than a size paused on its own
    measurements pauses without probes; a smaller batch inherits the nearest verdict and probes; once the smaller
    size finds a gain again, the larger one judges by its own rates."""
    model = CostModel(CostProfile(sizes=[1, 2], seconds=[0.04, 0.05]), max_tokens=8, device="cpu", rows=4,
                      pauses={})
    _judged(model, 4, drafted_seconds=0.06, plain_seconds=0.04)  # 4 rows: drafting is slower
    assert model.pauses.pause_drafting()
    _judged(model, 8, drafted_seconds=0.05, plain_seconds=0.06)  # 8 rows: drafting measured faster (noise)
    assert all(model.pauses.pause_drafting() for _ in range(4 * DraftingPauses.MAX_PROBE_EVERY))  # 4 rows decides
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.03, 0.04]), rows=3)  # three rows, not seen yet
    decisions = [model.pauses.pause_drafting() for _ in range(2 * DraftingPauses.PROBE_EVERY)]
    assert decisions == ([True] * (DraftingPauses.PROBE_EVERY - 1) + [False]) * 2  # the verdict of 4, probing
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.04, 0.05]), rows=4)
    for _ in range(40):
        model.pauses.observe_rate(True, round_seconds=0.03, tokens=4)  # 4 rows' probes find a gain: drafting again
    assert not model.pauses.pause_drafting()
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.08, 0.1]), rows=8)
    assert not model.pauses.pause_drafting()  # 8 rows by its own rates again
    per_call = CostModel(CostProfile(sizes=[1, 2], seconds=[0.04, 0.05]), max_tokens=8, device="cpu", rows=4)
    _judged(per_call, 4, drafted_seconds=0.06, plain_seconds=0.04)
    _judged(per_call, 8, drafted_seconds=0.05, plain_seconds=0.06)
    assert not per_call.pauses.pause_drafting()  # one call's verdicts: each size by its own rates


@pytest.mark.measured_cost
def test_a_root_only_round_is_measured_before_drafting_is_judged():
    """Before any root-only round at a batch size the plain rate is the profile's guess; a profile slower than the
    machine would make drafted rounds look faster for ever. After `MIN_DRAFTED_ROUNDS` drafted rounds the rule runs
    `MIN_PLAIN_ROUNDS` root-only rounds to measure it, then judges."""
    model = CostModel(CostProfile(sizes=[1, 2], seconds=[0.8, 0.9]), max_tokens=8, device="cpu", rows=8,
                      pauses={})
    assert model.pauses.plain_rate() == pytest.approx(0.1)  # the profile: 100 ms per token at 8 rows
    for _ in range(DraftingPauses.MIN_DRAFTED_ROUNDS):
        model.pauses.observe_rate(True, round_seconds=0.48, tokens=8)  # drafted: 60 ms per token, "faster" than the guess
    decisions = []
    for _ in range(DraftingPauses.MIN_PLAIN_ROUNDS):
        decisions.append(model.pauses.pause_drafting())
        model.pauses.observe_rate(False, round_seconds=0.4, tokens=8)  # measured: 50 ms per token
    assert decisions == [True] * DraftingPauses.MIN_PLAIN_ROUNDS
    assert model.pauses.plain_rate() == pytest.approx(0.05) and model.pauses.pause_drafting()  # drafting is slower: paused


@pytest.mark.measured_cost
def test_a_calibration_keeps_each_batch_sizes_pause_across_calls():
    """A serving engine's batches close when the load drains: with `keep_pauses` the verdict of each batch size
    lives in the `SpecCalibration` (per drafter and strategy), so the next batch of that size starts paused."""
    drafter = torch.nn.Linear(1, 1)
    assert cost.SpecCalibration().pauses(drafter, "laspec") is None  # by default each call judges afresh
    with pytest.raises(TypeError, match="keep_pauses"):
        cost.SpecCalibration(keep_pauses=1)
    calibration = cost.SpecCalibration(keep_pauses=True)
    profile = CostProfile(sizes=[1, 2], seconds=[0.32, 0.4])
    first = CostModel(profile, max_tokens=8, device="cpu", rows=8, pauses=calibration.pauses(drafter, "laspec"))
    for _ in range(DraftingPauses.MIN_DRAFTED_ROUNDS):
        first.pauses.observe_rate(True, round_seconds=0.48, tokens=8)  # slower than a plain step of 8 rows
    assert first.pauses.pause_drafting(active_rows=8)
    again = CostModel(profile, max_tokens=8, device="cpu", rows=8, pauses=calibration.pauses(drafter, "laspec"))
    assert again.pauses.pause_drafting(active_rows=8)
    other = CostModel(profile, max_tokens=8, device="cpu", rows=8, pauses=calibration.pauses(drafter, "sage"))
    assert not other.pauses.pause_drafting(active_rows=8)
    calibration.reset()
    fresh = CostModel(profile, max_tokens=8, device="cpu", rows=8, pauses=calibration.pauses(drafter, "laspec"))
    assert not fresh.pauses.pause_drafting(active_rows=8)


@pytest.mark.measured_cost
def test_a_batch_prices_a_token_at_its_share_of_a_step():
    """At batch b a forward gives each row a token: before any round a token costs T(1) / b, and so does a
    root-only round's token before one is measured (b times T(1) would make drafting look cheap)."""
    profile = CostProfile(sizes=[1, 2], seconds=[0.32, 0.4])
    model = CostModel(profile, max_tokens=8, device="cpu", rows=8)
    assert float(model.seconds_per_token) == pytest.approx(0.04)
    assert model.pauses.plain_rate() == pytest.approx(0.04)
    assert model.pauses.plain_rate(active_rows=4) == pytest.approx(0.08)  # half the rows still decode
    for _ in range(DraftingPauses.MIN_DRAFTED_ROUNDS):
        model.pauses.observe_rate(True, round_seconds=0.48, tokens=8)  # 60 ms per token: slower than a plain step's
    for _ in range(DraftingPauses.MIN_PLAIN_ROUNDS):
        model.pauses.observe_rate(False, round_seconds=0.32, tokens=8)  # root-only rounds at the profile's T(1)
    assert model.pauses.pause_drafting(active_rows=8)
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.12, 0.2]), rows=2)  # six rows left the batch
    assert model.rows == 2 and model.pauses.plain_rate() == pytest.approx(0.06)
    single = CostModel(profile, max_tokens=8, device="cpu")
    assert float(single.seconds_per_token) == pytest.approx(0.32)


@pytest.mark.measured_cost
def test_the_rates_of_a_batch_size_survive_its_changes():
    """A serving batch changes size every few rounds: the drafted / root-only rates of each size are kept while the
    batch has another size, so the pause rule still decides (rates of different sizes never mix)."""
    profiles = {rows: CostProfile(sizes=[1, 2], seconds=[0.1 * rows, 0.12 * rows]) for rows in (4, 5)}
    model = CostModel(profiles[4], max_tokens=8, device="cpu", rows=4)
    for round_index in range(2 * DraftingPauses.MIN_DRAFTED_ROUNDS):
        rows = 4 if round_index % 2 == 0 else 5  # a request joins, another leaves, ...
        model.use_profile(profiles[rows], rows)
        model.pauses.observe_rate(True, round_seconds=0.8 if rows == 4 else 0.05, tokens=rows)
        if round_index < 2 * DraftingPauses.MIN_PLAIN_ROUNDS:  # root-only rounds: as the profiles say, 0.1 s a token
            model.pauses.observe_rate(False, round_seconds=0.1 * rows, tokens=rows)
    model.use_profile(profiles[4], 4)
    assert model.pauses.drafted_rate == pytest.approx(0.2)  # 4 rows: 0.8 s per 4 tokens, never mixed with 5 rows' rate
    assert model.pauses.pause_drafting(active_rows=4)  # slower than a root-only step at 4 rows (T(1) = 0.4 s / 4 tokens)
    model.use_profile(profiles[5], 5)
    assert model.pauses.drafted_rate == pytest.approx(0.01) and not model.pauses.pause_drafting(active_rows=5)


@pytest.mark.measured_cost
def test_drafting_pauses_once_trimmed_trees_keep_nothing():
    """Drafted rounds whose trees the rule trims to the root alone paid the drafter for nothing: after
    `EMPTY_ROUNDS` of them in a row drafting pauses at once (no rates needed), probing every `PROBE_EVERY` rounds; a
    probe that keeps a node drafts again."""
    model = CostModel(CostProfile(sizes=[1, 2], seconds=[0.1, 0.12]), max_tokens=8, device="cpu", rows=4)
    assert not model.pauses.pause_drafting()
    model.pauses.observe_trim(0)
    assert not model.pauses.pause_drafting()  # one empty round is not yet a pattern
    model.pauses.observe_trim(0)
    decisions = [model.pauses.pause_drafting() for _ in range(DraftingPauses.PROBE_EVERY)]
    assert decisions == [True] * (DraftingPauses.PROBE_EVERY - 1) + [False]  # the last one probes
    model.pauses.observe_trim(3)  # the probe's tree kept nodes: drafting pays again
    assert not model.pauses.pause_drafting()
    model.pauses.observe_trim(0)
    model.pauses.observe_trim(0)
    model.use_profile(CostProfile(sizes=[1, 2], seconds=[0.2, 0.22]), rows=8)  # another batch size: learned anew
    assert not model.pauses.pause_drafting()


@pytest.mark.measured_cost
def test_a_calls_own_verdict_keeps_drafting_within_five_percent():
    """Without lasting verdicts (one `generate` call) drafting goes on while drafted rounds are within 5% of the
    plain rate (the curve's T(1) until a root-only round is measured: no measuring rounds), and probes every
    `PROBE_EVERY` rounds without backing off."""
    model = CostModel(CostProfile(sizes=[1, 2], seconds=[0.05, 0.06]), max_tokens=8, device="cpu")
    assert not model.pauses.lasting
    for _ in range(DraftingPauses.MIN_DRAFTED_ROUNDS):
        model.pauses.observe_rate(True, round_seconds=0.052, tokens=1)  # 4% slower than the curve's plain step
    assert not model.pauses.pause_drafting()
    for _ in range(40):
        model.pauses.observe_rate(True, round_seconds=0.06, tokens=1)  # 20% slower
    decisions = [model.pauses.pause_drafting() for _ in range(3 * DraftingPauses.PROBE_EVERY)]
    assert decisions == ([True] * (DraftingPauses.PROBE_EVERY - 1) + [False]) * 3
