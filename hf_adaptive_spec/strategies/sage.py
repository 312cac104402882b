"""`sage`: trees shaped per round by the drafter's entropy (SAGE, arXiv 2602.00523; docs/algorithms.md section 1).

Confident drafter (alpha near 1): deep and narrow. Unsure (alpha near 0):
shallow and wide. Every row of a batch has its own alpha, depth and history.

With the cost rule (greedy, `verify_cost`) and `plan` on, each row's tree is chosen per round among candidates by
expected accepted tokens per second of round time (`cost.planning`): chains of every depth up to the depth cap
(the one the `chain` strategy would draft among them), the same chains with the drafter's second choice at
depth 1, SAGE's own tree for the row's alpha, and the static tree; alpha is the confidence the measured
acceptance is looked up by.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import ops
from ..cost.planning import DepthAcceptance, RoundPlanner
from ..trees.levels import limit_to_budget
from ..trees.selection import Rule, Shape, ShapeSet
from .static_tree import candidate_shapes, default_tree_paths
from .base import (
    Strategy,
    StrategyConfig,
    check_bool,
    check_choice,
    check_visual_selection,
    check_float,
    check_int,
    check_order,
    on_gpu,
)

ALPHA_SOURCES = ("previous_root", "current_root")
EXPAND_RULES = ("cumulative", "node")


@dataclass
class SageConfig(StrategyConfig):
    """Settings of the `sage` strategy. `None` fields take the device default (GPU values are the paper's).

    Args:
        d_min, d_max (`int`): depth range of Eq. 10 (GPU 3, 8; CPU 2, 20).
        w_min, w_max (`float`): width range of Eq. 11 (GPU 2, 10; CPU 1, 1: entropy-sized chains).
        n_max (`int`): node budget per tree, root excluded (GPU 64; CPU 20).
        top_k (`int`): k of the top-k entropy, Eq. 7-9 (10).
        theta_scale (`float`): expansion threshold theta_l = theta_scale * l / D(alpha) (GPU 0.1; CPU 0.6).
        expand_rule (`str`): what theta_l is compared with: "cumulative" (the path probability P(y_<=l), the
            paper's formal condition; GPU default) or "node" (the node's own drafter probability: keep drafting
            while the drafter stays sure, which suits a CPU, where every verified token beyond ~3 costs; CPU
            default).
        alpha_init (`float`): alpha of the first round (0.5).
        alpha_source (`str`): which drafter distribution sets alpha. "previous_root" (the paper's temporal
            reading: the root distribution of the previous round plans this round; GPU default) or
            "current_root" (this round's root distribution, available before the tree is built at no extra
            cost; CPU default).
        history_window (`int`): acceptance lengths remembered per row (10).
        history_low, history_high (`float`): mean accepted length below which D_max drops by one, above which it
            rises by one (2, 3).
        depth_cap (`int`): upper clamp of the adaptive D_max (default: d_max; at least d_min); the lower clamp is
            d_min + 1.
        adaptive_history (`bool`): enable the D_max adaptation (True).
        verify_cost (`bool`): under greedy decoding, trim each drafted tree to the nodes that pay for their
            verification on the measured cost curve of the target (`hf_adaptive_spec.cost`; GPU False, CPU True).
        plan (`bool`): with `verify_cost` under greedy decoding, draft each round the candidate tree of highest
            expected tokens per second (see the module docstring; True). False: SAGE's rule alone.
        visual_tokens (`int`, *optional*), visual_selection (`str`): how many of the image's visual tokens an
            independent VLM drafter sees, and when the target's attention picks them ("prefill" or "round"; see
            `strategies.base.VISUAL_FIELDS_DOC`). None: the whole image.
    """

    d_min: int | None = None
    d_max: int | None = None
    w_min: float | None = None
    w_max: float | None = None
    n_max: int | None = None
    top_k: int = 10
    theta_scale: float | None = None
    expand_rule: str | None = None
    alpha_init: float = 0.5
    alpha_source: str | None = None
    history_window: int = 10
    history_low: float = 2.0
    history_high: float = 3.0
    depth_cap: int | None = None
    adaptive_history: bool = True
    verify_cost: bool | None = None
    plan: bool = True
    visual_tokens: int | None = None
    visual_selection: str = "prefill"

    def device_defaults(self, device):
        if on_gpu(device):  # the paper's settings
            defaults = {"d_min": 3, "d_max": 8, "w_min": 2.0, "w_max": 10.0, "n_max": 64, "theta_scale": 0.1,
                        "expand_rule": "cumulative", "alpha_source": "previous_root"}
        else:  # on a CPU each extra verified token costs a share of a target step (docs/benchmarks.md)
            defaults = {"d_min": 2, "d_max": 20, "w_min": 1.0, "w_max": 1.0, "n_max": 20, "theta_scale": 0.6,
                        "expand_rule": "node", "alpha_source": "current_root"}
        defaults["verify_cost"] = not on_gpu(device)
        defaults["depth_cap"] = self.d_max if self.d_max is not None else defaults["d_max"]
        return defaults

    def validate(self):
        for name in ("d_min", "d_max", "n_max", "history_window", "depth_cap"):
            check_int(self, name, 1)
        check_int(self, "top_k", 2)
        check_float(self, "w_min", 1.0)
        check_float(self, "w_max", 1.0)
        check_float(self, "theta_scale", 0.0)
        check_float(self, "alpha_init", 0.0, 1.0)
        check_float(self, "history_low", 0.0)
        check_float(self, "history_high", 0.0)
        check_choice(self, "expand_rule", EXPAND_RULES)
        check_choice(self, "alpha_source", ALPHA_SOURCES)
        check_bool(self, "adaptive_history")
        check_bool(self, "verify_cost")
        check_bool(self, "plan")
        check_order(self, "d_min", "d_max")
        check_order(self, "d_min", "depth_cap")
        check_order(self, "w_min", "w_max")
        check_order(self, "history_low", "history_high")
        check_visual_selection(self)

    def check_vocab(self, vocab_size):
        # (top_k beyond the vocabulary is fine: the entropy of Eq. 7 is taken over min(top_k, V) tokens)
        if self.w_max is not None and round(self.w_max) > vocab_size:
            raise ValueError(
                f"SageConfig.w_max must round to at most the drafter's vocabulary ({vocab_size}) children per node, "
                f"got {self.w_max}."
            )


class SageStrategy(Strategy):
    name = "sage"
    config_class = SageConfig

    @property
    def may_pause(self) -> bool:
        """With the current root's confidence (the CPU default) each drafted round plans itself, so rounds in
        which drafting paused change nothing; with the previous root's, each round plans the next."""
        return self.config.alpha_source == "current_root"

    row_state = ("alpha", "next_alpha", "d_max", "history", "history_count", "choice")

    def __init__(self, config, batch_size, device, sampling=False):
        super().__init__(config, batch_size, device, sampling)
        c = config
        self.alpha = torch.full((batch_size,), c.alpha_init, dtype=torch.float32, device=device)
        self.next_alpha = self.alpha.clone()
        self.d_max = torch.full((batch_size,), float(c.d_max), device=device)
        self.history = torch.zeros(batch_size, c.history_window, device=device)
        self.history_count = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.planner = None
        self.choice = torch.zeros(batch_size, dtype=torch.long, device=device)  # each row's planned candidate
        self._cost = self._pricing = self._planned = None

    @property
    def plans(self) -> bool:
        """Whether rounds are planned (`use_cost` sets the planner up): greedy, with the cost rule."""
        return self.config.plan and self.cost_aware and not self.sampling

    def candidate_shapes(self, max_depth: int | None = None) -> list:
        """The shapes a planned round chooses among: chains of every depth up to the depth cap, each also with
        the drafter's second choice at depth 1 as a leaf (one more verified node, no drafter work: it pays
        where the curve is flat at small sizes and the runner-up is often right), SAGE's tree at each alpha
        bin's centre, and the static tree, within the node budget and `max_depth` (the drafter's own limit, if
        it has one)."""
        c = self.config
        depth = c.depth_cap if max_depth is None else min(c.depth_cap, max_depth)
        fields = (c.d_min, c.d_max, c.w_min, c.w_max, c.n_max, c.top_k, c.theta_scale, c.expand_rule)
        return list(_candidates(fields, depth, on_gpu(self.device)))

    def use_cost(self, cost, pricing, max_depth):
        """Planned rounds (`plans`): the planner over `candidate_shapes(max_depth)` prices each row's candidates
        with the target's acceptance per depth (learned in earlier calls of this pair and setting when the
        calibration carries it), verification on the cost curve, and drafter levels at their measured time
        (none for a drafter that drafts every depth in one forward)."""
        if not self.plans:
            return
        self._cost, self._pricing = cost, pricing
        shapes = self.candidate_shapes(max_depth)
        depth = max(len(p) for shape in shapes for p in shape)
        ranks = max(max(p) for shape in shapes for p in shape) + 1
        depths = cost.calibration.depths
        if depths is None or depths.accepted.shape[1:] != (depth, ranks):
            depths = cost.calibration.depths = DepthAcceptance(depth, ranks)

        def verify_seconds(nodes: int) -> float:
            table = cost.host_table
            return cost.scale * table[min(nodes, len(table) - 1)]

        level_seconds = pricing.draft_seconds if pricing is not None else (lambda width: 0.0)
        self.plan_with(RoundPlanner(shapes, depths, verify_seconds, level_seconds))

    def plan_with(self, planner) -> None:
        """Choose each row's tree with `planner` (`cost.planning.RoundPlanner`) from now on."""
        self.planner = planner
        self._planned = _shape_set(tuple(tuple(shape) for shape in planner.shapes))

    def observe_priced(self, tree, target_choice, path_index, round_seconds, verify_seconds):
        """A planned round teaches its planner the target's acceptance per depth and the round's time."""
        if self.planner is None:
            return
        self.planner.observe(tree, target_choice, path_index, self.alpha)
        levels = self._pricing.take_round_levels() if self._pricing is not None else 0.0
        if self._cost is None or self._cost.timed:  # a fixed curve prices rounds as given
            self.planner.observe_round(round_seconds, levels, verify_seconds)

    @property
    def max_children(self):
        width = int(round(self.config.w_max))
        return width if self.planner is None else max(width, self._planned.children)

    def depth(self) -> torch.Tensor:
        """Eq. 10: D(alpha) = D_min + alpha (D_max - D_min), per row."""
        return torch.round(sage_depth(self.config, self.alpha, self.d_max))

    def width(self) -> torch.Tensor:
        """Eq. 11: W(alpha) = W_min + (1 - alpha) (W_max - W_min), per row."""
        return sage_width(self.config, self.alpha)

    def on_root(self, root_logits):
        """Alpha from the drafter's root distribution; the round's selection: each row's planned candidate
        (`Shape`), or SAGE's rule (`Rule`, Eq. 10-12 with the node budget)."""
        confidence = ops.sage_confidence(root_logits, self.config.top_k)
        if self.config.alpha_source == "current_root":
            self.alpha = confidence
        else:  # the previous round's root plans this round; this round's plans the next
            self.alpha = self.next_alpha
            self.next_alpha = confidence
        if self.planner is not None:
            self.choice = self.planner.choose(self.alpha).to(self.alpha.device)
            return Shape(self._planned, self.choice)
        return Rule(self._rule)

    def round_values(self):
        values = {"alpha": self.alpha}  # the confidence that shaped each row's tree
        if self.planner is not None:
            values["candidate"] = self.choice
        return values

    def _rule(self, batch, device):
        """The round's `select` by Eq. 10-12: each frontier node's width, the depth, the expansion threshold,
        within the node budget."""
        c = self.config
        depth = self.depth()  # (B,)
        width = self.width()
        used = torch.zeros(batch, dtype=torch.long, device=device)

        def select(level, frontier, candidate_probs):
            nonlocal used
            k = candidate_probs.shape[2]
            children = torch.round(sage_children(width[:, None], level, frontier.probs)).clamp(1, k)  # (B, F)
            rank = torch.arange(k, device=candidate_probs.device)
            take = (rank[None, None, :] < children[..., None]) & frontier.valid[..., None]
            take &= (level <= depth)[:, None, None]
            take = limit_to_budget(take, frontier, candidate_probs, (c.n_max - used).clamp_min(0), self.sampling)
            cum = frontier.cum_probs[..., None] * candidate_probs  # (B, F, K)
            used = used + take.flatten(1).sum(-1)
            theta = sage_theta(c, level, depth.clamp_min(1))  # (B,)
            score = cum if c.expand_rule == "cumulative" else candidate_probs
            expand = take & (score > theta[:, None, None]) & (level < depth)[:, None, None]
            return take, expand

        return select

    def observe(self, accept_length, active):
        c = self.config
        if not c.adaptive_history or self.planner is not None:  # planned rounds do not read D_max
            return
        self.history = torch.where(active[:, None], torch.roll(self.history, 1, dims=1), self.history)
        self.history[:, 0] = torch.where(active, accept_length.float(), self.history[:, 0])
        self.history_count += active.long()
        full = self.history_count >= c.history_window
        mean = self.history.mean(-1)
        step = torch.where(mean < c.history_low, -1.0, torch.where(mean > c.history_high, 1.0, 0.0))
        self.d_max = torch.where(full & active, (self.d_max + step).clamp(c.d_min + 1, c.depth_cap), self.d_max)


def sage_depth(config, alpha, d_max):
    """Eq. 10 before rounding: D_min + alpha (D_max - D_min) (tensors per row, or floats)."""
    return config.d_min + alpha * (d_max - config.d_min)


def sage_width(config, alpha):
    """Eq. 11: W(alpha) = W_min + (1 - alpha) (W_max - W_min)."""
    return config.w_min + (1.0 - alpha) * (config.w_max - config.w_min)


def sage_children(width, level: int, parent_prob):
    """Eq. 12 before rounding: a level-`level` node's children, W(alpha) at level 1, else
    W(alpha) (1 / l) (0.5 + P_parent)."""
    return width if level == 1 else width * (1.0 / level) * (0.5 + parent_prob)


def sage_theta(config, level: int, depth):
    """The expansion threshold theta_l = theta_scale * l / D(alpha) (`depth` at least 1)."""
    return config.theta_scale * level / depth


def sage_shape(config, alpha: float) -> list[tuple]:
    """SAGE's tree (Eq. 10-12, as `SageStrategy`'s rule) for a row of confidence `alpha`, with each node's drafter
    probability taken as a prior (the top token 0.3 + 0.6 alpha, each lower rank a third of the one above): rank
    paths within the node budget (taken in level order) and `config.d_max`."""
    c = config
    depth = round(sage_depth(c, alpha, c.d_max))
    width = sage_width(c, alpha)
    top = 0.3 + 0.6 * alpha
    paths, frontier = [], [((), 1.0, 1.0)]  # (path, node probability, path probability)
    for level in range(1, depth + 1):
        grown = []
        for path, prob, cum in frontier:
            for rank in range(max(1, min(round(sage_children(width, level, prob)), c.top_k))):
                child_prob = top * (1.0 / 3.0) ** rank
                if len(paths) == c.n_max:
                    return paths
                paths.append(path + (rank,))
                score = cum * child_prob if c.expand_rule == "cumulative" else child_prob
                if level < depth and score > sage_theta(c, level, max(depth, 1)):
                    grown.append((path + (rank,), child_prob, cum * child_prob))
        frontier = grown
    return paths


@lru_cache(maxsize=32)
def _candidates(fields: tuple, depth: int, gpu: bool) -> tuple:
    """`SageStrategy.candidate_shapes` for the shape fields of a config (made once per setting)."""
    d_min, d_max, w_min, w_max, n_max, top_k, theta_scale, expand_rule = fields
    config = SageConfig(d_min=d_min, d_max=d_max, w_min=w_min, w_max=w_max, n_max=n_max, top_k=top_k,
                        theta_scale=theta_scale, expand_rule=expand_rule)
    static = default_tree_paths(24, 6) if gpu else default_tree_paths(6, 5)
    forks = [[(0,) * d for d in range(1, length + 1)] + [(1,)] for length in range(1, depth + 1)]
    extra = forks + [sage_shape(config, (b + 0.5) / 10) for b in range(10)] + [static]
    return tuple(candidate_shapes(depth, n_max, [[p for p in shape if len(p) <= depth] for shape in extra]))


@lru_cache(maxsize=32)
def _shape_set(shapes: tuple) -> ShapeSet:
    """The planned candidates as a `ShapeSet` (made once per set of shapes: every call of a setting plans over
    the same ones; read only)."""
    return ShapeSet(shapes)
