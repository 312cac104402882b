"""Branches hung under a tree's root beside the drafter's nodes: the context-lookup chain (draft tokens copied from
earlier in the sequence) and a datastore's chain (`drafters.datastore`), as `ContextBranch` and `StoreBranch`
for the builder (`trees.build`), with the tensor reference of each step (`context_lookup`, `add_chain`; the
host backend's are in `trees.host`).

Text often repeats what came before it: a function signature from the prompt,
a name, a list item's pattern, and (under greedy decoding of small models) whole
sentences. When the last `n` committed tokens (the pending root included)
occurred earlier, the tokens that followed that occurrence are a cheap guess at
what follows now ("prompt lookup decoding"). Measured teacher-forced on
SmolLM2-135M-Instruct's own greedy answers to the benchmark prompts (4-token
blocks), such a chain is accepted about as far as the trained LaSpec drafter's
(HumanEval 2.10 vs 1.94, MT-Bench 1.91 vs 1.42 tokens per round), and it is
often right where the drafter is wrong: the better of the two reaches 2.77 and
2.23. So the `laspec` strategy adds the chain to the drafter's tree (shared
prefixes merged), and the cost rule decides per round whether its nodes pay,
from their measured acceptance per match length.

Greedy decoding only: under sampling every draft node must be a draw from the
drafter's distribution for the acceptance rule to stay lossless.
"""

from __future__ import annotations

import torch

from .host import latest_match
from .tree import DraftTree

__all__ = ["MAX_LOOKUP_CODE", "STORE_CODE_OFFSET", "Committed", "ContextBranch", "StoreBranch", "add_chain",
           "context_lookup", "lookup_code", "store_code"]

#: a lookup node's `DraftTree.lookup` value names its source, the key under which the cost rule learns its
#: acceptance: context lookup 1..15 (the matched suffix length), datastore lookup
#: (`hf_adaptive_spec.drafters.datastore`) 17..31 (the node's support class, `store_code`)
STORE_CODE_OFFSET = 16
MAX_LOOKUP_CODE = 2 * STORE_CODE_OFFSET - 1


def lookup_code(match):
    """The `DraftTree.lookup` value of a context-lookup chain found by a suffix of length `match` (an int or a
    tensor; 0 = no chain stays 0)."""
    if isinstance(match, torch.Tensor):
        return match.clamp(0, STORE_CODE_OFFSET - 1)
    return max(0, min(int(match), STORE_CODE_OFFSET - 1))


def store_code(agreeing: int, voting: int) -> int:
    """The `DraftTree.lookup` value of a datastore node that `agreeing` of `voting` occurrences continue with
    (`TokenDatastore.propose_with_support`): 5 share classes (by fifths) x 3 support sizes (< 3, < 20, more)."""
    share = min(int(5 * agreeing / max(voting, 1)), 4)
    size = 0 if voting < 3 else 1 if voting < 20 else 2
    return STORE_CODE_OFFSET + 1 + 3 * share + size


def context_lookup(ids: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor, max_ngram: int,
                   num_tokens: int, min_ngram: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the tokens that followed the latest earlier occurrence of the row's longest matching suffix.

    Args:
        ids (`torch.LongTensor` of shape `(B, C)`): the rows' tokens; row b's real tokens are
            `ids[b, start[b] : lengths[b]]` (left padding before, filler after).
        lengths (`torch.LongTensor` of shape `(B,)`): end of each row (exclusive).
        start (`torch.LongTensor` of shape `(B,)`): first real token of each row.
        max_ngram / min_ngram (`int`): the suffix lengths tried, longest first.
        num_tokens (`int`): tokens proposed (K).

    Returns:
        `(tokens, valid, match)`: `tokens` `(B, K)` the proposal, `valid` `(B, K)` (a proposal stops at the
        row's end, and is empty without a match), `match` `(B,)` the suffix length matched (0: none).
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"context_lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}.")
    batch, width = ids.shape
    device = ids.device
    columns = torch.arange(width, device=device)
    found = torch.full((batch,), -1, dtype=torch.long, device=device)  # first proposed position
    match = torch.zeros(batch, dtype=torch.long, device=device)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= width:
            continue
        suffix = ids.gather(1, (lengths[:, None] - n + torch.arange(n, device=device)).clamp(0, width - 1))
        windows = ids.unfold(1, n, 1)  # (B, C - n + 1, n): window j covers j .. j + n - 1
        hit = (windows == suffix[:, None, :]).all(-1)
        j = columns[: width - n + 1]
        # inside the row, ending before its last token (the suffix itself), with the suffix inside the row too
        hit &= (j[None, :] >= start[:, None]) & (j[None, :] + n < lengths[:, None])
        hit &= (lengths - n >= start)[:, None]
        latest = torch.where(hit, j[None, :], -1).amax(-1)  # (B,)
        take = (found < 0) & (latest >= 0)
        found = torch.where(take, latest + n, found)
        match = torch.where(take, n, match)
    positions = found[:, None] + torch.arange(num_tokens, device=device)  # (B, K)
    valid = (found >= 0)[:, None] & (positions < lengths[:, None])
    tokens = torch.where(valid, ids.gather(1, positions.clamp(0, width - 1)), 0)
    return tokens, valid, match


def add_chain(tree: DraftTree, tokens: torch.Tensor, valid: torch.Tensor, match: torch.Tensor) -> DraftTree:
    """`tree` with a chain `tokens` `(B, K)` (`valid` `(B, K)`, a prefix per row) hung under each row's root.

    Where the chain's next token is already a child of the current node the node is shared, else a new node
    is appended (parents stay before children; siblings stay distinct). Every node on the chain gets `lookup` =
    the row's `match` (`(B,)`, the code of the chain, `lookup_code`; or `(B, K)`, one code per chain node), the
    others 0; appended nodes have drafter probability 0 (the drafter did not propose them) and no drafter slot,
    shared ones keep theirs.
    """
    if tree.draft_probs is not None:
        raise ValueError("add_chain: a sampled tree (draft_probs) cannot take lookup nodes (greedy only).")
    batch = tokens.shape[0]
    device = tokens.device
    lookup = tree.lookup.clone() if tree.lookup is not None else torch.zeros_like(tree.tokens)
    columns = {name: [getattr(tree, name)] for name in ("tokens", "parents", "valid", "probs", "cum_probs",
                                                         "depths", "drafter_slot")}
    columns["lookup"] = [lookup]
    all_tokens, all_parents, all_valid = tree.tokens, tree.parents, tree.valid
    current = torch.zeros(batch, dtype=torch.long, device=device)  # the root
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    num_levels = tree.num_levels
    per_node = match.dim() == 2
    for depth in range(1, tokens.shape[1] + 1):
        token = tokens[:, depth - 1]
        code = match[:, depth - 1] if per_node else match
        alive = alive & valid[:, depth - 1]
        existing = all_valid & (all_parents == current[:, None]) & (all_tokens == token[:, None])
        shared = existing.any(-1) & alive
        new = alive & ~shared
        if not bool(alive.any()):
            break
        found = existing.to(torch.int8).argmax(-1)  # a drafter node: nodes appended here have no children yet
        next_current = torch.where(shared, found, current)
        lookup.scatter_(1, found[:, None], torch.where(shared, code, lookup.gather(1, found[:, None])[:, 0])[:, None])
        if bool(new.any()):
            index = all_tokens.shape[1]
            added = {"tokens": torch.where(new, token, 0), "parents": torch.where(new, current, -1),
                     "valid": new, "probs": torch.zeros(batch, device=device),
                     "cum_probs": torch.zeros(batch, device=device), "depths": torch.where(new, depth, 0),
                     "drafter_slot": torch.full((batch,), -1, dtype=torch.long, device=device),
                     "lookup": torch.where(new, code, 0)}
            for name, value in added.items():
                columns[name].append(value[:, None].to(columns[name][0].dtype))
            all_tokens = torch.cat([all_tokens, added["tokens"][:, None]], dim=1)
            all_parents = torch.cat([all_parents, added["parents"][:, None]], dim=1)
            all_valid = torch.cat([all_valid, new[:, None]], dim=1)
            next_current = torch.where(new, index, next_current)
            num_levels = max(num_levels, depth)
        current = next_current
    if len(columns["tokens"]) == 1:
        return _replace(tree, lookup=lookup)
    merged = {name: torch.cat(parts, dim=1) for name, parts in columns.items()}
    return DraftTree(num_levels=num_levels, draft_probs=None, **merged)


def _replace(tree: DraftTree, **changes) -> DraftTree:
    fields = {name: getattr(tree, name) for name in tree.__dataclass_fields__}
    fields.update(changes)
    return DraftTree(**fields)


class Committed:
    """The committed rows a branch reads, root included (the loop's sequence buffer): `ids` `(B, C)`, `lengths`
    `(B,)` (each row's end), `start` `(B,)` (each row's first real token), and `max_depth` `(B,)` (the deepest
    level each row may draft: a branch's chain is cut there). `row()` is row 0's real tokens as a list, read
    once for every branch of a one-row tree (the host backend)."""

    def __init__(self, ids: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor, max_depth: torch.Tensor):
        self.ids, self.lengths, self.start, self.max_depth = ids, lengths, start, max_depth
        self._row = None

    def row(self) -> list[int]:
        if self._row is None:
            self._row = self.ids[0, int(self.start[0]):int(self.lengths[0])].tolist()
        return self._row

    def cut(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`valid` `(B, K)` of a chain, cut below each row's `max_depth`."""
        return valid & (torch.arange(1, tokens.shape[1] + 1, device=tokens.device)[None, :] <= self.max_depth[:, None])

    def depth(self) -> int:
        """Row 0's `max_depth` (at least 0)."""
        return max(int(self.max_depth[0]), 0)


class ContextBranch:
    """The context-lookup chain: the (up to `num_tokens`) tokens that followed the latest earlier occurrence of
    each row's longest matching suffix of up to `max_ngram` tokens, coded by the match length (`lookup_code`)."""

    def __init__(self, committed: Committed, max_ngram: int, num_tokens: int):
        self.committed, self.max_ngram, self.num_tokens = committed, max_ngram, num_tokens

    def tensors(self) -> tuple:
        """`(tokens (B, K), valid (B, K), codes (B,))`."""
        c = self.committed
        tokens, valid, match = context_lookup(c.ids, c.lengths, c.start, self.max_ngram, self.num_tokens)
        return tokens, c.cut(tokens, valid), lookup_code(match)

    def host(self) -> tuple:
        """Row 0's `(tokens, code)` as lists."""
        chain, match = latest_match(self.committed.row(), self.max_ngram, self.num_tokens)
        return chain[:self.committed.depth()], lookup_code(match)


class StoreBranch:
    """A datastore's chain for each row's longest matching suffix (`TokenDatastore.propose_batch`), each node
    coded by its support (`store_code`)."""

    def __init__(self, committed: Committed, datastore, num_tokens: int):
        self.committed, self.datastore, self.num_tokens = committed, datastore, num_tokens

    def tensors(self) -> tuple:
        """`(tokens (B, K), valid (B, K), codes (B, K))`."""
        c = self.committed
        tokens, valid, _, codes = self.datastore.propose_batch(c.ids, c.lengths, c.start, self.num_tokens)
        return tokens, c.cut(tokens, valid), codes

    def host(self) -> tuple:
        """Row 0's `(tokens, codes)` as lists."""
        depth = self.committed.depth()
        row = self.committed.row()
        chain, _, support = self.datastore.propose_with_support(row[-self.datastore.max_ngram:], self.num_tokens)
        return chain[:depth], [store_code(*pair) for pair in support[:depth]]
