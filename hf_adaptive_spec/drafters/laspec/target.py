"""The target's modules a LaSpec drafter uses: its input embedding and LM head, attached as plain references
(`TargetModules.attach_target`), or for one decoding call only (`attached_for_call`); the LM head applied with
its weights held fixed (`fixed_head`)."""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from ...ops import cpu_linear

__all__ = ["TargetModules", "attached_for_call", "fixed_head", "readable_head"]


# the target modules a drafter uses in this context's decoding call: id(drafter) -> (embedding, lm_head)
_CALL_TARGETS = contextvars.ContextVar("hf_adaptive_spec_call_targets", default=None)


@contextlib.contextmanager
def attached_for_call(drafter, target):
    """Inside the block, in this context only, `drafter` uses `target`'s embedding and LM head, whatever it is
    attached to (nothing, another target): the drafter object itself is never changed, so other threads using
    it, and the caller after the block, see it as it was."""
    modules = drafter._checked_target_modules(target)
    token = _CALL_TARGETS.set({**(_CALL_TARGETS.get() or {}), id(drafter): modules})
    try:
        yield drafter
    finally:
        _CALL_TARGETS.reset(token)


def readable_head(lm_head: nn.Module) -> bool:
    """Whether `lm_head` is an `nn.Linear` whose weight can be read directly: a plain tensor, not on the meta
    device, and no accelerate hook (which brings offloaded weights in and moves inputs only around a call). A
    tensor-parallel head holds a shard (a DTensor); such heads are called as modules instead."""
    if not isinstance(lm_head, nn.Linear) or getattr(lm_head, "_hf_hook", None) is not None:
        return False
    weight = lm_head.weight
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.device.type != "meta"


def fixed_head(hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """Target LM head with its weights held fixed (gradients reach `hidden` only)."""
    if readable_head(lm_head):
        weight = lm_head.weight.detach()
        bias = None if lm_head.bias is None else lm_head.bias.detach()
        return cpu_linear.linear(hidden.to(weight.dtype), weight, bias)
    return lm_head(hidden)


class TargetModules:
    """The part of [`LaSpecDrafterModel`] that holds and checks the target's embedding and LM head (never
    sub-modules: not saved, not moved)."""

    def attach_target(self, target) -> TargetModules:
        """Use `target`'s input embedding and LM head (frozen, not stored in this model's checkpoint).

        Args:
            target (`PreTrainedModel`): the verifier (LM or VLM); its text vocabulary must match `config.vocab_size`.

        Returns:
            `self`, for chaining.
        """
        self.__dict__["_target_modules"] = self._checked_target_modules(target)
        return self

    def _checked_target_modules(self, target) -> tuple:
        """`(embedding, lm_head)` of `target`, checked against this drafter's config."""
        embedding, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embedding is None or lm_head is None:
            raise ValueError("attach_target needs a target with both input embeddings and an LM head.")
        if embedding.weight.shape[1] != self.config.target_hidden_size:
            raise ValueError(
                f"The target's embedding width {embedding.weight.shape[1]} differs from "
                f"config.target_hidden_size={self.config.target_hidden_size}."
            )
        if lm_head.weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"The target's LM head has {lm_head.weight.shape[0]} outputs but config.vocab_size="
                f"{self.config.vocab_size}."
            )
        return embedding, lm_head

    def _target_pair(self):
        """The target's (embedding, lm_head): those of the calling context's decoding call (`attached_for_call`),
        else those set by `attach_target`, else None."""
        called = _CALL_TARGETS.get()
        if called is not None and id(self) in called:
            return called[id(self)]
        return self.__dict__.get("_target_modules")

    @property
    def has_target(self) -> bool:
        return self._target_pair() is not None

    def target_modules(self):
        modules = self._target_pair()
        if modules is None:
            raise RuntimeError(
                "LaSpecDrafterModel has no token embedding / LM head: they are the target's own modules and are "
                "not stored in the drafter checkpoint. Call `drafter.attach_target(target_model)` first."
            )
        return modules

    def get_input_embeddings(self):
        modules = self._target_pair()
        return None if modules is None else modules[0]

    def get_output_embeddings(self):
        modules = self._target_pair()
        return None if modules is None else modules[1]

    def set_input_embeddings(self, value):
        raise NotImplementedError("The drafter uses the target's embedding: call attach_target(target).")

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (held fixed) over `last_hidden_state` rows `(..., target_hidden_size)`."""
        return fixed_head(hidden, self.target_modules()[1])
