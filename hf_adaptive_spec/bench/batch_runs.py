"""The batched modes' methods (plain, fixed chains and trees, the adaptive rules) and their batched runs: prompts
encoded once and padded on the left, one timed greedy `generate` per batch, the structure it verified."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..cost import SpecCalibration
from .inputs import encode_prompt
from .methods import sync
from .report import jsonable
from .stats import PLAIN, PLAIN_MODE

__all__ = ["CHAIN_LENGTHS", "LASPEC_FIXED", "LASPEC_TREE_TOP_K", "LINEAR_CHAIN", "STATIC_TREE_DEPTH", "TREE_SIZES",
           "WARMUP_TOKENS", "BatchRun", "LoadMethod", "arrival_methods", "decode_batch", "encoder", "eos_ids",
           "load_methods", "mismatched_rows", "pad_encodings", "pad_id", "prompt_id", "row_tokens", "show", "step",
           "structure_stats"]


CHAIN_LENGTHS = (1, 2, 4, 8)
TREE_SIZES = (8, 16)
LASPEC_TREE_TOP_K = 2  # children offered per node of a fixed laspec tree
STATIC_TREE_DEPTH = 6  # depth limit of a fixed static tree (`default_tree_paths`)
LINEAR_CHAIN = 4  # the arrivals' linear verification: a chain of this many draft tokens (or the longest one run)
WARMUP_TOKENS = 16  # new tokens of an untimed warm-up run
# the fixed laspec structures: no cost rule, no context-lookup or datastore branch beside the drafted tree
LASPEC_FIXED = {"verify_cost": False, "context_lookup": 0, "datastore": False}


@dataclass
class LoadMethod:
    """One way to decode a batch.

    Fields:
        name: ``"plain"``, ``"plain_mode"``, ``"chain{k}"``, ``"tree{n}"`` or the adaptive strategy's name.
        family: ``"plain"``, ``"plain_mode"`` (`spec_strategy="plain"`: the library's rounds without a drafter,
            the second baseline), ``"fixed"`` (a structure set in advance, cost rule off) or ``"adaptive"`` (the
            strategy's rule with the cost rule on).
        strategy: the `spec_strategy` (None for plain).
        spec_config: the strategy's `spec_config` dict (None for plain).
        size: draft nodes per round of a fixed structure (k of a chain, n of a tree); None otherwise.
        calibration: what the cost rule learns, carried from one of this method's calls to the next.
    """

    name: str
    family: str
    strategy: Optional[str] = None
    spec_config: Optional[dict] = None
    size: Optional[int] = None
    calibration: SpecCalibration = field(default_factory=SpecCalibration, repr=False, compare=False)

    def generate_kwargs(self, drafter) -> dict:
        """The speculative `generate` arguments of this method (none for plain)."""
        if self.family == "plain":
            return {}
        if self.family == "plain_mode":
            return {"spec_strategy": "plain"}
        return {"assistant_model": drafter, "spec_strategy": self.strategy,
                "spec_config": None if self.spec_config is None else dict(self.spec_config),
                "spec_calibration": self.calibration}

    def to_dict(self) -> dict:
        return {"family": self.family, "strategy": self.strategy,
                "spec_config": jsonable(self.spec_config), "size": self.size}


def load_methods(laspec: bool, adaptive: Sequence[str], spec_configs: Optional[dict] = None,
                 block_size: Optional[int] = None, chain_lengths: Sequence[int] = CHAIN_LENGTHS,
                 tree_sizes: Sequence[int] = TREE_SIZES, plain_mode: bool = True) -> tuple:
    """The methods of the batched modes, in their base order: plain, the plain mode, the fixed chains and trees,
    the adaptive rules.

    Args:
        laspec: True for a LaSpec drafter (fixed structures through `laspec`), False for an independent one
            (through `chain` and `static_tree`).
        adaptive: the adaptive strategies, e.g. ``["laspec", "sage"]``.
        spec_configs: `{strategy: spec_config dict}` for the adaptive methods (over the cost rule on).
        block_size: a LaSpec drafter's block size: chains longer than it are left out (it drafts no deeper).
        chain_lengths / tree_sizes: the fixed structures.
        plain_mode: also run ``plain_mode`` (`spec_strategy="plain"`), the library's forward without a drafter:
            what the faster forward alone gives, so each method's share from speculation shows.

    Returns:
        `(methods, skipped)`: a list of `LoadMethod` and `{name: reason}` of the fixed structures left out.
    """
    from ..strategies import default_tree_paths

    spec_configs = spec_configs or {}
    methods, skipped = [LoadMethod(PLAIN, "plain")], {}
    if plain_mode:
        methods.append(LoadMethod(PLAIN_MODE, "plain_mode", "plain"))
    for k in chain_lengths:
        name = f"chain{k}"
        if laspec:
            if block_size is not None and k > block_size:
                skipped[name] = f"the LaSpec drafter drafts at most block_size={block_size} tokens per round"
                continue
            methods.append(LoadMethod(name, "fixed", "laspec", {"top_k": 1, "n_max": k, **LASPEC_FIXED}, k))
        else:
            config = {"num_draft_tokens": k, "min_draft_tokens": k, "max_draft_tokens": k, "adaptive": False,
                      "verify_cost": False}
            methods.append(LoadMethod(name, "fixed", "chain", config, k))
    for n in tree_sizes:
        if laspec:
            config = {"top_k": LASPEC_TREE_TOP_K, "n_max": n, **LASPEC_FIXED}
            methods.append(LoadMethod(f"tree{n}", "fixed", "laspec", config, n))
        else:
            paths = [list(path) for path in default_tree_paths(n, STATIC_TREE_DEPTH)]
            methods.append(LoadMethod(f"tree{n}", "fixed", "static_tree", {"paths": paths}, n))
    for strategy in adaptive:
        config = {"verify_cost": True, **(spec_configs.get(strategy) or {})}
        methods.append(LoadMethod(strategy, "adaptive", strategy, config))
    return methods, skipped


def arrival_methods(methods: Sequence[LoadMethod]) -> list:
    """The arrivals' methods: plain, the plain mode, the linear verification (``chain4``, else the longest chain)
    and every adaptive method."""
    chains = [m for m in methods if m.family == "fixed" and m.name.startswith("chain")]
    linear = next((m for m in chains if m.size == LINEAR_CHAIN), max(chains, key=lambda m: m.size, default=None))
    chosen = [m for m in methods if m.family in ("plain", "plain_mode")] + ([linear] if linear is not None else [])
    return chosen + [m for m in methods if m.family == "adaptive"]


def pad_encodings(encoded: Sequence[dict], pad_token_id: int) -> dict:
    """One batch `{"input_ids", "attention_mask"}` `(B, T_max)` from B encoded prompts `(1, T_i)`, each row
    padded on the left with `pad_token_id` (attention mask 0)."""
    width = max(e["input_ids"].shape[1] for e in encoded)
    first = encoded[0]["input_ids"]
    input_ids = torch.full((len(encoded), width), pad_token_id, dtype=first.dtype, device=first.device)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long, device=first.device)
    for row, e in enumerate(encoded):
        length = e["input_ids"].shape[1]
        input_ids[row, width - length:] = e["input_ids"][0]
        attention_mask[row, width - length:] = e["attention_mask"][0]
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def row_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_ids: Sequence[int] = ()) -> list:
    """Each row's new tokens `[[int]]` from `generate`'s `sequences` `(B, T + N)`, up to and including the row's
    first EOS (after it, `generate` only pads)."""
    eos = set(eos_token_ids)
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


def eos_ids(target) -> list:
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass
class BatchRun:
    """What one batched `generate` gave: new tokens per row (up to its EOS), seconds, `SpecStats` or None."""

    rows: list
    seconds: float
    stats: object = None


@torch.no_grad()
def decode_batch(method: LoadMethod, target, drafter, inputs: dict, max_new_tokens: int,
                 pad_token_id: Optional[int] = None, eos_token_ids: Sequence[int] = ()) -> BatchRun:
    """One greedy `generate` of `method` on the left-padded batch `inputs`, timed with `time.perf_counter`."""
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                  **method.generate_kwargs(drafter))
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    device = inputs["input_ids"].device
    sync(device)
    start = time.perf_counter()
    out = target.generate(**inputs, **kwargs)
    sync(device)
    seconds = time.perf_counter() - start
    rows = row_tokens(out.sequences, inputs["input_ids"].shape[1], eos_token_ids)
    return BatchRun(rows, seconds, getattr(out, "spec_stats", None))


def structure_stats(stats) -> dict:
    """tau and the structure verified per row and round, from a run's `SpecStats` (None: plain, tau 1).

    ``nodes_per_round`` = drafted_tokens / row_rounds (draft nodes verified per row and round, root not
    counted, paused rounds as 0); ``candidates_per_round`` = (drafted + pruned) / row_rounds (before the cost
    rule); the sums (``tau_num``, ``tau_den`` = row_rounds, ``drafted``, ``pruned``) pool over runs.
    """
    if stats is None:
        return {"tau": 1.0, "nodes_per_round": None, "candidates_per_round": None, "rounds": None,
                "row_rounds": None, "paused_rounds": None, "acceptance_rate": None, "tau_num": None, "tau_den": None,
                "drafted": None, "pruned": None}
    row_rounds = stats.row_rounds
    return {
        "tau": stats.mean_accepted_length if row_rounds else None,
        "nodes_per_round": stats.drafted_tokens / row_rounds if row_rounds else None,
        "candidates_per_round": (stats.drafted_tokens + stats.pruned_tokens) / row_rounds if row_rounds else None,
        "rounds": stats.rounds, "row_rounds": row_rounds, "paused_rounds": stats.paused_rounds,
        "acceptance_rate": stats.acceptance_rate if stats.drafted_tokens else None,
        "tau_num": stats.accepted_tokens + row_rounds, "tau_den": row_rounds,
        "drafted": stats.drafted_tokens, "pruned": stats.pruned_tokens,
    }


def mismatched_rows(reference: list, rows: list) -> list:
    """Rows (indices) whose tokens differ from the reference's (a missing or extra row differs too)."""
    differ = [i for i, (a, b) in enumerate(zip(reference, rows)) if a != b]
    return differ + list(range(min(len(reference), len(rows)), max(len(reference), len(rows))))


def encoder(tokenizer, prompts: Sequence, device) -> Callable[[int], dict]:
    """`index -> {"input_ids", "attention_mask"}` `(1, T)` of prompt `index % len(prompts)`, encoded once."""
    cache = {}

    def encode(index: int) -> dict:
        index %= len(prompts)
        if index not in cache:
            prompt = prompts[index]
            messages = getattr(prompt, "messages", prompt)
            cache[index] = encode_prompt(tokenizer, messages, device)
        return cache[index]

    return encode


def prompt_id(prompts: Sequence, index: int):
    return getattr(prompts[index % len(prompts)], "id", index % len(prompts))


def pad_id(tokenizer) -> Optional[int]:
    pad = getattr(tokenizer, "pad_token_id", None)
    return getattr(tokenizer, "eos_token_id", None) if pad is None else pad


def show(progress, text: str) -> None:
    if progress is not None:
        progress.set_postfix_str(text)


def step(progress) -> None:
    if progress is not None:
        progress.update(1)
