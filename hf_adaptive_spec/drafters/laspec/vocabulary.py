"""The draft vocabulary of a LaSpec drafter: drafting over the target's most frequent tokens only, with the LM
head's rows of those tokens gathered once per decoding call (`draft_head_cache`)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ...ops import cpu_linear, tensor_version
from .target import readable_head

__all__ = ["DraftVocabulary", "draft_head_cache", "spread_to_vocabulary"]


def spread_to_vocabulary(scores: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Scores `(..., V')` over a draft vocabulary `vocab` `(V',)` (token ids) spread to the whole vocabulary
    `(..., vocab_size)`, -inf elsewhere; returned as is when `vocab` is None."""
    if vocab is None:
        return scores
    full = scores.new_full((*scores.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab, scores)


# the draft vocabulary's LM-head rows (and their bf16 copy) of each drafter, for one decoding call
_DRAFT_HEADS = contextvars.ContextVar("hf_adaptive_spec_draft_heads", default=None)


@contextlib.contextmanager
def draft_head_cache():
    """Inside the block, `draft_vocab_logits` gathers the draft vocabulary's LM-head rows once per drafter
    (again if the head changes) instead of on every call; the rows are dropped with the block, never kept on
    the drafter."""
    token = _DRAFT_HEADS.set({})
    try:
        yield
    finally:
        _DRAFT_HEADS.reset(token)


class DraftVocabulary:
    """The part of [`LaSpecDrafterModel`] that drafts over a draft vocabulary (`draft_vocab`, a buffer saved with
    the model; None: the full vocabulary)."""

    def set_draft_vocabulary(self, token_ids) -> DraftVocabulary:
        """Draft over `token_ids` only (e.g. the target's most frequent tokens, [`~hf_adaptive_spec.training.data.
        frequent_tokens`]); `None` restores the full vocabulary. Saved with the model (`draft_vocab` buffer)."""
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
            if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"draft vocabulary ids must be non-empty and lie in [0, {self.config.vocab_size}).")
            if token_ids.unique().numel() != token_ids.numel():
                raise ValueError("draft vocabulary ids must be distinct.")
            token_ids = token_ids.to(self.context_proj.weight.device)
        self.draft_vocab = token_ids  # a registered buffer: saved with the model unless None
        self.config.draft_vocab_size = None if token_ids is None else int(token_ids.numel())
        return self

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoding-time logits `(..., vocab_size)` from `last_hidden_state`: with a draft vocabulary, only its
        rows of the LM head are computed (a cached copy) and every other token gets -inf."""
        if self.draft_vocab is None:
            return self.logits_from_hidden(hidden)
        return spread_to_vocabulary(self.draft_vocab_logits(hidden), self.draft_vocab, self.config.vocab_size)

    def draft_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary only, `(..., draft_vocab_size)` in `draft_vocab` order: the LM head's
        rows of those tokens (held fixed; gradients reach `hidden` only). Training on them costs a fraction of
        the full head and matches decoding, where no other token can be drafted."""
        if self.draft_vocab is None:
            raise ValueError("draft_vocab_logits needs a draft vocabulary (set_draft_vocabulary).")
        lm_head = self.target_modules()[1]
        if not readable_head(lm_head):  # offloaded or sharded: the module's own forward, then the draft columns
            logits = lm_head(hidden)
            return logits[..., self.draft_vocab.to(logits.device)]
        weight = lm_head.weight
        key = (weight.data_ptr(), weight.device, weight.dtype, tensor_version(weight), self.draft_vocab.data_ptr())
        holder = _DRAFT_HEADS.get()  # inside `draft_head_cache` (a decoding call): id(self) -> cached rows
        cached = None if holder is None else holder.get(id(self))
        if cached is None or cached[0] != key:
            rows = weight.detach()[self.draft_vocab]
            bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()[self.draft_vocab]
            cached = (key, rows, bias, {})  # {}: the bf16 copy the decoding loop's CPU kernel may read
            if holder is not None:
                holder[id(self)] = cached
        _, rows, bias, compact = cached
        # F.linear outside the decoding loop; inside it on a CPU, the small-batch kernel over a bf16 copy
        return cpu_linear.compact_linear(hidden.to(rows.dtype), rows, bias, compact, self)

    def draft_vocab_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Each token's index in the draft vocabulary, -1 for tokens outside it (same shape as `token_ids`;
        -100 labels stay -1)."""
        if self.draft_vocab is None:
            raise ValueError("draft_vocab_index needs a draft vocabulary (set_draft_vocabulary).")
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        lookup[self.draft_vocab.to(token_ids.device)] = torch.arange(self.draft_vocab.numel(), device=token_ids.device)
        return torch.where(token_ids >= 0, lookup[token_ids.clamp_min(0)], -1)
