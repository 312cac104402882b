"""Datastore lookup: draft tokens retrieved from a corpus of the target's own answers (REST-style retrieval).

Context lookup (`hf_adaptive_spec.trees.branches`) only finds what the sequence itself
already said. A small target's answers also repeat each other: the same
openings, list patterns, transitions and closing lines across requests. A
`TokenDatastore` holds token sequences (e.g. the target's greedy answers to
training prompts, never the benchmark's); for the committed tokens' longest
suffix of length `min_ngram..max_ngram` that occurs in it, it proposes the
continuation most of those occurrences share (token by token: the most common
next token, then the most common one after it among the occurrences that
agree so far, ...). The `laspec` strategy hangs it under the root as one more
branch of the tree, next to the drafter's nodes and the context-lookup chain;
the cost rule keeps its nodes when their measured acceptance pays, learned per
support class (the share of voting occurrences that agree, and how many vote:
`branches.store_code`), so a store that does not help costs little more than one
look-up per round (the index, 12 bytes per token and n-gram length, is built
on the first query; costs in docs/laspec.md).

Greedy decoding only, like context lookup: the target verifies every node, so
outputs never change; a sampled tree must consist of drafter draws.

Index: for every n, the sorted 62-bit keys (two polynomial hashes mod 2^31 - 1)
of all n-token windows that lie inside one sequence and have a next token,
with the window's end. A query is a binary search per n; two different windows
sharing a key (odds ~N^2 / 2^62) would only propose a worse chain.

Files: `save` / `load` write and read one safetensors file with the tokens
(int32, sequences separated by -1) and the settings as metadata; a LaSpec
drafter folder carries it as `datastore.safetensors` (`LaSpecDrafterModel`
loads and saves it with its weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["DATASTORE_FILE", "TokenDatastore"]

DATASTORE_FILE = "datastore.safetensors"

_P = 2**31 - 1
_B1, _B2 = 1_000_003, 999_331


class TokenDatastore:
    """Token sequences indexed by their n-grams, proposing the shared continuation of a suffix.

    Args:
        tokens (`torch.Tensor` of shape `(N,)`): the sequences' token ids, each sequence followed by -1.
        min_ngram / max_ngram (`int`): suffix lengths matched, longest first (defaults 2 and 8).
        max_occurrences (`int`): occurrences voted on per query at most (evenly spaced over all of them;
            default 256), which bounds a query's cost.
        info (`dict`, *optional*): free-form provenance (what the sequences are), saved with the store.

    Examples:
        >>> store = TokenDatastore.from_sequences([[5, 6, 7, 8], [1, 6, 7, 9], [2, 6, 7, 8]], min_ngram=1)
        >>> store.propose([3, 6, 7], num_tokens=2)
        ([8], 2)
    """

    def __init__(self, tokens: torch.Tensor, min_ngram: int = 2, max_ngram: int = 8, max_occurrences: int = 256,
                 info: dict | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"TokenDatastore needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}.")
        if max_occurrences < 1:
            raise ValueError(f"TokenDatastore.max_occurrences must be >= 1, got {max_occurrences}.")
        tokens = torch.as_tensor(tokens).to("cpu", torch.long).flatten()
        if tokens.numel() and int(tokens.min()) < -1:
            raise ValueError("TokenDatastore tokens must be ids >= 0, with -1 between sequences.")
        if tokens.numel() and int(tokens[-1]) != -1:
            tokens = torch.cat([tokens, tokens.new_tensor([-1])])
        self.tokens = tokens
        self.min_ngram = int(min_ngram)
        self.max_ngram = int(max_ngram)
        self.max_occurrences = int(max_occurrences)
        self.info = dict(info or {})
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._padded: torch.Tensor | None = None
        self._padding = 0

    # ---- construction, files

    @classmethod
    def from_sequences(cls, sequences, **kwargs) -> TokenDatastore:
        """A store of `sequences` (lists or 1D tensors of token ids)."""
        parts = []
        for sequence in sequences:
            ids = torch.as_tensor(sequence, dtype=torch.long).flatten()
            if ids.numel() and int(ids.min()) < 0:
                raise ValueError("TokenDatastore.from_sequences: token ids must be >= 0.")
            parts += [ids, torch.tensor([-1])]
        return cls(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long), **kwargs)

    def save(self, path) -> Path:
        """Write the store to one safetensors file (tokens as int32, settings and `info` as metadata)."""
        from safetensors.torch import save_file

        path = Path(path)
        metadata = {"format": "hf_adaptive_spec.TokenDatastore", "min_ngram": str(self.min_ngram),
                    "max_ngram": str(self.max_ngram), "max_occurrences": str(self.max_occurrences),
                    "info": json.dumps(self.info)}
        save_file({"tokens": self.tokens.to(torch.int32).contiguous()}, str(path), metadata=metadata)
        return path

    @classmethod
    def load(cls, path) -> TokenDatastore:
        """A store written by [`save`]."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != "hf_adaptive_spec.TokenDatastore":
                raise ValueError(f"{path} is not a TokenDatastore file (metadata format "
                                 f"{metadata.get('format')!r}).")
            tokens = handle.get_tensor("tokens")
        return cls(tokens, min_ngram=int(metadata["min_ngram"]), max_ngram=int(metadata["max_ngram"]),
                   max_occurrences=int(metadata["max_occurrences"]), info=json.loads(metadata.get("info", "{}")))

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def __repr__(self) -> str:
        sequences = int((self.tokens == -1).sum())
        return (f"TokenDatastore({sequences} sequences, {len(self) - sequences} tokens, "
                f"n-grams {self.min_ngram}..{self.max_ngram})")

    # ---- index

    def _build(self) -> None:
        tokens = self.tokens
        count = tokens.numel()
        index = {}
        # the hashes of all n-token windows, extended by one token per n (window j covers j .. j + n - 1)
        h1 = torch.zeros(count, dtype=torch.long)
        h2 = torch.zeros(count, dtype=torch.long)
        inside = torch.ones(count, dtype=torch.bool)
        for n in range(1, self.max_ngram + 1):
            windows = max(count - n, 0)  # a window also needs a next token, at j + n
            column = tokens[n - 1 : n - 1 + windows]
            h1 = (h1[:windows] * _B1 + column + 1) % _P
            h2 = (h2[:windows] * _B2 + column + 1) % _P
            inside = inside[:windows] & (column >= 0)
            if n < self.min_ngram:
                continue
            ends = torch.arange(n, n + windows)
            keep = inside & (tokens[ends] >= 0)
            keys, order = torch.sort((h1 * _P + h2)[keep], stable=True)  # equal keys keep corpus order
            index[n] = (keys, ends[keep][order].to(torch.int32))  # 12 bytes per window and n
        self._index = index

    @staticmethod
    def _key(ngram: list[int]) -> int:
        h1 = h2 = 0
        for token in ngram:
            h1 = (h1 * _B1 + token + 1) % _P
            h2 = (h2 * _B2 + token + 1) % _P
        return h1 * _P + h2

    def _continuations(self, num_tokens: int) -> torch.Tensor:
        if self._padded is None or self._padding < num_tokens:
            self._padding = max(num_tokens, 16)
            self._padded = torch.cat([self.tokens, torch.full((self._padding,), -1, dtype=torch.long)])
        return self._padded

    # ---- queries

    def occurrences(self, ngram: list[int]) -> torch.Tensor:
        """Positions right after every occurrence of `ngram` (its length within `min_ngram..max_ngram`), in corpus
        order."""
        n = len(ngram)
        if not self.min_ngram <= n <= self.max_ngram:
            raise ValueError(f"occurrences: an n-gram of length {n} is outside {self.min_ngram}..{self.max_ngram}.")
        if self._index is None:
            self._build()
        keys, ends = self._index[n]
        key = torch.tensor([self._key(ngram)])
        lo = int(torch.searchsorted(keys, key))
        hi = int(torch.searchsorted(keys, key, right=True))
        return ends[lo:hi].long()

    def propose(self, row, num_tokens: int) -> tuple[list[int], int]:
        """`(tokens, n)`: up to `num_tokens` tokens continuing `row` (its committed ids, root last), from the
        occurrences of its longest suffix of length n found in the store; `([], 0)` when none is found."""
        chain, n, _ = self.propose_with_support(row, num_tokens)
        return chain, n

    def propose_with_support(self, row, num_tokens: int) -> tuple[list[int], int, list[tuple[int, int]]]:
        """[`propose`] plus each proposed token's support `(agreeing, voting)`: of the `voting` occurrences that
        agree with the chain so far and continue, `agreeing` continue with this token. The share predicts
        acceptance far better than n (docs/laspec.md), so the cost rule learns datastore nodes per support class
        (`branches.store_code`)."""
        row = row.tolist() if isinstance(row, torch.Tensor) else list(row)
        if num_tokens < 1:
            return [], 0, []
        for n in range(min(self.max_ngram, len(row)), self.min_ngram - 1, -1):
            ends = self.occurrences(row[len(row) - n :])
            if ends.numel() == 0:
                continue
            if ends.numel() > self.max_occurrences:
                ends = ends[torch.linspace(0, ends.numel() - 1, self.max_occurrences).round().long()]
            padded = self._continuations(num_tokens)
            following = padded[ends[:, None].long() + torch.arange(num_tokens)]  # (O, K), -1 past a sequence's end
            alive = torch.ones(following.shape[0], dtype=torch.bool)
            chain, support = [], []
            for depth in range(num_tokens):
                column = following[:, depth][alive]
                column = column[column >= 0]
                if column.numel() == 0:
                    break
                values, counts = torch.unique(column, return_counts=True)  # sorted: ties go to the smaller id
                best = int(counts.argmax())
                token = int(values[best])
                chain.append(token)
                support.append((int(counts[best]), int(column.numel())))
                alive &= following[:, depth] == token
            return chain, n, support
        return [], 0, []

    def propose_batch(self, ids: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[`propose`] per row of committed ids (the layout of `branches.context_lookup`): `(tokens (B, K),
        valid (B, K), match (B,), codes (B, K))` on `ids`'s device; `codes` are the nodes' support classes
        (`branches.store_code`; 0 where invalid)."""
        from ..trees.branches import store_code

        batch = ids.shape[0]
        tokens = torch.zeros(batch, num_tokens, dtype=torch.long)
        valid = torch.zeros(batch, num_tokens, dtype=torch.bool)
        match = torch.zeros(batch, dtype=torch.long)
        codes = torch.zeros(batch, num_tokens, dtype=torch.long)
        for b, (lo, hi) in enumerate(zip(start.tolist(), lengths.tolist())):
            row = ids[b, max(lo, hi - self.max_ngram):hi].tolist()  # only the longest suffix tried is read
            chain, n, support = self.propose_with_support(row, num_tokens)
            tokens[b, : len(chain)] = torch.tensor(chain, dtype=torch.long)
            valid[b, : len(chain)] = True
            match[b] = n
            codes[b, : len(chain)] = torch.tensor([store_code(*pair) for pair in support], dtype=torch.long)
        device = ids.device
        return tokens.to(device), valid.to(device), match.to(device), codes.to(device)
