"""Strategy rules checked on constructed frontiers (no model): SAGE Eq. 7-12, budgets, history; chain; static tree."""

import math

import pytest
import torch

from hf_adaptive_spec.strategies import (
    ChainConfig,
    ChainStrategy,
    SageConfig,
    SageStrategy,
    StaticTreeConfig,
    StaticTreeStrategy,
)
from hf_adaptive_spec.trees.levels import Frontier
from hf_adaptive_spec.trees.selection import shape_tables

CPU = torch.device("cpu")


def _sage(**overrides):
    config = SageConfig(**{"d_min": 3, "d_max": 8, "w_min": 2, "w_max": 10, "n_max": 64, **overrides}).resolve(CPU)
    return SageStrategy(config, batch_size=2, device=CPU)


def _logits_with_alpha(values):
    """Logits whose top-10 entropy gives alpha 1 (one token) or 0 (ten equal tokens)."""
    rows = []
    for value in values:
        row = torch.full((50,), -1e4)
        if value == 1.0:
            row[0] = 0.0
        else:
            row[:10] = 0.0
        rows.append(row)
    return torch.stack(rows)


def test_sage_depth_and_width_follow_eq_10_11():
    sage = _sage(alpha_source="current_root")
    sage.on_root(_logits_with_alpha([1.0, 0.0]))
    assert sage.alpha.tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    assert sage.depth().tolist() == [8.0, 3.0]  # confident: D_max; unsure: D_min
    assert sage.width().tolist() == pytest.approx([2.0, 10.0])  # confident: W_min; unsure: W_max


def test_sage_previous_root_plans_the_next_round():
    sage = _sage(alpha_init=0.5, alpha_source="previous_root")
    sage.on_root(_logits_with_alpha([1.0, 1.0]))
    assert sage.alpha.tolist() == [0.5, 0.5]  # this round still uses alpha_0
    sage.on_root(_logits_with_alpha([0.0, 0.0]))
    assert sage.alpha.tolist() == pytest.approx([1.0, 1.0])  # planned from the previous root


def test_sage_children_counts_follow_eq_12():
    sage = _sage(alpha_source="current_root", alpha_init=0.0)
    select = sage.on_root(_logits_with_alpha([0.0, 0.0])).selector(2, CPU)  # W = 10, D = 3
    k = 10
    root = Frontier(probs=torch.ones(2, 1), cum_probs=torch.ones(2, 1), valid=torch.ones(2, 1, dtype=torch.bool))
    take, _ = select(1, root, torch.full((2, 1, k), 0.09))
    assert take.sum(-1).tolist() == [[10], [10]]
    # level 2: W_2 = 10 * (1/2) * (0.5 + P_parent)
    parents = Frontier(probs=torch.tensor([[0.9, 0.1], [0.5, 0.3]]), cum_probs=torch.full((2, 2), 0.5),
                       valid=torch.ones(2, 2, dtype=torch.bool))
    take, _ = select(2, parents, torch.full((2, 2, k), 0.05))
    expected = [[round(10 * 0.5 * (0.5 + p)) for p in row] for row in [[0.9, 0.1], [0.5, 0.3]]]
    assert take.sum(-1).tolist() == expected


def test_sage_node_budget_keeps_the_most_probable():
    sage = _sage(alpha_source="current_root", n_max=3)
    select = sage.on_root(_logits_with_alpha([0.0, 0.0])).selector(2, CPU)
    root = Frontier(probs=torch.ones(2, 1), cum_probs=torch.ones(2, 1), valid=torch.ones(2, 1, dtype=torch.bool))
    probs = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.005, 0.005]).expand(2, 1, -1)
    take, _ = select(1, root, probs)
    assert take[0, 0].tolist() == [True, True, True] + [False] * 7
    take, _ = select(2, root, probs)  # the budget is spent for this round
    assert not bool(take.any())


def test_sage_expansion_threshold_uses_cumulative_probability():
    sage = _sage(alpha_source="current_root", theta_scale=0.1, expand_rule="cumulative")
    select = sage.on_root(_logits_with_alpha([1.0, 1.0])).selector(2, CPU)  # D = 8: theta_2 = 0.1 * 2 / 8 = 0.025
    parent = Frontier(probs=torch.full((2, 1), 0.04), cum_probs=torch.full((2, 1), 0.04),
                      valid=torch.ones(2, 1, dtype=torch.bool))
    probs = torch.tensor([0.9, 0.1] + [0.0] * 8).expand(2, 1, -1)
    take, expand = select(2, parent, probs)
    assert take[0, 0, :1].tolist() == [True]
    assert expand[0, 0, :1].tolist() == [True]  # cumulative 0.036 > 0.025
    parent.cum_probs = torch.full((2, 1), 0.02)
    _, expand = select(2, parent, probs)
    assert expand[0, 0, :1].tolist() == [False]  # cumulative 0.018 < 0.025


def test_sage_node_rule_uses_the_node_probability():
    sage = _sage(alpha_source="current_root", theta_scale=0.4, expand_rule="node", d_min=2, d_max=4)
    select = sage.on_root(_logits_with_alpha([1.0, 1.0])).selector(2, CPU)  # D = 4: theta_2 = 0.4 * 2 / 4 = 0.2
    parent = Frontier(probs=torch.full((2, 1), 0.9), cum_probs=torch.full((2, 1), 0.01),
                      valid=torch.ones(2, 1, dtype=torch.bool))
    probs = torch.tensor([0.3, 0.15] + [0.0] * 8).expand(2, 1, -1)
    take, expand = select(2, parent, probs)
    assert expand[0, 0, :2].tolist() == [True, False]  # 0.3 > 0.2 > 0.15, whatever the path probability


def test_sage_history_moves_d_max_with_hysteresis():
    sage = _sage(history_window=4, history_low=2.0, history_high=3.0)
    active = torch.ones(2, dtype=torch.bool)
    for _ in range(4):
        sage.observe(torch.tensor([1, 2]), active)  # row 0 mean 1 < 2; row 1 mean 2 (between)
    assert sage.d_max.tolist() == [7.0, 8.0]
    for _ in range(10):
        sage.observe(torch.tensor([0, 5]), active)
    assert sage.d_max.tolist() == [4.0, 8.0]  # clamped to [d_min + 1, depth_cap]


def test_sage_history_ignores_finished_rows():
    sage = _sage(history_window=2)
    for _ in range(5):
        sage.observe(torch.tensor([0, 0]), torch.tensor([True, False]))
    assert sage.d_max.tolist() == [4.0, 8.0]


def test_sage_cpu_and_gpu_defaults_differ():
    cpu = SageConfig().resolve(torch.device("cpu"))
    gpu = SageConfig().resolve(torch.device("cuda"))
    assert (gpu.d_min, gpu.d_max, gpu.w_min, gpu.w_max, gpu.n_max) == (3, 8, 2.0, 10.0, 64)
    assert cpu.n_max < gpu.n_max
    assert SageConfig(d_max=5).resolve(CPU).depth_cap == 5


def test_chain_length_adapts_per_row():
    chain = ChainStrategy(ChainConfig(num_draft_tokens=4).resolve(CPU), batch_size=2, device=CPU)
    chain.observe(torch.tensor([4, 1]), torch.ones(2, dtype=torch.bool))
    assert chain.length.tolist() == [6, 3]
    for _ in range(10):
        chain.observe(torch.tensor([0, 100]), torch.ones(2, dtype=torch.bool))
    assert chain.length.tolist() == [1, 8]  # CPU bounds 1..8
    root = Frontier(probs=torch.ones(2, 1), cum_probs=torch.ones(2, 1), valid=torch.ones(2, 1, dtype=torch.bool))
    take, expand = chain.on_root(None).selector(2, CPU)(1, root, torch.ones(2, 1, 1))
    assert take.flatten().tolist() == [True, True] and expand.flatten().tolist() == [False, True]


def test_static_tree_tables_follow_the_paths():
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0)]
    static = StaticTreeStrategy(StaticTreeConfig(paths=paths).resolve(CPU), batch_size=1, device=CPU)
    assert static.max_children == 3
    takes, expands = shape_tables(paths, static.max_children, CPU)
    assert takes[0].tolist() == [[True, True, True]]
    assert expands[0].tolist() == [[True, False, True]]
    # level 2 frontier: (0,), (2,) in order
    assert takes[1].tolist() == [[True, True, False], [True, False, False]]
    assert expands[1].tolist() == [[True, False, False], [False, False, False]]
    assert takes[2].tolist() == [[True, False, False]]
    # the strategy selects by them: level 2 over that frontier
    frontier = Frontier(probs=torch.ones(1, 2), cum_probs=torch.ones(1, 2), valid=torch.ones(1, 2, dtype=torch.bool))
    take, expand = static.on_root(None).selector(1, CPU)(2, frontier, torch.ones(1, 2, 3))
    assert take[0].tolist() == takes[1].tolist() and expand[0].tolist() == expands[1].tolist()


def test_sage_confidence_reference_matches_formula():
    from hf_adaptive_spec.ops import sage_confidence

    logits = torch.randn(3, 40)
    probs = torch.softmax(logits, -1)
    top = probs.topk(10, -1).values
    renormalised = top / top.sum(-1, keepdim=True)
    entropy = -(renormalised * renormalised.log()).sum(-1)
    torch.testing.assert_close(sage_confidence(logits, 10), 1 - entropy / math.log(10))
