"""The drafter for one `generate` call, from its `assistant_model`: the one place that tells drafter kinds apart."""

from __future__ import annotations

import contextlib

from ..adapters.compat import check_model
from .base import Drafter, PendingOnly
from .block import BlockDrafter
from .independent import IndependentDrafter
from .laspec import LaSpecDrafterModel, attached_for_call, draft_head_cache

__all__ = ["make_drafter"]


def make_drafter(assistant_model, target, strategy_class, config, scope: contextlib.ExitStack,
                 host_trees: bool = True) -> Drafter:
    """The `Drafter` that drafts with `assistant_model` for `target` in this call.

    A `LaSpecDrafterModel` becomes a `BlockDrafter` on the target's embedding and LM head for this call only
    (`attached_for_call`, entered on `scope` with the drafter's head caches); its settings come from the
    strategy's config (`StrategyConfig.block_drafter_options`). Any other model is an `IndependentDrafter`.

    Args:
        assistant_model: what `generate` got as `assistant_model`.
        target: the verifier.
        strategy_class (`type[Strategy]`): the call's strategy (some draft with a block drafter only).
        config (`StrategyConfig`): its resolved settings.
        scope (`contextlib.ExitStack`): closed when the call ends, normally or by an exception.
        host_trees (`bool`): a block drafter may build batch-1 trees with host lists (`RuntimeConfig.host_trees`).
    """
    if strategy_class.drafts_nothing:  # `plain`: rounds of the pending token alone
        return PendingOnly()
    if not isinstance(assistant_model, LaSpecDrafterModel):
        if strategy_class.requires_block_drafter:
            raise ValueError(
                f"spec_strategy={strategy_class.name!r} drafts with a LaSpecDrafterModel "
                "(hf_adaptive_spec.LaSpecDrafterModel, e.g. trained by `hf-adaptive-spec train-drafter`); got "
                f"{type(assistant_model).__name__}."
            )
        check_model(assistant_model, "drafter")
        return IndependentDrafter(assistant_model, target, **config.independent_drafter_options())
    if config.independent_drafter_options():
        raise ValueError(f"spec_config visual_tokens selects what an independent VLM drafter sees; a LaSpec drafter's "
                         f"visual tokens are set by its own `num_visual_tokens` (spec_strategy='laspec').")
    options = {"host_trees": host_trees, **config.block_drafter_options()}
    options["datastore"] = _datastore(assistant_model, options.get("datastore", False))
    scope.enter_context(attached_for_call(assistant_model, target))
    drafter = BlockDrafter(assistant_model, target, **options)
    scope.enter_context(draft_head_cache())
    return drafter


def _datastore(model: LaSpecDrafterModel, wanted: bool | None):
    """The datastore a block drafter adds to its trees: the drafter's own (`LaSpecDrafterModel.datastore`)
    unless `wanted` is False; True insists that the drafter carries one."""
    store = model.datastore
    if wanted is True and store is None:
        raise ValueError("spec_config datastore=True, but the drafter carries no datastore (load one from a folder "
                         "with datastore.safetensors, or `drafter.set_datastore(TokenDatastore...)`).")
    return None if wanted is False else store
