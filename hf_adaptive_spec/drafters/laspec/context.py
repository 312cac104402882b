"""What the LaSpec drafter reads of the target: the fused hidden states of a few target layers
(`gather_target_hidden`), the block inputs `[last accepted token, MASK, ...]` (`make_block_inputs`), and the
context's keys and values built once per committed position (`ContextKV`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ContextKV", "gather_target_hidden", "make_block_inputs"]


def gather_target_hidden(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the chosen target layers.

    Args:
        hidden_states (tuple of `torch.Tensor` of shape `(B, S, H)`): `outputs.hidden_states` of a target
            forward with `output_hidden_states=True` (entry 0 = embeddings, entry l + 1 = layer l).
        layer_ids (`list[int]`): target decoder-layer indices (`config.target_layer_ids`).

    Returns:
        `torch.Tensor` of shape `(B, S, len(layer_ids) * H)`.
    """
    return torch.cat([hidden_states[layer + 1] for layer in layer_ids], dim=-1)


def make_block_inputs(
    last_token: torch.Tensor, last_position: torch.Tensor, block_size: int, mask_token_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `[last accepted token, MASK, ...]` and its positions.

    Args:
        last_token (`torch.LongTensor` of shape `(B,)`): the last accepted (or bonus) token per row.
        last_position (`torch.LongTensor` of shape `(B,)`): its text position.
        block_size (`int`): block length.
        mask_token_id (`int`, *optional*): id written in the MASK columns (0 if None; never read).

    Returns:
        `(input_ids, position_ids)`, both `(B, block_size)`.
    """
    offsets = torch.arange(block_size, device=last_token.device)
    input_ids = torch.full((last_token.shape[0], block_size), mask_token_id or 0, dtype=torch.long,
                           device=last_token.device)
    input_ids[:, 0] = last_token
    position_ids = last_position[:, None] + offsets  # (B, block)
    return input_ids, position_ids


@dataclass
class ContextKV:
    """The context's keys (post-RoPE) and values in every drafter layer, `(B, H_kv, C, D)` each.

    Every round of a decoding loop would recompute them from the same encoded context; a loop builds them
    once per committed position ([`LaSpecDrafterModel.context_kv`]) and extends them ([`extend`]).
    """

    keys: list
    values: list

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def keep_rows(self, rows: torch.Tensor) -> ContextKV:
        return ContextKV([k[rows] for k in self.keys], [v[rows] for v in self.values])

    def extend(self, other: ContextKV) -> ContextKV:
        return ContextKV([torch.cat([a, b], dim=2) for a, b in zip(self.keys, other.keys)],
                         [torch.cat([a, b], dim=2) for a, b in zip(self.values, other.values)])
