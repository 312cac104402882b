"""`plain`: no drafter, one token per round: plain decoding through the library's rounds.

Each round verifies the pending token alone, which is a plain decoding step: on a CPU it runs the library's
forward (`hf_adaptive_spec.adapters.lean`, in-place cache appends, the small-batch kernel at batch > 1), elsewhere the
model's own forward. Greedy output is plain `generate`'s; sampling draws each token from the target's processed
distribution. `generate(**inputs, spec_strategy="plain")` needs no `assistant_model`; it is the baseline that
shows what speculation adds on top of the faster forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Strategy, StrategyConfig


@dataclass
class PlainConfig(StrategyConfig):
    """Settings of the `plain` strategy: the runtime settings only (`StrategyConfig`)."""

    def validate(self):
        pass


class PlainStrategy(Strategy):
    name = "plain"
    config_class = PlainConfig
    drafts_nothing = True  # no drafter: every round verifies the pending token alone
    may_pause = False

    @property
    def max_children(self):
        return 0

    def select(self, level, frontier, candidate_probs):
        raise RuntimeError("the plain strategy drafts nothing")
