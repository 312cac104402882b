"""What a speculative call reports: `SpecStats` (on `SpecGenerateOutput.spec_stats`), and the per-round trace the
loop keeps on the device and reads back once at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

__all__ = ["RoundTrace", "SpecGenerateOutput", "SpecStats"]


@dataclass
class SpecStats:
    """How speculation went in one `generate` call.

    Fields:
        strategy: the strategy name.
        rounds: target verification forwards (draft -> verify rounds); the prefill is not a round.
        new_tokens: tokens generated over all rows (the prefill's first token included).
        row_rounds: rounds summed over the rows still generating in them.
        drafted_tokens / accepted_tokens: draft nodes verified / draft tokens accepted, over all rows.
        mean_accepted_length: tau = tokens produced by rounds / row_rounds (accepted drafts + bonus per round).
        accepted_lengths: accepted draft tokens of each row-round, in order.
        round_values: per-row-round values the strategy reports (`Strategy.round_values`), each list aligned
            with `accepted_lengths`: `sage` reports `alpha`, the confidence that shaped each tree.
        time_*: seconds spent in the prefill (target and drafter), drafting (drafter forwards), tree and mask
            building, verification (target forwards), acceptance (processors, path choice, stopping) and KV
            compaction. On a GPU these are host times between phases, without extra synchronisation.
        time_profile: seconds spent getting the verifier's cost curve: reading it from memory or disk, or on a
            CPU starting from a prior curve the rounds correct (no forward is timed inside a call unless asked:
            `hf_adaptive_spec.prepare`, `cost.measure_cost_curve`; on an accelerator the sweeps are measured).
        time_setup: seconds of one-off setup inside this call: `time_profile` plus loading the CPU kernel (a
            kernel not compiled yet is built in a background process, never inside the call).
        pruned_tokens: draft nodes the cost model trimmed before verification (cost-aware strategies).
        unpaid_levels: draft levels an independent drafter did not expand because they would not pay for the
            drafter forward and the verification they add (`cost.DraftPricing`; cost-aware strategies, CPU).
        paused_rounds: rounds that verified the root alone because drafting was not paying on this text (a
            drafter that `may_pause`, with the cost rule on a CPU; `DraftingPauses.pause_drafting`); counted in
            `rounds`.
        time_visual: seconds spent selecting visual tokens for a LaSpec drafter (int8 keys at the prefill, the
            score-and-vote each round); `time_visual / rounds` is the per-round selection cost.
        retired_rows: rows that finished and left the batch before the call ended (`retire_rows`).
    """

    strategy: str = ""
    rounds: int = 0
    new_tokens: int = 0
    row_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_lengths: list = field(default_factory=list)
    round_values: dict = field(default_factory=dict)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_tree: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    time_compact: float = 0.0
    time_profile: float = 0.0
    time_setup: float = 0.0
    pruned_tokens: int = 0
    paused_rounds: int = 0
    unpaid_levels: int = 0
    time_visual: float = 0.0
    retired_rows: int = 0
    time_total: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.row_rounds) / self.row_rounds if self.row_rounds else 0.0

    @property
    def target_forwards(self) -> int:
        return self.rounds + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("accepted_lengths", "round_values")}
        out.update(mean_accepted_length=self.mean_accepted_length, target_forwards=self.target_forwards,
                   acceptance_rate=self.acceptance_rate)
        return out


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `spec_stats` (`SpecStats`)."""

    spec_stats: SpecStats | None = None


class RoundTrace:
    """Per-round statistics kept on the device and read back once at the end (no host sync per round); with
    `keep=False` none are kept (a long-lived serving batch, whose rounds report through `Decoding.step`)."""

    def __init__(self, batch_size: int, keep: bool = True):
        self.batch_size, self.keep = batch_size, keep
        self.active, self.drafted, self.accepted = [], [], []
        self.values = {}  # name -> [(B,) per round]: what the strategy reports
        self.rows = []  # per round: the call's row of each of its rows (fewer once rows left the batch)
        self.pruned = 0  # draft nodes trimmed by the cost model (a device scalar once a round adds to it)

    def record(self, active, drafted, accepted, values: dict, rows: torch.Tensor):
        """One round's `(B,)` values, `rows` the call's row of each."""
        if not self.keep:
            return
        self.rows.append(rows)
        self.active.append(active)
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        for name, value in values.items():
            self.values.setdefault(name, []).append(value)

    def finish(self, stats: SpecStats) -> None:
        stats.pruned_tokens = int(self.pruned)
        if not self.active:
            return
        stack = self._stack
        active = stack(self.active)  # (rounds * B,) in round order, the call's rows within a round
        accepted = stack(self.accepted)[active]
        stats.row_rounds = int(active.sum())
        stats.drafted_tokens = int(stack(self.drafted)[active].sum())
        stats.accepted_tokens = int(accepted.sum())
        stats.accepted_lengths = accepted.tolist()
        stats.round_values = {name: stack(v)[active].tolist() for name, v in self.values.items()}

    def _stack(self, per_round: list) -> torch.Tensor:
        """`(rounds * B,)`: each round's values at the call's rows; rows that had left the batch hold zeros
        (inactive)."""
        full = []
        for value, rows in zip(per_round, self.rows):
            if rows.shape[0] != self.batch_size:
                value = value.new_zeros((self.batch_size,)).index_copy_(0, rows, value)
            full.append(value)
        return torch.stack(full).flatten()
