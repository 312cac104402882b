"""The decoding loop: draft a tree -> verify it in ONE target forward -> accept -> compact -> stream -> repeat.

It decides nothing itself: the strategy shapes the tree, the drafter builds
it, `ops.greedy_accept` picks the path. It reuses everything `generate`
prepared: the target's cache and prefill inputs, logits processors,
stopping criteria and streamer.

A `Decoding` is one call's run. `generate` steps it to the end; anything that
drives rounds itself (a serving engine) uses its step API: `prefill_result`,
`step()` (a `RoundResult` per round), `join(other)`, `leave(rows)`, `close()`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import clock
from .. import ops
from .acceptance import sample_accept
from ..adapters.attention import tree_attention
from ..adapters.compat import cache_from_kwargs, check_cache, check_model, check_pair
from ..cost import CostModel, DraftPricing, SpecCalibration, verifier_cost_profile
from ..drafters.base import TargetPrefill, VerifiedRound
from ..drafters.factory import make_drafter
from .final_cache import CACHE_FIELD, commit_last_round, returned_cache
from ..adapters.lean import use_lean_forward
from ..ops import cpu_linear
from ..adapters.placement import execution_device, tensor_parallel
from .processors import RowProcessors, SequenceBuffer, StopChecker, row_free
from .retire import RetiredRows
from ..adapters.runner import ModelRunner
from ..adapters.target_states import StateCapture, thread_confined
from .randomness import RowRandom
from .request import SpecRequest
from ..runtime import RuntimeConfig
from .stats import RoundTrace, SpecGenerateOutput, SpecStats
from .step import RoundResult


class _Clock:
    def __init__(self):
        self.last = clock.now()

    def lap(self) -> float:
        now = clock.now()
        elapsed, self.last = now - self.last, now
        return elapsed


def _check_generation_config(generation_config, model_kwargs, streamer, batch_size):
    if generation_config.num_beams not in (None, 1):
        raise ValueError("spec_strategy does not support beam search (num_beams > 1).")
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError("spec_strategy does not support num_return_sequences > 1.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("spec_strategy does not support output_attentions / output_hidden_states.")
    if generation_config.assistant_ensemble_weight is not None:
        raise ValueError("spec_strategy does not support assistant_ensemble_weight.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("spec_strategy needs input_ids (the drafter reads tokens), not inputs_embeds.")
    if streamer is not None and batch_size > 1:
        raise ValueError("spec_strategy streams one sequence; a streamer needs batch size 1.")


def _validate(model, input_ids, generation_config, streamer, assistant_model, tokenizer, assistant_tokenizer,
              synced_gpus, model_kwargs):
    """Refuse what speculation cannot do exactly with the settings `generate` merged (the strategy, its drafter and
    its settings were checked in `request.resolve_request`); returns the target's (checked) cache."""
    if synced_gpus:
        raise ValueError("spec_strategy does not support synced_gpus.")
    _check_generation_config(generation_config, model_kwargs, streamer, input_ids.shape[0])
    check_model(model, "target")
    check_pair(model, assistant_model, tokenizer, assistant_tokenizer)
    if not model_kwargs.get("use_cache", True):
        raise ValueError("spec_strategy needs use_cache=True.")
    cache = cache_from_kwargs(model_kwargs)
    check_cache(cache, "target")
    if model_kwargs.get("position_ids") is None:
        raise ValueError(f"{type(model).__name__} gets no position_ids from generate; spec_strategy needs them.")
    return cache


@torch.no_grad()
def speculative_decode(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                       request: SpecRequest, streamer=None, assistant_model=None, tokenizer=None,
                       assistant_tokenizer=None, synced_gpus: bool = False, **model_kwargs):
    """Tree speculative decoding for `generate(..., assistant_model=..., spec_strategy=...)`.

    Called by the `_assisted_decoding` hook with everything `generate` prepared and the call's resolved `request`;
    returns what `generate` returns (a `SpecGenerateOutput` when `return_dict_in_generate=True`). With
    `request.handoff` set, the prefilled `Decoding` is left there before its first round, its scope open (a serving
    engine steps it, joins it to others and closes it), and the prompt with its first token is returned.
    """
    scope = contextlib.ExitStack()  # what the call enters (drafter attachment, kernels), closed on any exit
    with contextlib.ExitStack() as guard:
        guard.push(scope)  # closed with the call, unless the prefilled run is handed off
        cache = _validate(model, input_ids, generation_config, streamer, assistant_model, tokenizer,
                          assistant_tokenizer, synced_gpus, model_kwargs)
        run = Decoding(scope, model, cache, input_ids, logits_processor, stopping_criteria, generation_config,
                       streamer, assistant_model, model_kwargs, request)
        run.prefill(request.raw_inputs or {})
        run.start_rounds()
        if request.handoff is not None:
            guard.pop_all()
            request.handoff.run = run
            return run.buffer.sequences()
        done = run.prefill_result.done
        while not done:
            done = run.step().done
        return run.finish()


class Decoding:
    """One speculative call: its state, and the loop's steps as methods (prefill, start_rounds, step = draft ->
    trim -> verify -> accept -> commit, finish).

    The step API, for whatever drives rounds itself: `prefill_result` (the first token, a `RoundResult`), `step()`
    (one round, a `RoundResult`), `join(other)` and `leave(rows)` between rounds, `close()` at the end.
    """

    def __init__(self, scope, model, cache, input_ids, logits_processor, stopping_criteria, generation_config,
                 streamer, assistant_model, model_kwargs, request: SpecRequest):
        self.start_time = clock.now()
        self.calibration = request.calibration
        self.scope, self.model, self.cache, self.input_ids = scope, model, cache, input_ids
        self.logits_processor, self.generation_config, self.streamer = logits_processor, generation_config, streamer
        self.assistant_model, self.model_kwargs = assistant_model, model_kwargs
        name = request.strategy
        self.strategy_class = request.strategy_class
        self.config = request.config_for(execution_device(model, input_ids.device))
        self.runtime: RuntimeConfig = request.runtime  # how rounds run, apart from what the strategy verifies
        self._enter_runtime_settings()
        self.drafter = make_drafter(assistant_model, model, self.strategy_class, self.config, scope,
                                    host_trees=self.runtime.host_trees)
        self.batch_size, self.device = input_ids.shape[0], input_ids.device
        self.do_sample = bool(generation_config.do_sample)
        self.random = RowRandom.for_call(request.generator, self.batch_size)
        self.stats = SpecStats(strategy=name)
        return_dict = generation_config.return_dict_in_generate
        self.row_scores = [[] for _ in input_ids] if return_dict and generation_config.output_scores else None
        self.row_logits = [[] for _ in input_ids] if return_dict and generation_config.output_logits else None
        pad = generation_config._pad_token_tensor
        self.buffer = SequenceBuffer(input_ids, generation_config.max_length, int(pad) if pad is not None else 0)
        self.stopper = StopChecker(stopping_criteria, generation_config._eos_token_tensor,
                                   generation_config.max_length)
        self.processors = RowProcessors(logits_processor, self.batch_size, self.device)
        self.finished = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
        self.clock = _Clock()
        self.trace = RoundTrace(self.batch_size, keep=not request.light_trace)
        self.prefill_result: RoundResult | None = None
        self.strategy = self.target = self.cost = self.pricing = None
        self.last_round = None  # (path_index, counts) of a final round that ended the call before its commit
        # finished rows leave the batch between rounds (`retire_rows`); `rows`: each remaining row's row in the call
        self.rows = torch.arange(self.batch_size, device=self.device)
        self.retired = None
        self._owned_calibration = None
        if (self.runtime.retire_rows and self.batch_size > 1 and row_free(logits_processor)
                and not tensor_parallel(model, assistant_model)):
            self.retired = RetiredRows(self.batch_size, keep_cache=bool(return_dict))

    def _enter_runtime_settings(self) -> None:
        """The call's runtime settings (`spec_runtime`; those left None follow the caller's context)."""
        config = self.runtime
        settings = ((config.lean_forward, use_lean_forward), (config.cpu_kernels, cpu_linear.use_cpu_kernels),
                    (config.compact_weights, cpu_linear.use_compact_weights))
        for value, setting in settings:
            if value is not None:
                self.scope.enter_context(setting(value))

    # ---- prefill

    def prefill(self, raw_inputs: dict) -> None:
        """The target's prefill, exactly as plain generate runs it -> the first token; then the drafter's."""
        model, input_ids, drafter = self.model, self.input_ids, self.drafter
        kwargs = self.model_kwargs
        with contextlib.ExitStack() as prefill_scope:
            prefill_scope.enter_context(drafter.prefill_scope(input_ids))
            used_positions = prefill_scope.enter_context(_prefill_positions(model))
            # only the hidden states the drafter reads are kept (never every layer at every prompt position)
            indices = drafter.target_states(prefill=True)
            consume = drafter.fuse_prefill_state if drafter.fuses_prefill_states else None
            capture = StateCapture.for_model(model, indices, consume) if indices is not None else None
            if capture is not None:
                prefill_scope.enter_context(capture)
            elif indices is not None:
                kwargs = {**kwargs, "output_hidden_states": True}
            outputs = model._prefill(input_ids, self.generation_config, kwargs)
        if self.cache.get_seq_length() != input_ids.shape[1]:
            raise ValueError(
                f"{type(model).__name__} cached {self.cache.get_seq_length()} positions for a {input_ids.shape[1]}-"
                "token prompt; spec_strategy needs one cache slot per input token."
            )
        raw = outputs.logits[:, -1, :].to(torch.float32)
        scores = self.logits_processor(input_ids, raw) if len(self.logits_processor) else raw
        everyone = torch.ones(self.batch_size, dtype=torch.bool, device=self.device)
        first = self.random.categorical(torch.softmax(scores, -1), everyone) if self.do_sample else scores.argmax(-1)
        hidden = None
        if indices is not None:
            hidden = capture.states if capture is not None else outputs.hidden_states
        del outputs
        attention_mask = self.model_kwargs.get("attention_mask")
        slot_valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        position_ids = used_positions.get("position_ids", self.model_kwargs["position_ids"])
        self.target = ModelRunner(model, self.cache, slot_valid, position_ids)
        self.scope.callback(self.target.close)
        self.first_real = slot_valid.long().argmax(-1)  # (B,) first prompt token after left padding
        if self.device.type == "cpu":
            self._enter_cpu_kernels()
        counts, done, stopped = self.stopper.cut(self.buffer, first[:, None], torch.ones_like(first))
        self._emit(first[:, None], counts, scores[:, None], raw[:, None])
        self.finished |= done
        none = torch.zeros_like(first)
        self.prefill_result = RoundResult(first[:, None], counts, self.finished.clone(), stopped & done, everyone,
                                          none, none)
        self.stats.time_prefill += self.clock.lap()
        if not bool(self.finished.all()):
            drafter.start(TargetPrefill(input_ids, attention_mask, slot_valid, raw_inputs, self.cache, hidden, first))
            self.stats.time_visual += drafter.visual_time
            self.stats.time_prefill += self.clock.lap()

    def _enter_cpu_kernels(self) -> None:
        """Rounds on a CPU (measured there only; both change float rounding, not math): the small-batch linear
        kernel for verification and drafting (a drafter that `compact_weights` reads bf16 copies: drafts only, the
        target still decides every token; one-row inputs too in the plain mode only: with a drafter, a batch-1
        call on MT-Bench ran 19% slower with them), and tree forwards' GQA without repeat_kv."""
        drafter = self.drafter
        compact = (drafter.model,) if drafter.compact_weights else ()
        setup_start = clock.now()
        self.scope.enter_context(cpu_linear.fast_linears(self.model, self.assistant_model, compact=compact))
        if self.strategy_class.drafts_nothing:  # `plain`: every step is one row per sequence
            self.scope.enter_context(cpu_linear.single_row_kernel())
        self.stats.time_setup += clock.now() - setup_start
        for verifier in (self.model, drafter.model if drafter.tree_forwards else None):
            self.scope.enter_context(tree_attention(verifier))

    def start_rounds(self) -> None:
        """The strategy, and the cost rule when the strategy is cost-aware (greedy; not under tensor
        parallelism: its choices follow each rank's own timings, and every rank must verify the same tree)."""
        self.strategy = self.strategy_class(self.config, self.batch_size, self.device, sampling=self.do_sample)
        if (bool(self.finished.all()) or not self.strategy.cost_aware or self.do_sample
                or tensor_parallel(self.model, self.assistant_model)):
            return
        owned = self._owned_calibration = (self.calibration if self.calibration is not None
                                           else SpecCalibration.from_env())
        fixed = owned is not None and owned.cost_profile is not None
        profile = self._cost_profile()
        calibration = pauses = None
        if owned is not None:
            calibration = owned.get(self.assistant_model, f"{self.strategy.name}|{profile.key}", self.device)
            pauses = owned.pauses(self.assistant_model, self.strategy.name)
        # a fixed curve is priced as given: nothing follows this machine's timings (`SpecCalibration`)
        self.cost = CostModel(profile, max_tokens=256, device=self.device, calibration=calibration,
                              timed=not fixed, rows=self.batch_size, packed=self.target.lean, pauses=pauses)
        if self.drafter.prices_levels and self.cost.live_scale:  # drafting is priced too (host times are real)
            self.pricing = DraftPricing(self.cost)
        self.strategy.use_cost(self.cost, self.pricing, self.drafter.max_depth)
        self.stats.time_profile += self.clock.lap()
        self.stats.time_setup += self.stats.time_profile

    def _cost_profile(self):
        """The verifier's cost curve for the batch as it is now (a fixed one if the calibration carries it)."""
        owned = self._owned_calibration
        if owned is not None and owned.cost_profile is not None:
            return owned.cost_profile
        return verifier_cost_profile(self.target)

    # ---- one round

    def step(self) -> RoundResult:
        """One round: draft, trim, verify, accept, commit. What each row of the batch (as the round began) got."""
        round_start = clock.now()
        active = ~self.finished
        tree, paused = self._draft(active)
        if self.cost is not None and not paused:
            tree = self._trim(tree, active)
        raw, hidden, verify_seconds = self._verify(tree)
        accepted = self._accept(tree, raw, active, paused)
        result = RoundResult(accepted.tokens, accepted.counts, self.finished.clone(), accepted.stopped, active,
                             tree.num_drafted() * active, accepted.accept_length * active)
        finished = int(self.finished.sum())
        if finished == self.batch_size:  # the last round: nothing to commit (`finish` returns the cache as is)
            self.last_round = (accepted.path_index, accepted.counts)
            return result
        self._commit(tree, accepted, hidden)
        if self.cost is not None:
            round_seconds = clock.now() - round_start
            tokens = accepted.counts.sum()
            self.cost.observe(tree, accepted.choice, round_seconds, tokens, verify_seconds)  # greedy: choice set
            if not paused:
                self.strategy.observe_priced(tree, accepted.choice, accepted.path_index, round_seconds, verify_seconds)
            if self.drafter.may_pause and self.cost.live_scale:  # host times are real (CPU): reading costs nothing
                self.cost.pauses.observe_rate(not paused, round_seconds, int(tokens))
        if self.retired is not None and finished and finished >= RetiredRows.LEAVE_AT * self.batch_size:
            self._retire()
        return result

    def _retire(self) -> None:
        """Finished rows leave the batch (once they are `RetiredRows.LEAVE_AT` of it: each exit copies the
        remaining rows' cache once): the target's cache, the drafter's and the strategy's state keep the other
        rows; what the output needs of the finished ones is kept aside (`RetiredRows`); the cost rule prices the
        smaller batch."""
        keep, gone = (~self.finished).nonzero().squeeze(1), self.finished.nonzero().squeeze(1)
        self.retired.add(self.rows[gone], gone, self.buffer, self.target)
        self._keep_rows(keep)
        self.stats.time_compact += self.clock.lap()

    # ---- rows that join and leave between rounds (`_retire`; a serving engine's batch)

    def leave(self, rows) -> None:
        """Rows `rows` (positions in the batch, e.g. finished or cancelled requests) leave it between rounds: every
        part of the run keeps the other rows, in order, and the target's cache and the drafter's state drop the
        columns no remaining row holds. At least one row must stay (`close` ends the run)."""
        gone = {int(row) for row in rows}
        if any(row < 0 or row >= self.batch_size for row in gone):
            raise ValueError(f"leave: rows must be positions in the batch of {self.batch_size}, got {sorted(gone)}.")
        keep = [row for row in range(self.batch_size) if row not in gone]
        if not keep:
            raise ValueError("leave: every row would leave the batch; close the run instead.")
        self._keep_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
        self.target.trim()
        self.drafter.trim()

    def close(self) -> None:
        """Release what the run entered (the drafter's attachment, kernels, the target's round settings); a run
        handed off after its prefill is closed by whoever drives it."""
        self.scope.close()

    def _keep_rows(self, keep: torch.Tensor) -> None:
        """Only rows `keep` `(B',)` stay, in that order, in every part of the run (between rounds); the cost rule
        prices the new batch."""
        for part in (self.buffer, self.target, self.drafter, self.strategy, self.stopper, self.processors,
                     self.random):
            part.keep_rows(keep)
        self.finished, self.first_real, self.rows = self.finished[keep], self.first_real[keep], self.rows[keep]
        self.batch_size = int(keep.shape[0])
        self._batch_changed()

    def join(self, other: "Decoding") -> None:
        """The rows of `other` follow this run's (between rounds): `other` is a run of the same target, drafter,
        strategy and decoding mode, prefilled and handed off before its first round (`integration.open_run`); each
        row keeps its own limits, logits processors and random generator. `other` is spent: close it after."""
        if other.strategy_class is not self.strategy_class or other.do_sample != self.do_sample:
            raise ValueError("a run joins a batch of the same strategy and decoding mode (greedy or sampling).")
        if other.model is not self.model or other.assistant_model is not self.assistant_model:
            raise ValueError("a run joins a batch of the same target and drafter.")
        for run in (self, other):
            if run.streamer is not None or run.row_scores is not None or run.row_logits is not None:
                raise ValueError("a joined run streams through the engine: no streamer, scores or logits.")
            if not all(row_free(processors) for _, processors in run.processors.groups):
                raise ValueError("rows with logits processors that keep per-row state cannot join other requests.")
        if bool(other.finished.any()):
            raise ValueError("only unfinished rows join a batch.")
        other_rows = other.batch_size
        self.buffer.join(other.buffer)
        self.stopper.join(other.stopper, self.batch_size, other_rows, self.device)
        self.processors.join(other.processors)
        self.target.join(other.target)
        self.drafter.join(other.drafter)
        self.strategy.join(other.strategy)
        self.random.join(other.random)
        self.finished = torch.cat([self.finished, other.finished])
        self.first_real = torch.cat([self.first_real, other.first_real])
        self.rows = torch.cat([self.rows, other.rows + self.trace.batch_size])
        self.trace.batch_size += other_rows
        self.batch_size += other_rows
        self._batch_changed()

    def _batch_changed(self) -> None:
        if self.cost is not None:
            self.cost.use_profile(self._cost_profile(), self.batch_size)
            if self.pricing is not None:
                self.pricing.forget_timings()  # drafter forwards of the other batch size

    def _draft(self, active: torch.Tensor) -> tuple:
        """This round's tree, and whether drafting paused (the tree is the root alone)."""
        drafter, buffer = self.drafter, self.buffer
        # deepest useful draft: the bonus token needs one slot of the remaining budget; a finished row drafts
        # nothing (its tokens are dropped, and nodes of it would weigh in the pricing of drafting and verification)
        max_depth = (self.stopper.room(buffer) - 1).clamp_min(0)
        max_depth = torch.where(active, max_depth, 0)
        model_time = drafter.model_time
        paused = (drafter.may_pause and self.strategy.may_pause and self.cost is not None
                  and self.cost.pauses.pause_drafting(int(active.sum()) if self.cost.live_scale else None))
        if paused:  # drafting does not pay on this text now: verify the root alone (a plain step)
            tree = drafter.root_tree()
            self.stats.paused_rounds += 1
        else:
            process = self._process_draft if len(self.processors) else None
            stop = self.stopper.stop_tokens(self.batch_size, self.device)
            tree = drafter.draft(self.strategy, process, max_depth, sample=self.do_sample, generator=self.random,
                                 committed=(buffer.ids, buffer.lengths, self.first_real), pricing=self.pricing,
                                 stop_tokens=stop)
            below = tree.below_stop(stop) if stop is not None else None
            if below is not None:  # never of use: an accepted EOS ends the row, a rejected one the path
                tree = tree.subset(~below)
        elapsed = self.clock.lap()
        drafting = drafter.model_time - model_time
        self.stats.time_draft += drafting
        self.stats.time_tree += elapsed - drafting
        return tree, paused

    def _process_draft(self, logits, paths, depths, valid):
        return self.processors.apply(self.buffer, paths, depths, logits, valid)

    def _trim(self, tree, active: torch.Tensor):
        """Verify only what pays for its marginal cost (the cost rule)."""
        drafted = tree.num_drafted()
        tree = tree.subset(self.cost.prune(tree)[0])
        kept = tree.num_drafted() * active
        self.trace.pruned += (drafted * active).sum() - kept.sum()
        if self.drafter.may_pause and self.cost.live_scale:  # host values are free on a CPU
            self.cost.pauses.observe_trim(int(kept.sum()))
        self.stats.time_tree += self.clock.lap()
        return tree

    def _verify(self, tree) -> tuple:
        """ONE target forward over the tree: `(logits (B, N, V) float32, hidden states or None, seconds)`."""
        target, drafter = self.target, self.drafter
        model_time = target.model_time
        with drafter.verify_scope():  # the target's states feed a block drafter's context: same forward
            indices = drafter.target_states()
            outputs = target.forward(tree.tokens, tree.parents, tree.valid, states=indices)
        elapsed = self.clock.lap()
        seconds = target.model_time - model_time
        self.stats.time_verify += seconds
        self.stats.time_tree += elapsed - seconds
        hidden = outputs.hidden_states if indices is not None else None
        return outputs.logits.to(torch.float32), hidden, seconds

    def _accept(self, tree, raw: torch.Tensor, active: torch.Tensor, paused: bool) -> "_Accepted":
        """The longest accepted path + bonus per row, appended, streamed and checked for stopping."""
        scores = raw
        if len(self.processors):
            scores = self.processors.apply(self.buffer, tree.path_tokens(), tree.depths, raw, tree.valid)
        choice = None
        if self.do_sample:
            path_index, accept_length, bonus = sample_accept(tree, torch.softmax(scores, dim=-1), self.random)
        else:
            choice = scores.argmax(-1)  # (B, N) the target's greedy token after each node
            path_index, accept_length, bonus = ops.greedy_accept(tree.tokens, tree.parents, tree.valid, choice,
                                                                 tree.num_levels)
        new_tokens = torch.cat([tree.tokens.gather(1, path_index[:, 1:]), bonus[:, None]], dim=1)
        new_tokens.scatter_(1, accept_length[:, None], bonus[:, None])
        counts, done, stopped = self.stopper.cut(self.buffer, new_tokens, torch.where(active, accept_length + 1, 0))
        counts = torch.where(active, counts, 0)
        if self.row_scores is not None or self.row_logits is not None:
            scores, raw = scores.gather(1, _expand(path_index, scores)), raw.gather(1, _expand(path_index, raw))
        self._emit(new_tokens, counts, scores, raw)
        self.finished |= done & active
        self.stats.rounds += 1
        self.trace.record(active, tree.num_drafted(), accept_length, self.strategy.round_values(), self.rows)
        if not paused:  # a root-only round says nothing about the strategy's trees
            self.strategy.observe(accept_length, active)
        self.stats.time_accept += self.clock.lap()
        return _Accepted(path_index, accept_length, bonus, new_tokens, counts, stopped & done & active, choice)

    def _commit(self, tree, accepted: "_Accepted", hidden) -> None:
        """Keep the accepted path in the target's cache and the drafter's state."""
        keep = int(accepted.accept_length.max()) + 1
        offsets = torch.arange(keep, device=self.device)[None, :]
        self.target.commit(accepted.path_index[:, :keep], offsets <= accepted.accept_length[:, None])
        visual_time = self.drafter.visual_time
        self.drafter.finish_round(VerifiedRound(tree, accepted.path_index, accepted.accept_length, accepted.bonus,
                                                hidden))
        self.stats.time_visual += self.drafter.visual_time - visual_time
        self.stats.time_compact += self.clock.lap()

    def _emit(self, tokens, counts, scores, raw) -> None:
        """Append each row's first `counts` tokens, stream them, and record their scores / logits if asked."""
        self.buffer.append(tokens, counts)
        if self.streamer is not None and int(counts[0]) > 0:
            self.streamer.put(tokens[:, : int(counts[0])].cpu())
        if self.row_scores is None and self.row_logits is None:
            return
        for row, (original, count) in enumerate(zip(self.rows.tolist(), counts.tolist())):
            if self.row_scores is not None:
                self.row_scores[original].extend(scores[row, :count])
            if self.row_logits is not None:
                self.row_logits[original].extend(raw[row, :count])

    # ---- finish

    def finish(self):
        """What `generate` returns; a corrected cost curve is kept for the next call."""
        stats, buffer = self.stats, self.buffer
        if self.streamer is not None:
            self.streamer.end()
        if self.cost is not None:  # a stored cost curve that these rounds contradict is corrected for the next call
            self.cost.refine_profile()
        if self.pricing is not None:
            stats.unpaid_levels = self.pricing.stopped_levels
        self.trace.finish(stats)
        # a final round that ended the call was not committed: its tree is still the cache's tail
        last_round = self.last_round if self.target.has_tail else None
        stats.retired_rows = self.trace.batch_size - self.batch_size
        if stats.retired_rows:  # rows that left the batch come back, in order
            self.retired.restore_buffer(buffer, self.rows)
            if self.retired.keep_cache:
                commit_last_round(self.target, last_round)
                self.retired.restore_cache(self.target, self.rows)
                last_round = None
        stats.new_tokens = int((buffer.lengths - buffer.prompt_length).sum())
        stats.time_total = clock.now() - self.start_time
        sequences = buffer.sequences()
        if not self.generation_config.return_dict_in_generate:
            return sequences
        return SpecGenerateOutput(
            sequences=sequences,
            scores=_stack_steps(self.row_scores, buffer, sequences),
            logits=_stack_steps(self.row_logits, buffer, sequences),
            spec_stats=stats,
            **{CACHE_FIELD: returned_cache(self.target, buffer, last_round)},
        )


@dataclass
class _Accepted:
    path_index: torch.Tensor  # (B, D + 1) accepted nodes, root first
    accept_length: torch.Tensor  # (B,) accepted draft tokens
    bonus: torch.Tensor  # (B,) the target's next token
    tokens: torch.Tensor  # (B, D + 1) the accepted tokens and the bonus; each row appended its first `counts`
    counts: torch.Tensor  # (B,) tokens appended (0 for rows already finished)
    stopped: torch.Tensor  # (B,) rows that finished on an EOS token or a stopping criterion
    choice: torch.Tensor | None  # (B, N) the target's greedy token after each node (greedy decoding)


@contextlib.contextmanager
def _prefill_positions(model):
    """Records the position ids the model's forward receives in the prefill: `prepare_inputs_for_generation`
    may shift those `generate` prepared (PaliGemma counts from 1), and rounds must continue the same way.

    The hook sees this thread's forwards only (`thread_confined`): a target shared between threads runs other
    calls' prefills and verifications meanwhile, whose positions are not this prompt's."""
    used = {}

    def record(module, args, kwargs):
        if "position_ids" not in used and kwargs.get("position_ids") is not None:
            used["position_ids"] = kwargs["position_ids"]

    handle = model.register_forward_pre_hook(thread_confined(record), with_kwargs=True)
    try:
        yield used
    finally:
        handle.remove()


def _expand(path_index, values):
    return path_index[..., None].expand(-1, -1, values.shape[-1])


def _stack_steps(per_row, buffer, sequences):
    """Per-step `(B, V)` tensors like plain generate; rows that already ended get zeros."""
    if per_row is None:
        return None
    steps = sequences.shape[1] - buffer.prompt_length
    vocab = next(t for row in per_row for t in row).shape[-1]
    out = []
    for step in range(steps):
        out.append(torch.stack([
            row[step] if step < len(row) else torch.zeros(vocab, device=sequences.device) for row in per_row
        ]))
    return tuple(out)
