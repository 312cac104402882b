"""Host (Python) versions of the per-round tree ops for ONE row on the CPU.

A decoding round at batch 1 verifies a tree of ~5-25 nodes. The torch references spend most of their time
on op overhead there (`ancestor_matrix` squares an N x N matrix log2(N) times; `greedy_accept` runs ~25
small ops, ~0.6 ms per round on a 2-core CPU), while walking the parent pointers in Python takes tens of
microseconds. Same arguments and results as `reference.py` (integers and masks, so equal exactly:
`tests/test_ops_host.py`); `ops` dispatches here for CPU tensors with batch 1.
"""

from __future__ import annotations

import struct

import torch

__all__ = ["ancestor_matrix", "tree_attention_mask", "greedy_accept"]


def _ancestor_rows(parents: list[int]) -> tuple[list[list[bool]], list[int]]:
    """Per node, the ancestor-or-self flags over all nodes, and the depths (parents come before children;
    -1 marks a root or a padding node)."""
    num_nodes = len(parents)
    rows, depths = [], []
    for node, parent in enumerate(parents):
        if 0 <= parent < node:
            row = rows[parent].copy()
            depths.append(depths[parent] + 1)
        else:
            row = [False] * num_nodes
            depths.append(0)
        row[node] = True
        rows.append(row)
    return rows, depths


def _check(parents: torch.Tensor) -> list[int]:
    if parents.shape[0] != 1 or parents.device.type != "cpu":
        raise ValueError(f"host ops take one CPU row; got a batch of {parents.shape[0]} on {parents.device}.")
    row = parents[0].tolist()
    if any(parent >= node for node, parent in enumerate(row)):
        raise ValueError("host ops need every parent to come before its child.")
    return row


def ancestor_matrix(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.ancestor_matrix` for `(1, N)` parents on the CPU."""
    rows, depths = _ancestor_rows(_check(parents))
    return (torch.tensor([rows], dtype=torch.bool).reshape(1, len(rows), len(rows)),
            torch.tensor([depths], dtype=torch.long))


def tree_attention_mask(parents: torch.Tensor, valid: torch.Tensor, slot_valid: torch.Tensor, dtype: torch.dtype,
                        num_query: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.tree_attention_mask` for one CPU row."""
    rows, depths = _ancestor_rows(_check(parents))
    num_nodes = len(rows)
    num_query = num_nodes if num_query is None else num_query
    real = valid[0].tolist()
    visible = [[flag and real[i] and real[j] or i == j for j, flag in enumerate(row)]
               for i, row in enumerate(rows[num_nodes - num_query:], start=num_nodes - num_query)]
    allowed = torch.cat([slot_valid.expand(num_query, -1), torch.tensor(visible, dtype=torch.bool).reshape(
        num_query, num_nodes)], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None], torch.tensor([depths], dtype=torch.long)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, target_choice: torch.Tensor,
                  max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.greedy_accept` for one CPU row: the deepest node whose path carries the target's choices
    (lowest index among equally deep ones), and its path."""
    parent_row = _check(parents)
    _, depths = _ancestor_rows(parent_row)
    token_row, real, choice = tokens[0].tolist(), valid[0].tolist(), target_choice[0].tolist()
    reachable = [True]
    best = 0
    for node in range(1, len(parent_row)):
        parent = parent_row[node]
        ok = real[node] and token_row[node] == choice[max(parent, 0)] and (parent < 0 or reachable[parent])
        reachable.append(ok)
        if ok and depths[node] > depths[best]:
            best = node
    path = [best]
    while parent_row[path[-1]] >= 0:
        path.append(parent_row[path[-1]])
    path.reverse()
    path_index = (path + [best] * (max_depth + 1 - len(path)))[: max_depth + 1]
    return (torch.tensor([path_index], dtype=torch.long), torch.tensor([depths[best]], dtype=torch.long),
            torch.tensor([choice[best]], dtype=target_choice.dtype))


_FLOAT32 = struct.Struct("f")


def float32(value: float) -> float:
    """`value` rounded to float32 (a product of two float32 values is exact in a double, so rounding it once
    gives the float32 product)."""
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
