"""`sage`: trees shaped per round by the drafter's entropy (SAGE, arXiv 2602.00523; docs/algorithms.md section 1).

Confident drafter (alpha near 1): deep and narrow. Unsure (alpha near 0):
shallow and wide. Every row of a batch has its own alpha, depth and history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from .base import (
    Strategy,
    StrategyConfig,
    check_bool,
    check_choice,
    check_visual_selection,
    check_float,
    check_int,
    check_order,
    limit_to_budget,
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

    row_state = ("alpha", "next_alpha", "d_max", "history", "history_count", "nodes_used")

    def __init__(self, config, batch_size, device):
        super().__init__(config, batch_size, device)
        c = config
        self.alpha = torch.full((batch_size,), c.alpha_init, dtype=torch.float32, device=device)
        self.next_alpha = self.alpha.clone()
        self.d_max = torch.full((batch_size,), float(c.d_max), device=device)
        self.history = torch.zeros(batch_size, c.history_window, device=device)
        self.history_count = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.nodes_used = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def max_children(self):
        return int(round(self.config.w_max))

    def depth(self) -> torch.Tensor:
        """Eq. 10: D(alpha) = D_min + alpha (D_max - D_min), per row."""
        return torch.round(self.config.d_min + self.alpha * (self.d_max - self.config.d_min))

    def width(self) -> torch.Tensor:
        """Eq. 11: W(alpha) = W_min + (1 - alpha) (W_max - W_min), per row."""
        c = self.config
        return c.w_min + (1.0 - self.alpha) * (c.w_max - c.w_min)

    def on_root(self, root_logits):
        confidence = ops.sage_confidence(root_logits, self.config.top_k)
        if self.config.alpha_source == "current_root":
            self.alpha = confidence
        else:  # the previous round's root plans this round; this round's plans the next
            self.alpha = self.next_alpha
            self.next_alpha = confidence
        self.nodes_used.zero_()

    def round_values(self):
        return {"alpha": self.alpha}  # the confidence that shaped each row's tree

    def select(self, level, frontier, candidate_probs):
        c = self.config
        batch, width, k = candidate_probs.shape
        depth = self.depth()  # (B,)
        if level == 1:
            children = self.width()[:, None].expand(batch, width)
        else:  # Eq. 12: W_l = W(alpha) (1/l) (0.5 + P_parent)
            children = self.width()[:, None] * (1.0 / level) * (0.5 + frontier.probs)
        children = torch.round(children).clamp(1, k)  # (B, F)
        rank = torch.arange(k, device=candidate_probs.device)
        take = (rank[None, None, :] < children[..., None]) & frontier.valid[..., None]
        take &= (level <= depth)[:, None, None]
        take = limit_to_budget(take, frontier, candidate_probs, (c.n_max - self.nodes_used).clamp_min(0),
                               self.sampling)
        cum = frontier.cum_probs[..., None] * candidate_probs  # (B, F, K)
        self.nodes_used += take.flatten(1).sum(-1)
        theta = c.theta_scale * level / depth.clamp_min(1)  # (B,)
        score = cum if c.expand_rule == "cumulative" else candidate_probs
        expand = take & (score > theta[:, None, None]) & (level < depth)[:, None, None]
        return take, expand

    def observe(self, accept_length, active):
        c = self.config
        if not c.adaptive_history:
            return
        self.history = torch.where(active[:, None], torch.roll(self.history, 1, dims=1), self.history)
        self.history[:, 0] = torch.where(active, accept_length.float(), self.history[:, 0])
        self.history_count += active.long()
        full = self.history_count >= c.history_window
        mean = self.history.mean(-1)
        step = torch.where(mean < c.history_low, -1.0, torch.where(mean > c.history_high, 1.0, 0.0))
        self.d_max = torch.where(full & active, (self.d_max + step).clamp(c.d_min + 1, c.depth_cap), self.d_max)
