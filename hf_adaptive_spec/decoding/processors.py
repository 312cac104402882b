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
        self.pad_token_id = pad_token_id

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

    def join(self, other: SequenceBuffer) -> None:
        """`other`'s rows follow this buffer's (a serving batch admits them); the wider capacity is kept. Each row's
        ids stay as its own call laid them out (`prompt_length` is this buffer's)."""
        width = max(self.ids.shape[1], other.ids.shape[1])
        parts = [torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=self.pad_token_id)
                 for ids in (self.ids, other.ids)]
        self.ids, self.lengths = torch.cat(parts), torch.cat([self.lengths, other.lengths])

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
    """Cuts each row's new tokens exactly where plain generate would have stopped.

    `max_length` is one length for the batch, or `(B,)` per row; `eos_token_id` `(E,)` for the batch, or `(B, E)`
    per row (-1 where a row has fewer): a serving batch joins rows of requests with their own limits (`join`).
    """

    def __init__(self, stopping_criteria, eos_token_id: torch.Tensor | None, max_length):
        self.criteria = stopping_criteria
        self.eos = eos_token_id
        self.max_length = max_length
        # EOS and max length are handled in bulk; anything else is asked after every single token
        self.per_token = any(not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria)

    def _per_row(self, batch_size: int, device) -> tuple:
        """`(max_length (B,), eos (B, E))` of this checker's rows."""
        max_length = self.max_length
        if not isinstance(max_length, torch.Tensor):
            max_length = torch.full((batch_size,), int(max_length), dtype=torch.long, device=device)
        eos = self.eos if self.eos is not None else torch.empty(0, dtype=torch.long, device=device)
        if eos.dim() < 2:
            eos = eos.to(device).reshape(1, -1).expand(batch_size, -1)
        return max_length, eos

    def join(self, other: StopChecker, batch_size: int, other_batch_size: int, device) -> None:
        """`other`'s rows follow this checker's, each keeping its own limits (EOS and max length only: criteria
        checked token by token belong to one call)."""
        if self.per_token or other.per_token:
            raise ValueError("rows whose stopping criteria are checked token by token (stop strings, custom "
                             "criteria) cannot join a batch of other requests.")
        lengths, eos = self._per_row(batch_size, device)
        other_lengths, other_eos = other._per_row(other_batch_size, device)
        width = max(eos.shape[1], other_eos.shape[1])
        eos, other_eos = (torch.nn.functional.pad(e, (0, width - e.shape[1]), value=-1) for e in (eos, other_eos))
        self.max_length = torch.cat([lengths, other_lengths])
        self.eos = torch.cat([eos, other_eos])

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the limits of rows `rows` `(B',)` only (per-row limits; batch-wide ones stay)."""
        if isinstance(self.max_length, torch.Tensor):
            self.max_length = self.max_length[rows]
        if self.eos is not None and self.eos.dim() == 2:
            self.eos = self.eos[rows]

    def stop_tokens(self, batch_size: int, device) -> torch.Tensor | None:
        """`(B, E)` each row's EOS ids (-1 padding), or None without any: a drafted one ends its path."""
        if self.eos is None or self.eos.numel() == 0:
            return None
        return self._per_row(batch_size, device)[1]

    def room(self, buffer: SequenceBuffer) -> torch.Tensor:
        """`(B,)` tokens each row may still append."""
        return (self.max_length - buffer.lengths).clamp_min(0)

    def cut(self, buffer: SequenceBuffer, tokens: torch.Tensor, counts: torch.Tensor):
        """Return `(counts, finished, stopped)` for candidate `tokens` `(B, K)` with `counts` `(B,)` real ones;
        `stopped` `(B,)`: rows that end on an EOS token or a stopping criterion (the others that finish reached
        their length limit)."""
        counts = torch.minimum(counts, self.room(buffer))
        finished = buffer.lengths + counts >= self.max_length
        stopped = torch.zeros_like(finished)
        index = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        if self.eos is not None:
            if self.eos.dim() == 2:  # each row its own EOS ids
                is_eos = (tokens[:, :, None] == self.eos.to(tokens.device)[:, None, :]).any(-1)
            else:
                is_eos = torch.isin(tokens, self.eos.to(tokens.device))
            is_eos &= index < counts[:, None]
            stopped = is_eos.any(-1)
            counts = torch.where(stopped, is_eos.to(torch.int8).argmax(-1) + 1, counts)
            finished |= stopped
        if self.per_token:
            counts, finished, stopped = self._cut_per_token(buffer, tokens, counts, finished, stopped)
        return counts, finished, stopped

    def _cut_per_token(self, buffer, tokens, counts, finished, stopped):
        counts, finished, stopped = counts.clone(), finished.clone(), stopped.clone()
        for row in range(tokens.shape[0]):
            length = int(buffer.lengths[row])
            for j in range(1, int(counts[row]) + 1):
                ids = torch.cat([buffer.ids[row, :length], tokens[row, :j]])[None]
                if bool(self.criteria(ids, None)[0]):
                    counts[row], finished[row], stopped[row] = j, True, True
                    break
        return counts, finished, stopped


class RowProcessors:
    """Logits processors by row. One call's rows share its list; a serving batch whose rows came from different
    requests applies each request's own list to its rows only (`join`).

    Args:
        processors (`LogitsProcessorList`): the call's prepared processors.
        batch_size (`int`): rows of the call.
        device: where the row masks live.
    """

    def __init__(self, processors, batch_size: int, device):
        # (rows (B,) bool, processors) per list that has processors
        self.groups = [(torch.ones(batch_size, dtype=torch.bool, device=device), processors)] if len(processors) else []
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self.groups)

    def apply(self, buffer: SequenceBuffer, paths, depths, logits, valid):
        """`process_logits` with each group's processors on its rows' queries; other rows' logits unchanged."""
        for rows, processors in self.groups:
            logits = process_logits(processors, buffer, paths, depths, logits, valid & rows[:, None])
        return logits

    def join(self, other: RowProcessors) -> None:
        """`other`'s rows follow this batch's, with their own processors."""
        def widen(rows, before, after):
            return torch.cat([rows.new_zeros(before), rows, rows.new_zeros(after)])

        self.groups = ([(widen(rows, 0, other.batch_size), p) for rows, p in self.groups]
                       + [(widen(rows, self.batch_size, 0), p) for rows, p in other.groups])
        self.batch_size += other.batch_size

    def keep_rows(self, rows: torch.Tensor) -> None:
        groups = [(mask[rows], processors) for mask, processors in self.groups]
        self.groups = [(mask, processors) for mask, processors in groups if bool(mask.any())]
        self.batch_size = int(rows.shape[0])
