"""The committed sequences, logits processors applied per tree node, and exact stopping.

Plain `generate` applies its logits processors to the scores of one step
with the sequence so far as `input_ids`, and checks its stopping criteria
after every token. Here a tree node's "sequence so far" is its row's
committed tokens plus the path to the node, and the tokens of one round are
checked one by one, so speculation changes neither.
"""

from __future__ import annotations

import torch
from transformers.generation import logits_process
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


class SequenceBuffer:
    """Committed tokens of every row, laid out as `generate`'s `input_ids` (left padding kept).

    Args:
        input_ids (`torch.LongTensor` of shape `(B, L0)`): the prompt batch.
        capacity (`int`): the longest a row may grow (generation_config.max_length).
        pad_token_id (`int`): filler after a row's end, as plain generate pads finished rows.
    """

    def __init__(self, input_ids: torch.Tensor, capacity: int, pad_token_id: int):
        batch, prompt_length = input_ids.shape
        self.ids = torch.full((batch, max(capacity, prompt_length) + 1), pad_token_id, dtype=torch.long,
                              device=input_ids.device)
        self.ids[:, :prompt_length] = input_ids
        self.lengths = torch.full((batch,), prompt_length, dtype=torch.long, device=input_ids.device)
        self.prompt_length = prompt_length

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first `counts[b]` of `tokens[b]` `(B, K)` to each row."""
        width = tokens.shape[1]
        columns = self.lengths[:, None] + torch.arange(width, device=tokens.device)  # (B, K)
        keep = torch.arange(width, device=tokens.device)[None, :] < counts[:, None]
        columns = torch.where(keep, columns, self.ids.shape[1] - 1).clamp_max(self.ids.shape[1] - 1)
        current = self.ids.gather(1, columns)
        self.ids.scatter_(1, columns, torch.where(keep, tokens, current))
        self.lengths += counts

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` `(B',)` only, in that order."""
        self.ids, self.lengths = self.ids[rows], self.lengths[rows]

    def sequences(self) -> torch.Tensor:
        """`(B, max length)`: the rows, right-filled with the pad token like plain generate's output."""
        return self.ids[:, : int(self.lengths.max())].clone()


# Processors whose output for a row depends only on that row's input_ids and scores: their calls can pack
# queries of any rows together. Everything else (per-row state such as repetition penalty's padding
# lengths, prefix_allowed_tokens_fn's batch_id, classifier-free guidance) gets row-aligned calls.
_ROW_FREE = tuple(
    getattr(logits_process, name)
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "TopHLogitsWarper", "MinPLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "NoRepeatNGramLogitsProcessor",
        "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "SuppressTokensLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor", "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
        "LogitNormalization", "ExponentialDecayLengthPenalty", "RepetitionPenaltyLogitsProcessor",
    )
    if hasattr(logits_process, name)
)


def row_free(processors) -> bool:
    for processor in processors:
        if not isinstance(processor, _ROW_FREE):
            return False
        if isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor):
            return False
    return True


def _query_ids(buffer, paths, depths, rows, cols, total):
    """`(G, total)` input_ids: each query's committed row followed by its path."""
    ids = buffer.ids[rows].clone()  # (G, width)
    if paths.shape[-1] > 0:
        path = paths[rows, cols]  # (G, D)
        offsets = torch.arange(path.shape[1], device=ids.device)
        positions = buffer.lengths[rows, None] + offsets
        inside = (offsets[None, :] < depths[rows, cols][:, None]) & (positions < ids.shape[1])
        ids.scatter_(1, torch.where(inside, positions, 0), torch.where(inside, path, ids[:, :1].expand_as(path)))
    return ids[:, :total]


def process_logits(processors, buffer: SequenceBuffer, paths, depths, logits, valid):
    """Apply `processors` to every query's logits with its own prefix as `input_ids`.

    Each call sees one input length, so length-dependent processors behave as in plain generate.
    Processors with per-row state are called with batches aligned to the generate batch: position b
    holds a query of row b (or a discarded filler).

    Args:
        processors (`LogitsProcessorList`): generate's prepared processors.
        buffer (`SequenceBuffer`): committed tokens.
        paths (`torch.LongTensor` of shape `(B, X, D)`): tokens from depth 1 to each query (-1 past its depth).
        depths (`torch.LongTensor` of shape `(B, X)`): path length per query.
        logits (`torch.FloatTensor` of shape `(B, X, V)`): raw logits per query.
        valid (`torch.BoolTensor` of shape `(B, X)`): queries to process.

    Returns:
        `torch.FloatTensor` of shape `(B, X, V)`; untouched where not valid.
    """
    if len(processors) == 0:
        return logits
    out = logits.clone()
    totals = buffer.lengths[:, None] + depths  # (B, X) length of each query's input_ids
    packable = row_free(processors)
    batch = logits.shape[0]
    for total in torch.unique(totals[valid]).tolist():
        selected = valid & (totals == total)
        if packable:
            rows, cols = torch.nonzero(selected, as_tuple=True)
            ids = _query_ids(buffer, paths, depths, rows, cols, total)
            out[rows, cols] = processors(ids, logits[rows, cols])
            continue
        rank = selected.cumsum(-1) - 1
        filler_row, filler_col = (int(i) for i in torch.nonzero(selected)[0])
        arange = torch.arange(batch, device=logits.device)
        for call in range(int(selected.sum(-1).max())):
            here = selected & (rank == call)  # (B, X): at most one query per row
            has = here.any(-1)
            cols = torch.where(has, here.to(torch.int8).argmax(-1), filler_col)
            rows = torch.where(has, arange, filler_row)
            ids = _query_ids(buffer, paths, depths, rows, cols, total)
            result = processors(ids, logits[rows, cols])
            out[arange[has], cols[has]] = result[has]
    return out


class StopChecker:
    """Cuts each row's new tokens exactly where plain generate would have stopped."""

    def __init__(self, stopping_criteria, eos_token_id: torch.Tensor | None, max_length: int):
        self.criteria = stopping_criteria
        self.eos = eos_token_id
        self.max_length = max_length
        # EOS and max length are handled in bulk; anything else is asked after every single token
        self.per_token = any(not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria)

    def cut(self, buffer: SequenceBuffer, tokens: torch.Tensor, counts: torch.Tensor):
        """Return `(counts, finished)` for candidate `tokens` `(B, K)` with `counts` `(B,)` real ones."""
        counts = torch.minimum(counts, (self.max_length - buffer.lengths).clamp_min(0))
        finished = buffer.lengths + counts >= self.max_length
        index = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        if self.eos is not None:
            is_eos = torch.isin(tokens, self.eos.to(tokens.device)) & (index < counts[:, None])
            has_eos = is_eos.any(-1)
            counts = torch.where(has_eos, is_eos.to(torch.int8).argmax(-1) + 1, counts)
            finished |= has_eos
        if self.per_token:
            counts, finished = self._cut_per_token(buffer, tokens, counts, finished)
        return counts, finished

    def _cut_per_token(self, buffer, tokens, counts, finished):
        counts, finished = counts.clone(), finished.clone()
        for row in range(tokens.shape[0]):
            length = int(buffer.lengths[row])
            for j in range(1, int(counts[row]) + 1):
                ids = torch.cat([buffer.ids[row, :length], tokens[row, :j]])[None]
                if bool(self.criteria(ids, None)[0]):
                    counts[row], finished[row] = j, True
                    break
        return counts, finished
