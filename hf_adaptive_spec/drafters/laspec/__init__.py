"""The LaSpec block drafter (Uni-LaSpec, docs/algorithms.md section 2): its configuration, layers and model, what it
reads of the target (`context`), the target's embedding and LM head it uses (`target`), and its draft
vocabulary (`vocabulary`). `register_auto_classes` lets `AutoConfig` / `AutoModel` load "laspec_drafter"
folders."""

from .configuration import LaSpecDrafterConfig, default_target_layer_ids
from .context import ContextKV, gather_target_hidden, make_block_inputs
from .modeling import LaSpecDrafterModel, LaSpecDrafterOutput, register_auto_classes
from .target import attached_for_call
from .vocabulary import draft_head_cache, spread_to_vocabulary

__all__ = [
    "ContextKV",
    "LaSpecDrafterConfig",
    "LaSpecDrafterModel",
    "LaSpecDrafterOutput",
    "attached_for_call",
    "default_target_layer_ids",
    "draft_head_cache",
    "gather_target_hidden",
    "make_block_inputs",
    "register_auto_classes",
    "spread_to_vocabulary",
]
