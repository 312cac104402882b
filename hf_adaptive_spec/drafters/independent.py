"""An independent HF model as drafter: it expands the tree level by level, one forward per level.

The drafter keeps its own KV cache. Between rounds it holds every committed
token except the `pending` ones (an accepted leaf it never processed, and the
target's bonus token; one more per round in which drafting paused). A round's
first forward runs the pending tokens, whose last is the tree root; each
further forward runs the nodes of one level that the strategy chose to expand,
under a tree mask.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from ..adapters.compat import MULTIMODAL_KEYS, cache_argument, check_cache
from ..adapters.runner import ModelRunner, left_pad
from ..trees import DraftTree, PerNode, build
from .base import Drafter, TargetPrefill, VerifiedRound
from .visual_view import VisualView


class IndependentDrafter(Drafter):
    """Drafts trees with any HF causal LM or VLM that shares the target's tokenizer.

    Args:
        model: the drafter model (`assistant_model`).
        target: the verifier (needed with `num_visual_tokens` only).
        num_visual_tokens (`int`, *optional*): a VLM drafter sees only this many of the image's visual tokens,
            chosen by the target's attention (`visual_view.VisualView`); None: all of them.
        visual_selection (`str`): ``"prefill"`` (chosen once) or ``"round"`` (again after every round).
    """

    prices_levels = True  # one forward per level: a level may stop where it no longer pays
    # on a CPU its linear layers read bf16 copies (drafts only; the target decides every token): a small drafter's
    # step is bound by reading its LM head (scenes-vlm-drafter-16m: 4.8 -> 1.3 ms a drafted token, 2026-12-05)
    compact_weights = True
    tree_forwards = True
    # a paused round runs no drafter forward: its bonus token joins the pending ones, which the next drafted
    # round's first forward runs as one chain
    may_pause = True

    def __init__(self, model, target=None, num_visual_tokens: int | None = None, visual_selection: str = "prefill"):
        self.model = model
        self.view = None if num_visual_tokens is None else VisualView(target, model, num_visual_tokens,
                                                                      visual_selection)
        self.runner: ModelRunner | None = None
        self.pending: torch.Tensor | None = None  # (B, P) right-aligned
        self.pending_valid: torch.Tensor | None = None  # (B, P)
        self._num_pending = 0
        self._drafted = False  # whether this round ran `draft` (False: drafting paused)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, raw_inputs: dict) -> None:
        """Run the prompt (with the image, for a VLM drafter) into a fresh cache."""
        model = self.model
        cache = DynamicCache(config=model.config)
        check_cache(cache, "drafter")
        accepted = set(inspect.signature(model.forward).parameters)
        kwargs = {k: raw_inputs[k] for k in MULTIMODAL_KEYS if raw_inputs.get(k) is not None and k in accepted}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        cache_kwargs = {cache_argument(model): cache}
        position_ids = model._prepare_position_ids_for_generation(input_ids, {**kwargs, **cache_kwargs})
        slot_valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        seen = slot_valid if self.view is None else self.view.prompt_visibility(slot_valid)
        if seen is not slot_valid:  # hidden visual slots: off in the mask, positions as given
            kwargs["attention_mask"] = seen.long()
        inputs = model.prepare_inputs_for_generation(
            input_ids, position_ids=position_ids, use_cache=True, is_first_iteration=True, **cache_kwargs, **kwargs,
        )
        if "logits_to_keep" in accepted:
            inputs["logits_to_keep"] = 1
        model(**inputs)
        if cache.get_seq_length() != input_ids.shape[1]:
            raise ValueError(
                f"The drafter's prefill cached {cache.get_seq_length()} positions for a {input_ids.shape[1]}-token "
                "prompt; its processor must expand image tokens like the target's."
            )
        # the positions the forward ran with (prepare_inputs_for_generation may shift them: PaliGemma)
        used = inputs.get("position_ids")
        self.runner = ModelRunner(model, cache, slot_valid, used if used is not None else position_ids)
        self.runner.slot_valid = seen  # positions follow the prompt; attention skips the hidden visual slots

    def start(self, prefill: TargetPrefill) -> None:
        """Prefill on the prompt; the first generated token is pending."""
        self.prefill(prefill.input_ids, prefill.attention_mask, prefill.raw_inputs)
        first = prefill.first_token[:, None]
        self.set_pending(first, torch.ones_like(first, dtype=torch.bool))

    def prefill_scope(self, input_ids: torch.Tensor):
        return self.view.prefill_scope(input_ids) if self.view is not None else super().prefill_scope(input_ids)

    def verify_scope(self):
        return self.view.verify_scope() if self.view is not None else super().verify_scope()

    @property
    def visual_time(self) -> float:
        """Seconds selecting visual tokens so far."""
        return self.view.visual_time if self.view is not None else 0.0

    @property
    def root(self) -> torch.Tensor:
        return self.pending[:, -1]

    @property
    def model_time(self) -> float:
        """Seconds spent inside the drafter's forwards so far."""
        return self.runner.model_time if self.runner is not None else 0.0

    def set_pending(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        self.pending, self.pending_valid = tokens, valid

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.runner.keep_rows(rows)
        if self.view is not None:
            self.view.keep_rows(rows)
        self.pending, self.pending_valid = self.pending[rows], self.pending_valid[rows]

    def join(self, other: Drafter) -> None:
        """`other`'s rows follow (its runner's cache right-aligned to this one's; pending tokens stay
        right-aligned)."""
        if not isinstance(other, IndependentDrafter) or other.model is not self.model or self._drafted:
            raise ValueError("an independent drafter joins rows of the same drafter model, between rounds.")
        if (self.view is None) != (other.view is None):
            raise ValueError("drafters with and without a visual selection cannot join.")
        widths = (self.runner.slot_valid.shape[1], other.runner.slot_valid.shape[1])
        rows = (self.runner.slot_valid.shape[0], other.runner.slot_valid.shape[0])
        if self.view is not None:
            self.view.join(other.view, widths, rows)
        self.runner.join(other.runner)
        width = max(self.pending.shape[1], other.pending.shape[1])
        self.pending = torch.cat([left_pad(self.pending, width, 1), left_pad(other.pending, width, 1)])
        self.pending_valid = torch.cat([left_pad(self.pending_valid, width, 1, False),
                                        left_pad(other.pending_valid, width, 1, False)])

    def trim(self) -> None:
        width = self.runner.slot_valid.shape[1]
        self.runner.trim()
        if self.view is not None:
            self.view.trim(width - self.runner.slot_valid.shape[1])

    @torch.no_grad()
    def draft(self, strategy, process, max_depth: torch.Tensor, sample: bool = False, generator=None,
              committed: tuple | None = None, pricing=None, stop_tokens=None) -> DraftTree:
        """One round's tree, level by level, one drafter forward per expanded level (`Drafter.draft`).

        Under sampling each node's children are drawn without replacement from the processed drafter
        distribution q (exponential race = Gumbel-top-k) and q is kept in the tree. `pricing` (greedy only):
        a level is expanded only while it pays for the drafter forward and the verification it adds; the
        children it stops at stay in the tree. `committed` is not read: this drafter proposes from its own
        forwards only. A drafted `stop_tokens` id is not expanded (no forward for what cannot be of use).
        """
        if process is None:
            process = _unprocessed
        tokens, valid = self.pending, self.pending_valid
        batch, num_pending = tokens.shape
        device = tokens.device
        # pending tokens form a chain (right-aligned, so the real ones are contiguous at the end)
        column = torch.arange(num_pending, device=device)
        chain_parent = torch.where(valid & torch.roll(valid, 1, dims=1) & (column > 0), column - 1, -1)
        output = self.runner.forward(tokens, chain_parent, valid, logits_to_keep=1)
        no_path = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)
        zero_depth = torch.zeros(batch, 1, dtype=torch.long, device=device)
        ones = torch.ones(batch, 1, dtype=torch.bool, device=device)
        root_logits = process(output.logits[:, -1:].float(), no_path, zero_depth, ones)  # (B, 1, V)
        selection = strategy.on_root(root_logits[:, 0])
        levels = _ModelLevels(self.runner, process, root_logits, chain_parent, valid,
                              min(strategy.max_children, root_logits.shape[-1]))
        tree = build(tokens[:, -1], levels, selection, max_depth=max_depth, sample=sample, generator=generator,
                     stop_tokens=stop_tokens, pricing=pricing)
        self._num_pending = num_pending
        self._drafted = True
        return tree

    def finish_round(self, verified: VerifiedRound) -> None:
        self._keep(verified)
        if self.view is not None:  # "round" selection: the last accepted position's query picks the next tokens
            self.view.after_round(self.runner, verified.path_index.gather(1, verified.accept_length[:, None])[:, 0])

    def _keep(self, verified: VerifiedRound) -> None:
        if not self._drafted:  # drafting paused: the drafter ran nothing, the bonus token waits with the others
            bonus = verified.bonus[:, None]
            self.set_pending(torch.cat([self.pending, bonus], dim=1),
                             torch.cat([self.pending_valid, torch.ones_like(bonus, dtype=torch.bool)], dim=1))
            return
        self._drafted = False
        self.commit(verified.tree, verified.path_index, verified.accept_length, verified.bonus)

    def commit(self, tree: DraftTree, path_index: torch.Tensor, accept_length: torch.Tensor, bonus: torch.Tensor):
        """Keep the pending tokens and the accepted nodes the drafter processed; queue the rest.

        Args:
            tree (`DraftTree`): this round's tree.
            path_index (`torch.LongTensor` of shape `(B, D + 1)`): accepted nodes, root first.
            accept_length (`torch.LongTensor` of shape `(B,)`): accepted draft tokens per row.
            bonus (`torch.LongTensor` of shape `(B,)`): the target's next token per row.
        """
        num_pending = self._num_pending
        accepted = path_index[:, 1:]  # (B, D)
        on_path = torch.arange(accepted.shape[1], device=accepted.device)[None, :] < accept_length[:, None]
        slots = tree.drafter_slot.gather(1, accepted)
        processed = on_path & (slots >= 0)  # a prefix of the accepted path: only a final leaf is unprocessed
        num_processed = processed.sum(-1)
        keep_width = int(num_processed.max()) if processed.numel() else 0
        batch = path_index.shape[0]
        pending_slots = torch.arange(num_pending, device=accepted.device)[None, :].expand(batch, -1)
        keep = torch.cat([pending_slots, torch.where(processed, slots, 0)[:, :keep_width]], dim=1)
        keep_valid = torch.cat([self.pending_valid, processed[:, :keep_width]], dim=1)
        self.runner.commit(keep, keep_valid)
        # the accepted leaf (if the drafter never ran it) and the bonus token are pending next round
        has_leaf = num_processed < accept_length
        leaf = tree.tokens.gather(1, path_index.gather(1, accept_length[:, None])).squeeze(1)
        if bool(has_leaf.any()):
            self.pending = torch.stack([torch.where(has_leaf, leaf, bonus), bonus], dim=1)
            self.pending_valid = torch.stack([has_leaf, torch.ones_like(has_leaf)], dim=1)
        else:
            self.pending = bonus[:, None]
            self.pending_valid = torch.ones_like(self.pending, dtype=torch.bool)


class _ModelLevels(PerNode):
    """The independent drafter's candidates: each level's expanded children run through the drafter as one block
    under the tree mask (its uncommitted tail: the pending chain, then each level's children), their processed
    logits the next level's candidates."""

    def __init__(self, runner: ModelRunner, process, root_logits, tail_parents, tail_valid, k: int):
        self.runner, self.process, self.root_logits, self.k = runner, process, root_logits, k
        self.tail_parents, self.tail_valid = tail_parents, tail_valid
        batch = root_logits.shape[0]
        self.root_slot = tail_parents.shape[1] - 1
        self.frontier_slots = torch.full((batch, 1), self.root_slot, dtype=torch.long, device=root_logits.device)

    def slots(self, level) -> torch.Tensor:
        """The expanded children get the next drafter tail slots, in order."""
        tail_length = self.tail_parents.shape[1]
        slot = torch.full_like(level.tokens, -1)
        slot.scatter_(1, level.grow, torch.where(
            level.grow_valid, tail_length + torch.arange(level.num_grow, device=slot.device), -1))
        return torch.where(level.expand, slot, -1)

    def grow(self, level, tokens, parent, paths, valid):
        tail_length = self.tail_parents.shape[1]
        block_parents = torch.where(valid, self.frontier_slots.gather(1, parent), -1)
        self.tail_parents = torch.cat([self.tail_parents, block_parents], dim=1)
        self.tail_valid = torch.cat([self.tail_valid, valid], dim=1)
        output = self.runner.forward(tokens, self.tail_parents, self.tail_valid)
        self.frontier_slots = tail_length + torch.arange(tokens.shape[1], device=tokens.device)[None, :].expand(
            tokens.shape[0], -1)
        return self.process(output.logits.float(), paths, torch.full_like(tokens, level), valid)


def _unprocessed(logits, paths, depths, valid):
    return logits
