"""The decoding loop: draft a tree -> verify it in ONE target forward -> accept -> compact -> stream -> repeat.

It decides nothing itself: the strategy shapes the tree, the drafter builds
it, `ops.greedy_accept` picks the path. It reuses everything `generate`
prepared: the target's cache and prefill inputs, logits processors,
stopping criteria and streamer.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import ops
from .acceptance import sample_accept
from .attention import tree_attention
from .compat import cache_from_kwargs, check_cache, check_model, check_pair
from .cost import CostModel, DraftPricing, shared_calibration, verifier_cost_profile
from .drafters.block import BlockDrafter
from .drafters.independent import IndependentDrafter
from .drafters.laspec import LaSpecDrafterModel, attached_for_call, draft_head_cache
from .final_cache import CACHE_FIELD, returned_cache
from .ops import cpu_linear
from .placement import execution_device, tensor_parallel
from .processors import SequenceBuffer, StopChecker, process_logits
from .runner import ModelRunner
from .windows import full_layer_cache
from .strategies import get_strategy_class, resolve_config


@dataclass
class SpecStats:
    """How speculation went in one `generate` call.

    Fields:
        strategy: the strategy name.
        rounds: target verification forwards (draft -> verify rounds); the prefill is not a round.
        new_tokens: tokens generated over all rows (the prefill's first token included).
        row_rounds: rounds summed over the rows still generating in them.
        drafted_tokens / accepted_tokens: draft nodes verified / draft tokens accepted, over all rows.
        mean_accepted_length: tau = tokens produced by rounds / row_rounds (accepted drafts + bonus per round).
        accepted_lengths: accepted draft tokens of each row-round, in order.
        sage_alphas: for `sage`, the confidence alpha that shaped each row-round's tree (aligned with
            `accepted_lengths`); empty for other strategies.
        time_*: seconds spent in the prefill (target and drafter), drafting (drafter forwards), tree and mask
            building, verification (target forwards), acceptance (processors, path choice, stopping) and KV
            compaction. On a GPU these are host times between phases, without extra synchronisation.
        time_profile: seconds spent getting the verifier's cost curve: reading it from memory or disk, or on a
            CPU starting from a prior curve the rounds correct (no forward is timed inside a call unless asked:
            `hf_adaptive_spec.prepare`, `cost.measure_cost_curve`; on an accelerator the sweeps are measured).
        time_setup: seconds of one-off setup inside this call: `time_profile` plus loading the CPU kernel (a
            kernel not compiled yet is built in a background process, never inside the call).
        pruned_tokens: draft nodes the cost model trimmed before verification (cost-aware strategies).
        unpaid_levels: draft levels an independent drafter did not expand because they would not pay for the
            drafter forward and the verification they add (`cost.DraftPricing`; cost-aware strategies, CPU).
        paused_rounds: rounds that verified the root alone because drafting was not paying on this text (a
            LaSpec drafter with the cost rule on a CPU; `CostModel.pause_drafting`); counted in `rounds`.
        time_visual: seconds spent selecting visual tokens for a LaSpec drafter (int8 keys at the prefill, the
            score-and-vote each round); `time_visual / rounds` is the per-round selection cost.
    """

    strategy: str = ""
    rounds: int = 0
    new_tokens: int = 0
    row_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_lengths: list = field(default_factory=list)
    sage_alphas: list = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_tree: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    time_compact: float = 0.0
    time_profile: float = 0.0
    time_setup: float = 0.0
    pruned_tokens: int = 0
    paused_rounds: int = 0
    unpaid_levels: int = 0
    time_visual: float = 0.0
    time_total: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.row_rounds) / self.row_rounds if self.row_rounds else 0.0

    @property
    def target_forwards(self) -> int:
        return self.rounds + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("accepted_lengths", "sage_alphas")}
        out.update(mean_accepted_length=self.mean_accepted_length, target_forwards=self.target_forwards,
                   acceptance_rate=self.acceptance_rate)
        return out


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `spec_stats` (`SpecStats`)."""

    spec_stats: SpecStats | None = None


class _Clock:
    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


def _drafter_datastore(drafter, config):
    """The datastore a block-drafter round adds to its trees: the drafter's own (`LaSpecDrafterModel.datastore`)
    unless the strategy's `datastore` setting is False; True insists that the drafter carries one."""
    wanted = getattr(config, "datastore", False)
    store = getattr(drafter, "datastore", None)
    if wanted is True and store is None:
        raise ValueError("spec_config datastore=True, but the drafter carries no datastore (load one from a folder "
                         "with datastore.safetensors, or `drafter.set_datastore(TokenDatastore...)`).")
    return None if wanted is False else store


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


@torch.no_grad()
def speculative_decode(*args, **kwargs):
    """Tree speculative decoding for `generate(..., assistant_model=..., spec_strategy=...)`.

    Called by the `_assisted_decoding` hook with everything `generate` prepared; returns what
    `generate` returns (a `SpecGenerateOutput` when `return_dict_in_generate=True`).
    """
    with contextlib.ExitStack() as after_prefill:  # contexts the rounds run in, closed on any exit
        return _speculative_decode(after_prefill, *args, **kwargs)


def _speculative_decode(
    after_prefill: contextlib.ExitStack,
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    streamer=None,
    assistant_model=None,
    tokenizer=None,
    assistant_tokenizer=None,
    raw_inputs: dict | None = None,
    synced_gpus: bool = False,
    **model_kwargs,
):
    start_time = time.perf_counter()
    strategy_name = generation_config.spec_strategy
    strategy_class = get_strategy_class(strategy_name)
    config = resolve_config(strategy_name, getattr(generation_config, "spec_config", None),
                            execution_device(model, input_ids.device))
    batch_size = input_ids.shape[0]
    device = input_ids.device

    if assistant_model is None:
        raise ValueError("spec_strategy needs a drafter: pass assistant_model=...")
    if synced_gpus:
        raise ValueError("spec_strategy does not support synced_gpus.")
    _check_generation_config(generation_config, model_kwargs, streamer, batch_size)
    check_model(model, "target")
    block_drafter = isinstance(assistant_model, LaSpecDrafterModel)
    if strategy_class.requires_block_drafter and not block_drafter:
        raise ValueError(
            f"spec_strategy={strategy_name!r} drafts with a LaSpecDrafterModel (hf_adaptive_spec.LaSpecDrafterModel, "
            f"e.g. trained by `hf-adaptive-spec train-drafter`); got {type(assistant_model).__name__}."
        )
    if not block_drafter:
        check_model(assistant_model, "drafter")
    check_pair(model, assistant_model, tokenizer, assistant_tokenizer)
    if not model_kwargs.get("use_cache", True):
        raise ValueError("spec_strategy needs use_cache=True.")
    cache = cache_from_kwargs(model_kwargs)
    check_cache(cache, "target")
    full_layer_cache(cache)  # windows are applied by the masks; every slot stays (see `windows`)
    if model_kwargs.get("position_ids") is None:
        raise ValueError(f"{type(model).__name__} gets no position_ids from generate; spec_strategy needs them.")

    stats = SpecStats(strategy=strategy_name)
    return_dict = generation_config.return_dict_in_generate
    want_scores = return_dict and generation_config.output_scores
    want_logits = return_dict and generation_config.output_logits
    row_scores = [[] for _ in range(batch_size)] if want_scores else None
    row_logits = [[] for _ in range(batch_size)] if want_logits else None

    pad = generation_config._pad_token_tensor
    buffer = SequenceBuffer(input_ids, generation_config.max_length, int(pad) if pad is not None else 0)
    stopper = StopChecker(stopping_criteria, generation_config._eos_token_tensor, generation_config.max_length)
    attention_mask = model_kwargs.get("attention_mask")
    position_ids = model_kwargs["position_ids"]

    # 1. target prefill, exactly as plain generate runs it -> the first token
    clock = _Clock()
    prefill_kwargs = {**model_kwargs, "output_hidden_states": True} if block_drafter else model_kwargs
    drafter = None
    if block_drafter:
        after_prefill.enter_context(attached_for_call(assistant_model, model))  # this call only
        drafter = BlockDrafter(assistant_model, model, block_size=getattr(config, "block_size", None),
                               num_visual_tokens=getattr(config, "num_visual_tokens", None),
                               context_lookup=getattr(config, "context_lookup", 0),
                               lookup_tokens=getattr(config, "lookup_tokens", None),
                               datastore=_drafter_datastore(assistant_model, config),
                               datastore_tokens=getattr(config, "datastore_tokens", None))
        after_prefill.enter_context(draft_head_cache())
    with drafter.vision_context(input_ids) if block_drafter else contextlib.nullcontext(), \
            _prefill_positions(model) as used_positions:
        outputs = model._prefill(input_ids, generation_config, prefill_kwargs)
    if cache.get_seq_length() != input_ids.shape[1]:
        raise ValueError(
            f"{type(model).__name__} cached {cache.get_seq_length()} positions for a {input_ids.shape[1]}-token "
            "prompt; spec_strategy needs one cache slot per input token."
        )
    first_raw = outputs.logits[:, -1, :].to(torch.float32)
    first_scores = logits_processor(input_ids, first_raw) if len(logits_processor) else first_raw
    do_sample = bool(generation_config.do_sample)
    if do_sample:
        first_token = torch.multinomial(torch.softmax(first_scores, dim=-1), 1).squeeze(1)
    else:
        first_token = first_scores.argmax(-1)
    prefill_hidden = outputs.hidden_states if block_drafter else None
    del outputs
    slot_valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    target = ModelRunner(model, cache, slot_valid, used_positions.get("position_ids", position_ids))
    first_real = slot_valid.long().argmax(-1)  # (B,) first prompt token after left padding

    if device.type == "cpu":  # measured on CPUs only (no GPU figures yet): both change float rounding, not math
        # verification and drafting run a few rows per linear layer: the small-batch kernel; a LaSpec drafter
        # reads bf16 copies of its weights (drafts only: the target still decides every token)
        compact = (assistant_model,) if block_drafter else ()
        setup_start = time.perf_counter()
        after_prefill.enter_context(cpu_linear.fast_linears(model, assistant_model, compact=compact))
        stats.time_setup += time.perf_counter() - setup_start
        for verifier in (model, None if block_drafter else assistant_model):  # tree forwards: GQA without repeat_kv
            after_prefill.enter_context(tree_attention(verifier))

    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    counts, done = stopper.cut(buffer, first_token[:, None], torch.ones_like(first_token))
    _emit(buffer, streamer, first_token[:, None], counts)
    if want_scores or want_logits:
        _record_scores(row_scores, row_logits, first_scores[:, None], first_raw[:, None], counts)
    finished |= done
    stats.time_prefill += clock.lap()

    if bool(finished.all()):
        drafter = None
    else:
        if block_drafter:
            drafter.prefill(prefill_hidden, slot_valid, first_token)
            drafter.setup_vision(prefill_hidden, cache)
            stats.time_visual += drafter.visual_time
        else:
            drafter = IndependentDrafter(assistant_model)
            drafter.prefill(input_ids, attention_mask, raw_inputs or {})
            drafter.set_pending(first_token[:, None], torch.ones(batch_size, 1, dtype=torch.bool, device=device))
        stats.time_prefill += clock.lap()
    del prefill_hidden
    strategy = strategy_class(config, batch_size, device)
    strategy.sampling = do_sample
    cost = pricing = None
    # (not under tensor parallelism: the cost rule's choices follow each rank's own timings, and every rank must
    # verify the same tree)
    if drafter is not None and strategy.cost_aware and not do_sample and not tensor_parallel(model, assistant_model):
        profile = verifier_cost_profile(target)
        calibration = shared_calibration(assistant_model, f"{strategy_name}|{profile.key}", device)
        cost = CostModel(profile, max_tokens=256, device=device, calibration=calibration)
        if not block_drafter and cost.live_scale:  # drafting is priced too (host times are real on a CPU)
            pricing = DraftPricing(cost)
        stats.time_profile += clock.lap()
        stats.time_setup += stats.time_profile
    trace = _RoundTrace()

    def process_draft(logits, paths, depths, valid):
        return process_logits(logits_processor, buffer, paths, depths, logits, valid)

    # 2. rounds
    while not bool(finished.all()):
        round_start = time.perf_counter()
        active = ~finished
        # deepest useful draft: the bonus token needs one slot of the remaining budget
        max_depth = (generation_config.max_length - buffer.lengths - 1).clamp_min(0)
        # a finished row drafts nothing: its tokens are dropped, and nodes of it would weigh in the pricing
        # of the batch's drafting (DraftPricing) and verification (the cost rule)
        max_depth = torch.where(active, max_depth, 0)
        draft_model_time = drafter.model_time
        # (not for strategies that shape rounds by a per-round confidence, e.g. sage: its stats stay aligned)
        paused = (block_drafter and cost is not None and strategy.round_confidence() is None
                  and cost.pause_drafting())
        if paused:  # drafting does not pay on this text now: verify the root alone (a plain step)
            tree = drafter.root_tree()
            stats.paused_rounds += 1
        else:
            context = {"context": (buffer.ids, buffer.lengths, first_real)} if block_drafter else {"pricing": pricing}
            tree = drafter.draft(strategy, process_draft if len(logits_processor) else None, max_depth,
                                 sample=do_sample, **context)
        elapsed = clock.lap()
        stats.time_draft += drafter.model_time - draft_model_time
        stats.time_tree += elapsed - (drafter.model_time - draft_model_time)
        if cost is not None and not paused:  # verify only what pays for its marginal cost
            drafted = tree.num_drafted()
            tree = tree.subset(cost.prune(tree)[0])
            trace.pruned += ((drafted - tree.num_drafted()) * active).sum()
            stats.time_tree += clock.lap()

        verify_model_time = target.model_time
        if block_drafter:  # the target's states feed the drafter's context: same forward, no extra pass
            with drafter.capture_context():
                outputs = target.forward(tree.tokens, tree.parents, tree.valid, output_hidden_states=True)
        else:
            outputs = target.forward(tree.tokens, tree.parents, tree.valid)  # (B, N, V) logits, ONE forward
        elapsed = clock.lap()
        verify_seconds = target.model_time - verify_model_time
        stats.time_verify += verify_seconds
        stats.time_tree += elapsed - verify_seconds

        raw = outputs.logits.to(torch.float32)
        verify_hidden = outputs.hidden_states if block_drafter else None
        del outputs
        scores = raw
        if len(logits_processor):
            scores = process_logits(logits_processor, buffer, tree.path_tokens(), tree.depths, raw, tree.valid)
        if do_sample:
            path_index, accept_length, bonus = sample_accept(tree, torch.softmax(scores, dim=-1))
        else:
            choice = scores.argmax(-1)  # (B, N) the target's greedy token after each node
            path_index, accept_length, bonus = ops.greedy_accept(
                tree.tokens, tree.parents, tree.valid, choice, tree.num_levels
            )
        path_tokens = tree.tokens.gather(1, path_index[:, 1:])  # (B, D)
        new_tokens = torch.cat([path_tokens, bonus[:, None]], dim=1)
        new_tokens.scatter_(1, accept_length[:, None], bonus[:, None])
        counts, done = stopper.cut(buffer, new_tokens, torch.where(active, accept_length + 1, 0))
        counts = torch.where(active, counts, 0)
        if want_scores or want_logits:
            _record_scores(row_scores, row_logits, scores.gather(1, _expand(path_index, scores)),
                           raw.gather(1, _expand(path_index, raw)), counts)
        _emit(buffer, streamer, new_tokens, counts)
        finished |= done & active
        stats.rounds += 1
        trace.record(active, tree.num_drafted(), accept_length, strategy.round_confidence())
        if not paused:  # a root-only round says nothing about the strategy's trees
            strategy.observe(accept_length, active)
        stats.time_accept += clock.lap()

        if bool(finished.all()):
            break
        keep = int(accept_length.max()) + 1
        target.commit(path_index[:, :keep], torch.arange(keep, device=device)[None, :] <= accept_length[:, None])
        if block_drafter:
            drafter.commit(tree, verify_hidden, path_index, accept_length, bonus)
            visual_before = drafter.visual_time
            drafter.select_visual(path_index.gather(1, accept_length[:, None]).squeeze(1))
            stats.time_visual += drafter.visual_time - visual_before
        else:
            drafter.commit(tree, path_index, accept_length, bonus)
        del verify_hidden
        stats.time_compact += clock.lap()
        if cost is not None:
            round_seconds = time.perf_counter() - round_start
            cost.observe(tree, choice, round_seconds, counts.sum(), verify_seconds)  # greedy: choice is set
            if block_drafter and cost.live_scale:  # host times are real here (CPU): reading counts costs nothing
                cost.observe_rate(not paused, round_seconds, int(counts.sum()))

    if streamer is not None:
        streamer.end()
    if cost is not None:  # a stored cost curve that these rounds contradict is corrected for the next call
        cost.refine_profile()
    if pricing is not None:
        stats.unpaid_levels = pricing.stopped_levels
    trace.finish(stats)
    stats.new_tokens = int((buffer.lengths - buffer.prompt_length).sum())
    stats.time_total = time.perf_counter() - start_time
    sequences = buffer.sequences()
    if not return_dict:
        return sequences
    # the last round broke out before committing: its tree is still the cache's tail
    last_round = (path_index, counts) if cache.get_seq_length() > target.committed_length else None
    return SpecGenerateOutput(
        sequences=sequences,
        scores=_stack_steps(row_scores, buffer, sequences),
        logits=_stack_steps(row_logits, buffer, sequences),
        spec_stats=stats,
        **{CACHE_FIELD: returned_cache(target, buffer, last_round)},
    )


@contextlib.contextmanager
def _prefill_positions(model):
    """Records the position ids the model's forward receives in the prefill: `prepare_inputs_for_generation`
    may shift those `generate` prepared (PaliGemma counts from 1), and rounds must continue the same way."""
    used = {}

    def record(module, args, kwargs):
        if "position_ids" not in used and kwargs.get("position_ids") is not None:
            used["position_ids"] = kwargs["position_ids"]

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield used
    finally:
        handle.remove()


def _expand(path_index, values):
    return path_index[..., None].expand(-1, -1, values.shape[-1])


class _RoundTrace:
    """Per-round statistics kept on the device and read back once at the end (no host sync per round)."""

    def __init__(self):
        self.active, self.drafted, self.accepted, self.confidence = [], [], [], []
        self.pruned = 0  # draft nodes trimmed by the cost model (a device scalar once a round adds to it)

    def record(self, active, drafted, accepted, confidence):
        self.active.append(active)
        self.drafted.append(drafted)
        self.accepted.append(accepted)
        if confidence is not None:
            self.confidence.append(confidence)

    def finish(self, stats: SpecStats) -> None:
        stats.pruned_tokens = int(self.pruned)
        if not self.active:
            return
        active = torch.stack(self.active).flatten()  # (rounds * B,) in round order, rows within a round
        accepted = torch.stack(self.accepted).flatten()[active]
        stats.row_rounds = int(active.sum())
        stats.drafted_tokens = int(torch.stack(self.drafted).flatten()[active].sum())
        stats.accepted_tokens = int(accepted.sum())
        stats.accepted_lengths = accepted.tolist()
        if self.confidence:
            stats.sage_alphas = torch.stack(self.confidence).flatten()[active].tolist()


def _emit(buffer, streamer, tokens, counts):
    buffer.append(tokens, counts)
    if streamer is not None and int(counts[0]) > 0:
        streamer.put(tokens[:, : int(counts[0])].cpu())


def _record_scores(row_scores, row_logits, scores, raw, counts):
    for row, count in enumerate(counts.tolist()):
        if row_scores is not None:
            row_scores[row].extend(scores[row, :count])
        if row_logits is not None:
            row_logits[row].extend(raw[row, :count])


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
