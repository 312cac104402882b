"""What the decoding loop asks of a drafter: one interface that the independent drafter (any HF model) and the
LaSpec block drafter both implement.

A round, as the loop runs it::

    with drafter.prefill_scope(input_ids):     # around the target's prefill (e.g. capture its queries)
        outputs = target prefill                # recording the entries drafter.target_states(prefill=True) names
    drafter.start(TargetPrefill(...))           # the drafter's own prefill
    loop:
        tree = drafter.draft(strategy, ...)     # DraftTree, node 0 = the pending root
        with drafter.verify_scope():            # around the target's verification forward
            outputs = target tree forward       # recording the entries drafter.target_states() names
        drafter.finish_round(VerifiedRound(...))  # keep what was accepted
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..trees import DraftTree, build

__all__ = ["Drafter", "TargetPrefill", "VerifiedRound"]


@dataclass
class TargetPrefill:
    """What the target's prefill gave, for the drafter's own prefill.

    Fields:
        input_ids (`(B, S)`): the prompt (left-padded).
        attention_mask (`(B, S)` or None): as `generate` passed it.
        slot_valid (`(B, S)` bool): True at real (not padding) prompt slots.
        raw_inputs (dict): the processor's other inputs (pixel values, image grids) for a VLM drafter.
        cache: the target's KV cache after the prefill.
        hidden_states (tuple or None): the target's hidden-state entries the drafter reads
            (`Drafter.target_states(prefill=True)`); None when it reads none.
        first_token (`(B,)`): the first generated token, the pending root of round 1.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    slot_valid: torch.Tensor
    raw_inputs: dict
    cache: object
    hidden_states: tuple | None
    first_token: torch.Tensor


@dataclass
class VerifiedRound:
    """One verified round, for `Drafter.finish_round`.

    Fields:
        tree (`DraftTree`): the tree the target verified.
        path_index (`(B, D + 1)`): the accepted nodes, root first.
        accept_length (`(B,)`): accepted draft tokens per row.
        bonus (`(B,)`): the target's next token per row (the next pending root).
        hidden_states (tuple, dict or None): the target's hidden states at every tree node, the entries the drafter
            reads (`Drafter.target_states()`); None when it reads none.
    """

    tree: DraftTree
    path_index: torch.Tensor
    accept_length: torch.Tensor
    bonus: torch.Tensor
    hidden_states: tuple | None = None


class Drafter:
    """Base class of the loop's drafters.

    Class attributes (what the loop arranges around the drafter):
        may_pause: a round may verify the pending root alone when drafting does not pay (the cost rule's
            `pause_drafting`; its rates are then observed every round).
        prices_levels: drafting runs one forward per tree level, so a greedy cost-aware round may stop
            expanding levels that do not pay (`cost.DraftPricing`).
        compact_weights: on a CPU its linear layers read bf16 copies of their weights (drafts only).
        tree_forwards: its own forwards run under tree masks (tree attention is installed on it too).
        max_depth: the deepest level it can draft (a block drafter: its block), None for no limit of its own.
    """

    may_pause: bool = False
    prices_levels: bool = False
    compact_weights: bool = False
    tree_forwards: bool = False
    max_depth: int | None = None

    model = None  # the drafter's nn.Module
    root: torch.Tensor | None = None  # (B,) the pending root: the target's last token, which the next tree grows from
    model_time: float = 0.0  # seconds inside the drafter's forwards so far
    visual_time: float = 0.0  # seconds selecting visual tokens so far

    fuses_prefill_states: bool = False  # takes the prefill's states one by one (`fuse_prefill_state`)

    def fuse_prefill_state(self, index: int, state: torch.Tensor) -> None:
        """Hidden-state entry `index` of the target's prefill, as soon as its forward computed it."""
        raise NotImplementedError

    def target_states(self, prefill: bool = False) -> tuple | None:
        """The target's hidden-state entries this drafter reads (numbered like `outputs.hidden_states`) from the
        prefill (`prefill`) or a verification forward; None: none, and the target's forwards record no states."""
        return None

    def prefill_scope(self, input_ids: torch.Tensor):
        """A context manager entered around the target's prefill."""
        return nullcontext()

    def start(self, prefill: TargetPrefill) -> None:
        """The drafter's own prefill, from the prompt and what the target's prefill gave."""
        raise NotImplementedError

    def draft(self, strategy, process, max_depth: torch.Tensor, sample: bool = False, generator=None,
              committed: tuple | None = None, pricing=None, stop_tokens=None) -> DraftTree:
        """One round's tree; node 0 is the pending root.

        Args:
            strategy (`Strategy`): decides which candidates enter and grow (its `on_root` gives the round's
                selection, read by `trees.build`).
            process (callable or None): `process(logits (B, X, V), paths (B, X, D), depths (B, X), valid (B, X))`
                applies generate's logits processors with each node's own prefix; None when there are none.
            max_depth (`(B,)`): deepest level each row may draft (0: the row drafts nothing).
            sample (`bool`): draw children from the drafter's distribution (else take the top-k).
            generator (`torch.Generator`, *optional*): randomness for sampling.
            committed (tuple, *optional*): `(ids (B, C), lengths (B,), start (B,))`, the committed rows, root
                included (the loop's sequence buffer), for drafters that also propose from the context.
            pricing (`cost.DraftPricing`, *optional*): for drafters that `prices_levels`.
            stop_tokens (`(B, E)`, *optional*): each row's EOS ids (-1 padding): a drafter may leave a drafted
                one unexpanded (the loop drops whatever lies below one before verifying).
        """
        raise NotImplementedError

    def root_tree(self) -> DraftTree:
        """A tree of the pending root alone: a round that verifies one token (drafting paused)."""
        return build(self.root)

    def verify_scope(self):
        """A context manager entered around the target's verification forward."""
        return nullcontext()

    def finish_round(self, verified: VerifiedRound) -> None:
        """Keep the accepted path; the bonus token becomes the pending root."""
        raise NotImplementedError

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the state of rows `rows` `(B',)` only, in that order (between rounds: finished rows left the
        batch)."""
        raise NotImplementedError

    def join(self, other: "Drafter") -> None:
        """The rows of `other` (the same kind of drafter over the same model, started on other prompts, between
        rounds) follow this drafter's rows (a serving batch admits them)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows of another run.")

    def trim(self) -> None:
        """Drop state no row reads any more (between rounds; after rows left a serving batch)."""


class PendingOnly(Drafter):
    """No drafter: each round's tree is the pending token alone (the `plain` strategy), so each round is a plain
    decoding step through the loop's forward."""

    def start(self, prefill: TargetPrefill) -> None:
        self.root = prefill.first_token

    def draft(self, strategy, process, max_depth: torch.Tensor, sample: bool = False, generator=None,
              committed: tuple | None = None, pricing=None, stop_tokens=None) -> DraftTree:
        return self.root_tree()

    def finish_round(self, verified: VerifiedRound) -> None:
        self.root = verified.bonus

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.root = self.root[rows]

    def join(self, other: Drafter) -> None:
        self.root = torch.cat([self.root, other.root])
