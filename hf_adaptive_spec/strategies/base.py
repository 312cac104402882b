"""What a strategy decides: which drafter candidates enter the tree, and which of them grow further.

Once per round, with the drafter's distribution at the root, the strategy answers with one selection value
(`trees.selection`): a `Shape` (fixed rank paths, one of a set per row), a `Budget` (the candidates of highest
path probability up to a node count) or a `Rule` (any per-level choice of `take` and `expand` masks). The tree
builder (`trees.build`) reads it. Strategies hold only per-row state across rounds; they never touch a model
or a cache.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, fields

import torch

from ..runtime import RUNTIME_FIELDS


@dataclass
class StrategyConfig:
    """Base class of strategy settings; `None` fields take a per-device default (see `resolve`).

    Every field is checked on construction (`validate`, run by `__post_init__`): a wrong type raises a
    `TypeError`, a value out of range a `ValueError`, both naming the class and the field. Checks that need the
    vocabulary run in `check_vocab`, before decoding starts.

    `to_dict` / `from_dict` turn a config into JSON-friendly values and back. `GenerationConfig.to_json_string`
    writes a dataclass through its `to_dict`, so `generation_config.spec_config = SageConfig(...)` is saved by
    `save_pretrained` as a dict of the fields; `GenerationConfig.from_pretrained` gives that dict back, which
    `generate` accepts as `spec_config` as is (`from_dict` rebuilds the object).

    How rounds run (the CPU kernel, the lean forward, row retirement, ...) is not a strategy's setting: it goes
    in `spec_runtime` (`runtime.RuntimeConfig`), beside `spec_config`.
    """

    def __post_init__(self):
        self.validate()

    def resolve(self, device: torch.device) -> "StrategyConfig":
        """A copy with every `None` field replaced by this device type's default."""
        defaults = self.device_defaults(device)
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        filled = {}
        for name, value in values.items():
            if value is None and name in defaults:
                values[name] = filled[name] = defaults[name]
        try:
            return type(self)(**values)
        except ValueError as exc:
            named = {n: v for n, v in filled.items() if re.search(rf"\b{type(self).__name__}\.{n}\b", str(exc))}
            if not named:
                raise
            taken = ", ".join(f"{name}={value!r}" for name, value in named.items())
            message = f"{exc} ({taken}: the {torch.device(device).type} default for a field left None)"
            raise ValueError(message) from None

    def device_defaults(self, device: torch.device) -> dict:
        return {}

    def validate(self) -> None:
        """Check every field's type and range (`None` where it takes a default); subclasses extend this."""

    def check_vocab(self, vocab_size: int) -> None:
        """Raise a `ValueError` naming the field if this (resolved) config asks for more candidates per node than
        a drafter with `vocab_size` tokens has."""

    def block_drafter_options(self) -> dict:
        """Keyword arguments for a LaSpec block drafter (`drafters.block.BlockDrafter`) drafting for this
        strategy; by default none: the drafter's own defaults (its block size and visual tokens, no extra
        branches)."""
        return {}

    def independent_drafter_options(self) -> dict:
        """Keyword arguments for an independent drafter (`drafters.independent.IndependentDrafter`): how many of
        the image's visual tokens a VLM drafter sees and when they are chosen (the `visual_tokens` and
        `visual_selection` fields, in the strategies that have them); none by default: the whole image."""
        if getattr(self, "visual_tokens", None) is None:
            return {}
        return {"num_visual_tokens": self.visual_tokens, "visual_selection": self.visual_selection}

    def to_dict(self) -> dict:
        """Every field by name, JSON-friendly (tuples become lists)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "StrategyConfig":
        """The config from `to_dict`'s output (or any dict of its fields); an unknown name is a `TypeError`."""
        if not isinstance(values, dict):
            raise TypeError(f"{cls.__name__}.from_dict needs a dict of its fields, got {type(values).__name__}.")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        runtime = [name for name in unknown if name in RUNTIME_FIELDS]
        if runtime:
            raise TypeError(f"{runtime[0]!r} is a runtime setting, not a {cls.__name__} field: pass it as "
                            f"generate(..., spec_runtime={{{runtime[0]!r}: ...}}).")
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {unknown[0]!r}; its fields: {', '.join(names)}.")
        return cls(**values)


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _fail(config, name: str, requirement: str, error: type = ValueError):
    value = getattr(config, name)
    raise error(f"{type(config).__name__}.{name} must be {requirement}, got {value!r}.")


def _none_allowed(config, name: str) -> bool:
    return next(f for f in fields(config) if f.name == name).default is None


def check_int(config, name: str, minimum: int) -> None:
    """Field `name` is an int >= `minimum` (not a bool or float), or None where that is its default."""
    value = getattr(config, name)
    if value is None and _none_allowed(config, name):
        return
    requirement = f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(config, name, requirement, TypeError)
    if type(value) is not int:  # e.g. a numpy integer: stored as a plain int, so the config stays JSON-friendly
        setattr(config, name, int(value))
    if value < minimum:
        _fail(config, name, requirement)


def check_float(config, name: str, minimum: float, maximum: float | None = None) -> None:
    """Field `name` is a real number (an int is fine, a bool is not) in `[minimum, maximum]`, or None where that is
    its default."""
    value = getattr(config, name)
    if value is None and _none_allowed(config, name):
        return
    requirement = f"a number >= {minimum:g}" if maximum is None else f"a number in [{minimum:g}, {maximum:g}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(config, name, requirement, TypeError)
    if not isinstance(value, (int, float)):  # e.g. a numpy float
        setattr(config, name, float(value))
    if not (value >= minimum and (maximum is None or value <= maximum)):  # NaN fails too
        _fail(config, name, requirement)


def check_bool(config, name: str) -> None:
    """Field `name` is True or False, or None where that is its default."""
    value = getattr(config, name)
    if value is None and _none_allowed(config, name):
        return
    if not isinstance(value, bool):
        _fail(config, name, "None, True or False" if _none_allowed(config, name) else "True or False", TypeError)


def check_choice(config, name: str, choices: tuple) -> None:
    """Field `name` is one of `choices`, or None where that is its default."""
    value = getattr(config, name)
    if value is None and _none_allowed(config, name):
        return
    if not isinstance(value, str):
        _fail(config, name, f"one of {choices}", TypeError)
    if value not in choices:
        _fail(config, name, f"one of {choices}")


VISUAL_SELECTIONS = ("prefill", "round")

VISUAL_FIELDS_DOC = """
        visual_tokens (`int`, *optional*): an independent VLM drafter sees only this many of the image's visual
            tokens, those the target's attention picks (int8 keys, cross-layer vote; `drafters.visual_view`); 0
            hides the image from the drafter. None (default): the whole image. Not for a LaSpec drafter (its
            setting is `LaSpecConfig.num_visual_tokens`).
        visual_selection (`str`): when they are picked: "prefill" (once, by the prompt's last query; default) or
            "round" (again after every round, by the last accepted position's query)."""


def check_visual_selection(config) -> None:
    """The `visual_tokens` / `visual_selection` fields (`VISUAL_FIELDS_DOC`)."""
    check_int(config, "visual_tokens", 0)
    check_choice(config, "visual_selection", VISUAL_SELECTIONS)


def check_order(config, low: str, high: str) -> None:
    """Fields `low` <= `high` where both are set."""
    a, b = getattr(config, low), getattr(config, high)
    if a is not None and b is not None and a > b:
        cls = type(config).__name__
        raise ValueError(f"{cls}.{low} must be <= {cls}.{high}, got {a!r} > {b!r}.")


class Strategy:
    """Base class. Subclasses set `name` and `config_class` and implement `on_root` (the round's selection).

    Args:
        config (`StrategyConfig`): resolved settings.
        batch_size (`int`): rows of the batch.
        device: where per-row state lives.
        sampling (`bool`): the call samples (draws must stay unbiased: no selection by a drawn node's value).
    """

    name: str = ""
    config_class: type = StrategyConfig
    requires_block_drafter: bool = False  # True: only a LaSpecDrafterModel can draft for it
    drafts_nothing: bool = False  # True: no drafter, each round verifies the pending token alone (`plain`)
    # False: every round must draft (a round that verifies the root alone, when drafting does not pay, would not
    # follow the strategy's per-round state)
    may_pause: bool = True
    # names of the `(B, ...)` tensors that hold per-row state (`keep_rows` selects them when rows leave)
    row_state: tuple = ()

    def __init__(self, config: StrategyConfig, batch_size: int, device: torch.device, sampling: bool = False):
        self.config = config
        self.batch_size = batch_size
        self.device = device
        self.sampling = sampling

    @property
    def cost_aware(self) -> bool:
        """True if the loop should trim each drafted tree with the verifier cost model (`cost/`) before
        verifying it. Greedy decoding only: under sampling, dropping a drawn node for its own value would bias
        the draws."""
        return bool(getattr(self.config, "verify_cost", False))

    @property
    def max_children(self) -> int:
        """K: how many top candidates per frontier node the loop offers."""
        raise NotImplementedError

    def on_root(self, root_logits: torch.Tensor):
        """This round's selection (`trees.selection.Shape`, `Budget` or `Rule`), from the drafter's processed
        logits `(B, V)` at the root (a block drafter without logits processors gives them over its draft
        vocabulary, V' <= V ids: the same distribution; strategies read it, never its ids)."""
        raise NotImplementedError

    def use_cost(self, cost, pricing, max_depth: int | None) -> None:
        """The call's cost rule (greedy, `cost.CostModel`), its drafting prices (`cost.DraftPricing` or None) and
        the drafter's depth limit (None: none), before the first round: a strategy that plans its rounds by
        them sets its planner up here. Nothing by default."""

    def round_values(self) -> dict:
        """`{name: (B,) tensor}`: per-row values of this round that the strategy reports (collected into
        `SpecStats.round_values`, aligned with its `accepted_lengths`); empty by default."""
        return {}

    def observe(self, accept_length: torch.Tensor, active: torch.Tensor) -> None:
        """Called after verification with accepted draft tokens per row `(B,)` and active rows `(B,)`."""

    def observe_priced(self, tree, target_choice: torch.Tensor, path_index: torch.Tensor, round_seconds: float,
                       verify_seconds: float) -> None:
        """After a drafted round under the cost rule: the verified `tree`, the target's greedy token after each
        node `(B, N)`, the accepted path `(B, D + 1)`, the round's and its verification's seconds. Nothing by
        default (a planning strategy learns from it)."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the state of rows `rows` `(B',)` only, in that order (finished rows left the batch)."""
        for name in self.row_state:
            setattr(self, name, getattr(self, name)[rows])
        self.batch_size = rows.shape[0]

    def join(self, other: "Strategy") -> None:
        """`other`'s rows (the same strategy and settings, another run) follow this batch's rows."""
        if type(other) is not type(self) or other.config != self.config:
            raise ValueError("rows join a batch of the same strategy and settings.")
        for name in self.row_state:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.batch_size += other.batch_size


def on_gpu(device: torch.device) -> bool:
    return torch.device(device).type != "cpu"
