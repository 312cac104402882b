"""`laspec`: the LaSpec block drafter's proposals, verified as far as they pay (Uni-LaSpec, docs/algorithms.md
section 2).

One drafter forward gives the distribution of each of the next `block_size`
tokens. The candidate tree offers every node of depth d the top-`top_k` tokens
of the depth-(d+1) distribution, keeps the `n_max` nodes of highest path
probability, and the loop's cost model (`hf_adaptive_spec.cost`) then keeps
only the nodes whose survival probability pays for their marginal
verification cost on the measured curve: a full tree where extra verified
tokens are nearly free (a GPU at light load), a truncated chain where they are
not (a large batch, or a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..trees.selection import Budget
from .base import Strategy, StrategyConfig, check_bool, check_int, on_gpu


@dataclass
class LaSpecConfig(StrategyConfig):
    """Settings of the `laspec` strategy (needs a `LaSpecDrafterModel` as `assistant_model`).

    Args:
        block_size (`int`, *optional*): tokens per drafter block, the tree's depth limit (default: the drafter's
            `config.block_size`).
        top_k (`int`, *optional*): children offered per node (GPU 4, CPU 2).
        n_max (`int`, *optional*): candidate nodes per tree before the cost rule, root excluded (GPU 48, CPU 16).
        verify_cost (`bool`, defaults to `True`): apply the marginal-cost rule (greedy decoding); False verifies
            the whole candidate tree.
        num_visual_tokens (`int`, *optional*): visual tokens selected per round for the drafter's cross-attention
            (default: the drafter's `config.num_visual_tokens`; 0 turns the visual branch off).
        context_lookup (`int`, defaults to 4): under greedy decoding, also offer the tokens that followed the
            latest earlier occurrence of the sequence's last n tokens (n up to this, longest first), as one more
            branch of the tree (`hf_adaptive_spec.trees.branches`); the cost rule keeps its nodes when their measured
            acceptance pays. 0 turns it off.
        lookup_tokens (`int`, defaults to 8): tokens on that branch (a repetition, once found, often runs past
            the drafter's block; the cost rule prices every node of it; docs/laspec.md has the measured effect).
        datastore (`bool`, *optional*): under greedy decoding, also offer the continuation that the drafter's
            datastore (`hf_adaptive_spec.drafters.datastore`: e.g. the target's own answers to training requests) shares
            for the sequence's longest matching suffix, as one more branch; the cost rule keeps its nodes when
            their measured acceptance pays. `None` (default): when the drafter carries one; True: require it;
            False: off.
        datastore_tokens (`int`, defaults to 8): tokens on that branch.
    """

    block_size: int | None = None
    top_k: int | None = None
    n_max: int | None = None
    verify_cost: bool = True
    num_visual_tokens: int | None = None
    context_lookup: int = 4
    lookup_tokens: int = 8
    datastore: bool | None = None
    datastore_tokens: int = 8

    def device_defaults(self, device):
        gpu = on_gpu(device)
        return {"top_k": 4 if gpu else 2, "n_max": 48 if gpu else 16}

    def validate(self):
        for name in ("block_size", "top_k", "n_max", "lookup_tokens", "datastore_tokens"):
            check_int(self, name, 1)
        check_int(self, "num_visual_tokens", 0)
        check_int(self, "context_lookup", 0)
        check_bool(self, "verify_cost")
        check_bool(self, "datastore")

    def block_drafter_options(self):
        return {**super().block_drafter_options(), "block_size": self.block_size,
                "num_visual_tokens": self.num_visual_tokens,
                "context_lookup": self.context_lookup, "lookup_tokens": self.lookup_tokens,
                "datastore": self.datastore, "datastore_tokens": self.datastore_tokens}

    def check_vocab(self, vocab_size):
        if self.top_k is not None and self.top_k > vocab_size:
            raise ValueError(
                f"LaSpecConfig.top_k must be <= the drafter's vocabulary ({vocab_size}), got {self.top_k}."
            )


class LaSpecStrategy(Strategy):
    name = "laspec"
    config_class = LaSpecConfig
    requires_block_drafter = True

    @property
    def max_children(self):
        return self.config.top_k

    def on_root(self, root_logits):
        return Budget(self.config.n_max, self.sampling)
