"""The LaSpec block drafter in the decoding loop: one drafter forward per round, from the target's own states.

State between rounds, per row: the drafter's context (the target's fused hidden
states at every committed position, encoded and projected to each drafter layer's
keys/values once, then kept),
and the pending root (the target's bonus token, not yet run by the target).
A round runs `[root, MASK, ...]` once and gets `block_size` next-token
distributions; the strategy turns them into a tree level by level (every node
of depth d is offered the top-K of the depth-d distribution, processed with
its own prefix). The target's verification forward also returns the states of
the layers the drafter fuses (`target_states`), so the accepted nodes' states
extend the context with no extra target pass; the prefill's are fused as the
target computes them (`fuse_prefill_state`).

For a VLM with an image, the target's queries at a few layers are captured
during verification; the query of the last accepted position picks the M
visual tokens the drafter's gated cross-attention sees next round
(`hf_adaptive_spec.drafters.vision`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import clock
from ..trees import Committed, ContextBranch, DraftTree, PerDepth, PerNode, StoreBranch, build
from .base import Drafter, TargetPrefill, VerifiedRound
from ..adapters.attention import text_attention
from ..adapters.compat import text_config
from ..adapters.runner import left_pad
from .vision import QueryCapture, VisualKeyStore, select_visual_tokens
from .visual_view import image_token_mask
from .laspec import ContextKV, LaSpecDrafterModel, gather_target_hidden, spread_to_vocabulary


def right_pad(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    """`(B, n, ...)` widened to `(B, width, ...)` with `value` after each row's entries."""
    shape = list(tensor.shape)
    shape[1] = width - tensor.shape[1]
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=1) if shape[1] > 0 else tensor

__all__ = ["BlockDrafter", "CLOSED_GATE", "choose_visual_slots", "image_token_mask", "visual_branch_open"]


#: A visual branch whose every gate has |tanh(g)| at or below this is closed: it adds at most 0.1% of its
#: cross-attention output to the hidden state. Measured on `laspec-scenes-vlm-135m` (tanh(g) = 6e-4), M = 0, 1, 2,
#: 4, 8, 16 and 64 visual tokens gave the same drafts' tau and grounded acceptance (CHANGELOG.md, 2026-12-07), so such a
#: drafter runs without its visual branch: no query capture, no key store, no selection.
CLOSED_GATE = 1e-3


def visual_branch_open(model: LaSpecDrafterModel) -> bool:
    """Whether any layer's visual gate is open past `CLOSED_GATE` (else the visual branch is skipped)."""
    return any(layer.visual_gate is not None and float(torch.tanh(layer.visual_gate.detach()).abs().max()) > CLOSED_GATE
               for layer in model.layers)


def choose_visual_slots(queries: dict, store: VisualKeyStore, num_visual_tokens: int) -> torch.Tensor:
    """`(B, min(M, T))` prompt slots of the visual tokens a round's block attends to, best first (-1: none),
    from the query `{layer: (B, H, D)}` of the last accepted position (each layer votes for its top 2M)."""
    keep = min(num_visual_tokens, store.valid.shape[1])
    slots, _ = select_visual_tokens(queries, store, m_per_layer=2 * keep, keep=keep, timed=False)
    return slots


class BlockDrafter(Drafter):
    """Runs a [`LaSpecDrafterModel`] inside the decoding loop.

    Args:
        model ([`LaSpecDrafterModel`]): the drafter, attached to `target` (attached here if it is not).
        target: the verifier.
        block_size (`int`, *optional*): tokens per block (default: the drafter's `config.block_size`).
        num_visual_tokens (`int`, *optional*): M, visual tokens selected per round (default: the drafter's
            `config.num_visual_tokens`; 0 disables the visual branch).
        context_lookup (`int`): longest suffix matched for the context-lookup branch added to every greedy
            tree (`hf_adaptive_spec.trees.branches`; 0 = none).
        lookup_tokens (`int`, *optional*): tokens on that branch (default: the block size).
        datastore ([`TokenDatastore`], *optional*): also add its proposal (`hf_adaptive_spec.drafters.datastore`) to
            every greedy tree, as one more branch.
        datastore_tokens (`int`, *optional*): tokens on that branch (default: `lookup_tokens`).
        host_trees (`bool`): at batch 1, greedy, without processors and for a budget or shape strategy, build
            the tree with host lists (`trees.host`: the same tree, without ~40 small tensor ops per level).
    """

    may_pause = True
    compact_weights = True

    def __init__(self, model: LaSpecDrafterModel, target, block_size: int | None = None,
                 num_visual_tokens: int | None = None, context_lookup: int = 0, lookup_tokens: int | None = None,
                 datastore=None, datastore_tokens: int | None = None, host_trees: bool = True):
        if not isinstance(model, LaSpecDrafterModel):
            raise ValueError(f"BlockDrafter needs a LaSpecDrafterModel, got {type(model).__name__}.")
        embedding, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if model.get_input_embeddings() is not embedding or model.get_output_embeddings() is not lm_head:
            raise ValueError("BlockDrafter: the drafter does not use this target's embedding and LM head; run it "
                             "inside `attached_for_call(drafter, target)` (the decoding loop does).")
        self.model = model
        self.target = target
        config = model.config
        self.block_size = self.max_depth = block_size or config.block_size
        self.num_visual_tokens = config.num_visual_tokens if num_visual_tokens is None else num_visual_tokens
        if self.num_visual_tokens > 0 and config.num_visual_tokens == 0:
            raise ValueError(f"num_visual_tokens={self.num_visual_tokens} for a text-only drafter "
                             "(config.num_visual_tokens == 0: it has no visual branch).")
        self.context_lookup = context_lookup
        self.lookup_tokens = lookup_tokens or self.block_size
        self.datastore = datastore
        self.datastore_tokens = datastore_tokens or self.lookup_tokens
        self.layer_ids = list(config.target_layer_ids)
        num_layers = text_config(target).num_hidden_layers
        bad = [layer for layer in self.layer_ids if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(f"The drafter reads target layers {bad}, but the target has {num_layers} layers.")
        self.context = None  # ContextKV: the context's keys/values in every drafter layer
        self.context_valid = None  # (B, C)
        self.context_positions = None  # (B, C)
        self.previous_state = None  # (B, hidden) encoded state at root_position - 1 (read with fuse_previous_state)
        self.root = None  # (B,) pending token
        self.root_position = None  # (B,)
        self.prompt_embeds = None  # (B, S, H) the target's input embeddings of the prompt (vision only)
        self.visual_store = None
        self.visual_embeds = None  # (B, M, H) selected this round
        self.visual_valid = None
        self.capture = None
        self.image_mask = None
        self.model_time = 0.0
        self.visual_time = 0.0
        self.host_trees = host_trees
        self._fused = None  # (B, S, hidden) the prefill's fused layers, summed as they come
        self._prompt_embeds = None
        # committed rounds' fused target states not yet encoded into the context: (fused (B, K, F), valid (B, K),
        # positions (B, K)) per round. The context is read only when a round drafts, so the rounds in which
        # drafting paused are encoded together, in one call, before the next drafted one (`_flush`)
        self._pending: list = []

    # ---- the loop's steps (`Drafter`)

    fuses_prefill_states = True

    def fuse_prefill_state(self, index: int, state: torch.Tensor) -> None:
        """One hidden-state entry of the target's prefill, as its forward produces it: a fused layer's states are
        projected at once and summed into the context (`LaSpecDrafterModel.context_part`), so a long prompt never
        holds the fused layers' states together; entry 0 (input embeddings) is kept for the visual branch."""
        with torch.no_grad():
            if index == 0:
                self._prompt_embeds = state
                return
            projected = self.model.context_part(self.layer_ids.index(index - 1), state)
            self._fused = projected if self._fused is None else self._fused.add_(projected)

    def target_states(self, prefill: bool = False) -> tuple:
        """The fused layers' outputs; in the prefill also the input embeddings when the visual branch is live."""
        indices = tuple(layer + 1 for layer in self.layer_ids)
        return (0, *indices) if prefill and self.capture is not None else indices

    def start(self, prefill: TargetPrefill) -> None:
        if self._fused is not None:  # fused during the prefill (`fuse_prefill_state`)
            encoded = self.model.encode_context_sum(self._fused)
            embeds = self._prompt_embeds
            self._fused = self._prompt_embeds = None
        else:
            encoded, embeds = self._encode(prefill.hidden_states), prefill.hidden_states[0]
        self.prefill(encoded, prefill.slot_valid, prefill.first_token)
        if getattr(self.model.config, "context_without_image", False):  # the image positions' states stay out
            image = image_token_mask(self.target, prefill.input_ids)
            if image is not None:
                self.context_valid = self.context_valid & ~image
        self.setup_vision(embeds, prefill.cache)

    def finish_round(self, verified: VerifiedRound) -> None:
        """Extend the context with the accepted states; pick the next round's visual tokens."""
        self.commit(verified.tree, verified.hidden_states, verified.path_index, verified.accept_length,
                    verified.bonus)
        self.select_visual(verified.path_index.gather(1, verified.accept_length[:, None]).squeeze(1))

    def keep_rows(self, rows: torch.Tensor) -> None:
        self._flush()
        self.context = self.context.keep_rows(rows)
        for name in ("context_valid", "context_positions", "previous_state", "root", "root_position",
                     "prompt_embeds", "image_mask", "visual_embeds", "visual_valid"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[rows])
        if self.visual_store is not None:
            self.visual_store = self.visual_store.keep_rows(rows)
            if not any(self.visual_store.counts):  # no row left has an image: the visual branch is off
                self.visual_store = self.prompt_embeds = self.image_mask = None
                self.visual_embeds = self.visual_valid = None

    def join(self, other: Drafter) -> None:
        """`other`'s rows follow (between rounds): contexts right-aligned to the longer one (holes before a row's
        own slots), visual stores and prompt embeddings padded after a row's own."""
        if not isinstance(other, BlockDrafter) or other.model is not self.model:
            raise ValueError("a block drafter joins rows of the same drafter model.")
        self._flush()
        other._flush()
        if other.uses_vision and not self.uses_vision:
            if self.capture is None:  # the queries of every row are captured from now on (the other's capture)
                self.capture, self.image_mask = other.capture, None
            self._empty_vision(other)
        elif self.uses_vision and not other.uses_vision:
            other._empty_vision(self)
        context_width = max(self.context.length, other.context.length)
        self.context = ContextKV(
            [torch.cat([left_pad(a, context_width, 2), left_pad(b, context_width, 2)])
             for a, b in zip(self.context.keys, other.context.keys)],
            [torch.cat([left_pad(a, context_width, 2), left_pad(b, context_width, 2)])
             for a, b in zip(self.context.values, other.context.values)])
        self.context_valid = torch.cat([left_pad(self.context_valid, context_width, 1, False),
                                        left_pad(other.context_valid, context_width, 1, False)])
        self.context_positions = torch.cat([left_pad(self.context_positions, context_width, 1),
                                            left_pad(other.context_positions, context_width, 1)])
        for name in ("previous_state", "root", "root_position"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        if self.uses_vision:
            self.visual_store = self.visual_store.join(other.visual_store)
            for name, fill in (("prompt_embeds", 0), ("image_mask", False), ("visual_embeds", 0),
                               ("visual_valid", False)):
                mine, theirs = getattr(self, name), getattr(other, name)
                width = max(mine.shape[1], theirs.shape[1])
                setattr(self, name, torch.cat([right_pad(mine, width, fill), right_pad(theirs, width, fill)]))

    def _empty_vision(self, like: "BlockDrafter") -> None:
        """A visual branch with no visual tokens for this drafter's rows, shaped like `like`'s (a text row joining
        rows with images, or rows with images joining text rows)."""
        batch = self.root.shape[0]
        self.visual_store = like.visual_store.empty(batch)
        hidden = like.prompt_embeds.shape[-1]
        self.prompt_embeds = like.prompt_embeds.new_zeros(batch, 1, hidden)
        self.image_mask = torch.zeros(batch, 1, dtype=torch.bool, device=self.root.device)
        self.visual_embeds = like.visual_embeds.new_zeros(batch, 1, hidden) if like.visual_embeds is not None else None
        self.visual_valid = torch.zeros(batch, 1, dtype=torch.bool, device=self.root.device)
        if like.visual_embeds is None:
            self.visual_embeds = self.visual_valid = None

    def trim(self) -> None:
        """Drop context columns no row holds (after the oldest rows left a serving batch)."""
        self._flush()
        if self.context_valid.shape[0] == 0:
            return
        lead = int((~self.context_valid).long().cumprod(-1).sum(-1).min())
        if lead:
            self.context = ContextKV([k[:, :, lead:] for k in self.context.keys],
                                     [v[:, :, lead:] for v in self.context.values])
            self.context_valid, self.context_positions = self.context_valid[:, lead:], self.context_positions[:, lead:]

    # ---- vision

    @property
    def uses_vision(self) -> bool:
        return self.visual_store is not None

    def prefill_scope(self, input_ids):
        """Enter around the target's PREFILL: when the prompt has an image and the visual branch is live, the
        target's queries are captured from then on (the prompt's last query picks round 1's visual tokens)."""
        if self.num_visual_tokens <= 0 or not visual_branch_open(self.model):
            return nullcontext()  # M = 0 or a closed gate: no selection work where it could change no draft
        mask = image_token_mask(self.target, input_ids)
        if mask is None or text_attention(self.target) != "sdpa":  # queries are captured through sdpa
            return nullcontext()
        self.image_mask = mask
        self.capture = QueryCapture(self.target, self.layer_ids)
        self.capture.keep_prompt_keys = True  # a sliding-window layer's cache keeps its window only
        return self.capture

    def setup_vision(self, prompt_embeds, cache) -> None:
        """After the prefill: int8 visual keys, the prompt's input embeddings `(B, S, H)`, round 1's visual
        tokens."""
        if self.capture is None:
            return
        start = clock.now()
        keys = self.capture.prompt_keys
        self.capture.keep_prompt_keys, self.capture.prompt_keys = False, {}
        self.visual_store = VisualKeyStore.from_keys({layer: keys[layer] for layer in self.layer_ids}, self.image_mask)
        self.prompt_embeds = prompt_embeds  # (B, S, H) input embeddings, image features included
        self.visual_time += clock.now() - start
        last = torch.full((self.image_mask.shape[0],), self.image_mask.shape[1] - 1, device=self.image_mask.device)
        self.select_visual(last)  # prompts are left-padded: the last slot is every row's last prompt token

    def verify_scope(self):
        """A context manager that records the target's queries during a forward (no-op without vision)."""
        return self.capture if self.uses_vision else nullcontext()

    def select_visual(self, last_index: torch.Tensor) -> None:
        """Pick this round's M visual tokens from the query at forward position `last_index` `(B,)`."""
        if not self.uses_vision or not self.capture.queries:
            return
        start = clock.now()
        slots = choose_visual_slots(self.capture.query_at(last_index), self.visual_store, self.num_visual_tokens)
        self.visual_valid = slots >= 0
        index = slots.clamp_min(0)[..., None].expand(-1, -1, self.prompt_embeds.shape[-1])
        self.visual_embeds = self.prompt_embeds.gather(1, index)
        self.capture.clear()
        self.visual_time += clock.now() - start

    # ---- context

    @torch.no_grad()
    def _encode(self, hidden_states) -> torch.Tensor:
        return self.model.encode_context(gather_target_hidden(hidden_states, self.layer_ids))

    def prefill(self, encoded: torch.Tensor, slot_valid: torch.Tensor, first_token: torch.Tensor) -> None:
        """Context from the target's prefill states, encoded `(B, S, hidden)` (`encode_context`); the first generated
        token is the pending root."""
        self.context_valid = slot_valid
        self.context_positions = slot_valid.long().cumsum(-1) - 1
        self.context = self.model.context_kv(encoded, self.context_positions)
        last = (slot_valid.long() * torch.arange(1, slot_valid.shape[1] + 1, device=slot_valid.device)).argmax(-1)
        self.previous_state = encoded[torch.arange(encoded.shape[0], device=encoded.device), last]  # last prompt slot
        self.root = first_token
        self.root_position = slot_valid.sum(-1)

    # pending rounds' columns encoded at once at the latest (bounds what `_pending` holds)
    MAX_PENDING = 64

    @torch.no_grad()
    def commit(self, tree: DraftTree, hidden_states, path_index, accept_length, bonus) -> None:
        """Append the target's states at the root and accepted nodes; the bonus becomes the next root. The states
        are encoded when the context is next read (`_flush`): a round that drafts nothing (drafting paused) costs
        no drafter work; with the visual branch live (its tokens are picked every round) they are encoded now."""
        keep = int(accept_length.max()) + 1
        index = path_index[:, :keep]
        fused = gather_target_hidden(hidden_states, self.layer_ids)  # (B, N, F): all tree nodes
        fused = fused.gather(1, index[..., None].expand(-1, -1, fused.shape[-1]))
        offsets = torch.arange(keep, device=index.device)[None, :]
        self._pending.append((fused, offsets <= accept_length[:, None], self.root_position[:, None] + offsets))
        self.root_position = self.root_position + accept_length + 1
        self.root = bonus
        if self.uses_vision or sum(part[0].shape[1] for part in self._pending) >= self.MAX_PENDING:
            self._flush()

    @torch.no_grad()
    def _flush(self) -> None:
        """Encode the pending rounds' states into the context (keys and values projected once)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        fused = torch.cat([part[0] for part in pending], dim=1)
        valid = torch.cat([part[1] for part in pending], dim=1)
        positions = torch.cat([part[2] for part in pending], dim=1)
        start = clock.now()
        new = self.model.encode_context(fused)
        self.context = self.context.extend(self.model.context_kv(new, positions))
        self.model_time += clock.now() - start
        # every round keeps its root valid: each row's last valid column is its newest committed state
        last = (valid.long() * torch.arange(1, valid.shape[1] + 1, device=valid.device)).argmax(-1)
        self.previous_state = new[torch.arange(new.shape[0], device=new.device), last]
        self.context_valid = torch.cat([self.context_valid, valid], dim=1)
        self.context_positions = torch.cat([self.context_positions, positions], dim=1)

    # ---- drafting

    @torch.no_grad()
    def block_scores(self, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(scores (B, depth, V'), vocab)`: the drafter's logits for the next `depth` tokens after the root, over
        its draft vocabulary `vocab` `(V',)` (token ids) when it has one, else over the whole vocabulary (None)."""
        self._flush()
        model = self.model
        batch = self.root.shape[0]
        device = self.root.device
        input_ids = torch.zeros(batch, depth, dtype=torch.long, device=device)
        input_ids[:, 0] = self.root
        positions = self.root_position[:, None] + torch.arange(depth, device=device)
        previous = self.previous_state if model.config.fuse_previous_state else None
        start = clock.now()
        out = model.forward_block(input_ids, self.context, context_mask=self.context_valid,
                                  context_position_ids=self.context_positions, position_ids=positions,
                                  visual_embeds=self.visual_embeds, visual_mask=self.visual_valid,
                                  output_logits=False, previous_state=previous)
        hidden = out.last_hidden_state
        if model.draft_vocab is None:
            scores, vocab = model.logits_from_hidden(hidden), None
        else:
            scores, vocab = model.draft_vocab_logits(hidden), model.draft_vocab
        self.model_time += clock.now() - start
        return scores, vocab

    @torch.no_grad()
    def draft(self, strategy, process, max_depth: torch.Tensor, sample: bool = False, generator=None,
              committed: tuple | None = None, pricing=None, stop_tokens=None) -> DraftTree:
        """One round's tree (`Drafter.draft`); node 0 is the pending root. `pricing` is not read: one forward
        drafts every level; nor is `stop_tokens` (the loop drops what lies below a drafted EOS).

        `process` None means no logits processors: every node of a depth is then offered the same distribution,
        so under greedy drafting its top-k is computed once per depth, over the draft vocabulary only
        (`trees.PerDepth`; at batch 1 on a CPU, for a budget or shape selection, the tree is built on host lists).
        `committed` `(ids (B, C), lengths (B,), start (B,))`: the committed rows, root included (see
        `trees.branches.context_lookup`); with `context_lookup` set, a greedy tree also gets the lookup chain, and
        with a datastore its chain (first: a node both propose is learned as a context node).
        """
        batch = self.root.shape[0]
        device = self.root.device
        depth_limit = max(1, min(self.block_size, int(max_depth.max())))
        scores, vocab = self.block_scores(depth_limit)
        scores = scores.float()  # (B, L, V')
        if process is None and not sample:
            k = min(strategy.max_children, scores.shape[-1])
            top_probs, top_index = torch.softmax(scores, dim=-1).topk(k, dim=-1)  # (B, L, k)
            candidates = PerDepth(top_probs, top_index if vocab is None else vocab[top_index])
            # over the draft vocabulary: what a strategy reads of it is a distribution
            selection = strategy.on_root(scores[:, 0])
        else:
            logits = spread_to_vocabulary(scores, vocab, self.model.config.vocab_size)  # (B, L, V)
            no_path = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)
            process = process or _unprocessed
            root_logits = process(logits[:, :1], no_path, torch.zeros(batch, 1, dtype=torch.long, device=device),
                                  torch.ones(batch, 1, dtype=torch.bool, device=device))
            selection = strategy.on_root(root_logits[:, 0])
            candidates = _BlockLevels(logits, root_logits, process, min(strategy.max_children, logits.shape[-1]))
        branches = []
        if committed is not None and not sample:
            rows = Committed(*committed, max_depth)
            if self.datastore is not None:
                branches.append(StoreBranch(rows, self.datastore, self.datastore_tokens))
            if self.context_lookup:
                branches.append(ContextBranch(rows, self.context_lookup, self.lookup_tokens))
        return build(self.root, candidates, selection, branches, max_depth=max_depth, sample=sample,
                     generator=generator, host_rows=self.host_trees)


class _BlockLevels(PerNode):
    """A block's candidates under logits processors or sampling: every node of depth d is offered the block's
    depth-(d+1) distribution, processed with its own prefix."""

    def __init__(self, logits, root_logits, process, k: int):
        self.logits, self.root_logits, self.process, self.k = logits, root_logits, process, k
        self.depth_limit = logits.shape[1]

    def grow(self, level, tokens, parent, paths, valid):
        next_logits = self.logits[:, level:level + 1].expand(-1, tokens.shape[1], -1)
        return self.process(next_logits, paths, torch.full_like(tokens, level), valid)


def _unprocessed(logits, paths, depths, valid):
    """The drafter's logits as they are (a call without logits processors)."""
    return logits
