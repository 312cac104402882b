"""Each planned `sage` round drafts the candidate tree of highest expected tokens per second (`cost.planning`):
the choice is the best of the enumerated candidates, a chain where verification is steep, a wider tree where it
is flat, the acceptance it prices is what the target accepted, and outputs stay exactly plain greedy."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_adaptive_spec import SageConfig, cost
from hf_adaptive_spec.cost import CostProfile
from hf_adaptive_spec.cost.planning import DepthAcceptance, RoundPlanner, level_widths, sibling_ranks
from hf_adaptive_spec.trees import DraftTree
from hf_adaptive_spec.strategies.sage import SageStrategy
from hf_adaptive_spec.strategies.static_tree import candidate_shapes, default_tree_paths
from tiny_models import build_drafter, build_model, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def _strategy(device_type: str = "cpu", **fields) -> SageStrategy:
    device = torch.device("cpu")
    config = SageConfig(**fields).resolve(torch.device(device_type) if device_type == "cpu" else device)
    return SageStrategy(config, 1, device)


def _gpu_like_shapes():
    """Candidates of a sage with the paper's widths (GPU defaults) at a 20-node budget."""
    config = SageConfig(d_min=3, d_max=8, w_min=2.0, w_max=10.0, n_max=20, theta_scale=0.1,
                        expand_rule="cumulative", alpha_source="current_root", verify_cost=True).resolve(
        torch.device("cpu"))
    strategy = SageStrategy(config, 1, torch.device("cpu"))
    return strategy.candidate_shapes()


def _brute_force(shapes, table, alpha_bin, verify, level, round_seconds=0.0):
    """Expected tokens / seconds of every candidate, path by path in Python."""
    rates = []
    for shape in shapes:
        tokens = 1.0
        for path in shape:
            pi = 1.0
            for depth, rank in enumerate(path):
                pi *= float(table[alpha_bin, depth, min(rank, table.shape[2] - 1)])
            tokens += pi
        seconds = round_seconds + sum(level(w) for w in level_widths(shape)) + verify(len(shape) + 1)
        rates.append(tokens / seconds)
    return rates


def test_the_planned_choice_is_the_best_of_the_enumerated_candidates():
    shapes = _gpu_like_shapes()
    depth = max(len(p) for s in shapes for p in s)
    ranks = max(max(p) for s in shapes for p in s) + 1
    acceptance = DepthAcceptance(depth, ranks)
    generator = torch.Generator().manual_seed(0)
    acceptance.total += torch.randint(0, 30, acceptance.total.shape, generator=generator).double()
    acceptance.accepted += (acceptance.total * torch.rand(acceptance.total.shape, generator=generator)).floor()
    curves = {"steep": lambda n: 1.0 + 0.5 * n, "gentle": lambda n: 1.0 + 0.02 * n}
    for (name, verify), level in itertools.product(curves.items(), (lambda w: 0.0, lambda w: 0.1 + 0.01 * w)):
        planner = RoundPlanner(shapes, acceptance, verify, level)  # prices tokens from the counts as they are
        planner.round_seconds = 0.2
        alphas = torch.linspace(0.0, 1.0, 11)
        chosen = planner.choose(alphas)
        table = acceptance.table(optimistic=True)  # what the planner prices with
        for alpha, pick in zip(alphas, chosen.tolist()):
            rates = _brute_force(shapes, table, int(acceptance.bin(alpha[None])), verify, level, 0.2)
            assert rates[pick] == pytest.approx(max(rates), rel=1e-9), name
            assert planner.choose(alpha[None]).tolist() == [pick]  # one row: the host lists choose the same


def test_a_steep_curve_chooses_a_chain_and_a_flat_one_a_wider_tree():
    shapes = _gpu_like_shapes()
    depth = max(len(p) for s in shapes for p in s)
    ranks = max(max(p) for s in shapes for p in s) + 1
    acceptance = DepthAcceptance(depth, ranks)  # the prior: an unsure drafter's lower ranks are accepted too
    unsure = torch.tensor([0.15])
    steep = RoundPlanner(shapes, acceptance, lambda n: 1.0 if n <= 2 else 100.0, lambda w: 0.0)
    chain = shapes[int(steep.choose(unsure))]
    assert all(set(path) == {0} for path in chain) and len(chain) == 1
    flat = RoundPlanner(shapes, acceptance, lambda n: 1.0, lambda w: 0.0)
    wide = shapes[int(flat.choose(unsure))]
    assert max(max(path) for path in wide) > 0  # a node of rank > 0: wider than a chain
    # a drafter level that costs as much as a verification makes deep shapes pay less: a shallower choice
    costly = RoundPlanner(shapes, acceptance, lambda n: 1.0 + 0.05 * n, lambda w: 1.0)
    cheap = RoundPlanner(shapes, acceptance, lambda n: 1.0 + 0.05 * n, lambda w: 0.0)
    confident = torch.tensor([0.95])
    deep = max(len(p) for p in shapes[int(cheap.choose(confident))])
    assert max(len(p) for p in shapes[int(costly.choose(confident))]) < deep


def test_every_chain_depth_and_the_static_tree_are_candidates():
    strategy = _strategy(verify_cost=True)
    shapes = strategy.candidate_shapes()
    config = strategy.config
    for length in range(1, config.depth_cap + 1):  # whatever length the `chain` strategy would draft
        assert tuple((0,) * d for d in range(1, length + 1)) in shapes
        fork = tuple(sorted([(0,) * d for d in range(1, length + 1)] + [(1,)], key=lambda p: (len(p), p)))
        assert (fork in shapes) == (length + 1 <= config.n_max)  # with the second choice at depth 1, in budget
    assert tuple(default_tree_paths(6, 5)) in shapes
    assert candidate_shapes(3, 2) == [((0,),), ((0,), (0, 0))]  # within the node budget
    block = strategy.candidate_shapes(max_depth=4)  # a block drafter of 4: nothing deeper than it drafts
    assert max(len(p) for shape in block for p in shape) == 4 and len(block) < len(shapes)


def _tree(parents, tokens, depths):
    n = len(parents)
    return DraftTree(tokens=torch.tensor([tokens]), parents=torch.tensor([parents]),
                     valid=torch.ones(1, n, dtype=torch.bool), probs=torch.full((1, n), 0.5),
                     cum_probs=torch.full((1, n), 0.5), depths=torch.tensor([depths]),
                     drafter_slot=torch.full((1, n), -1), num_levels=max(depths))


def test_the_acceptance_learned_is_what_the_target_accepted_given_the_parent():
    # root 0 -> a (1, rank 0), b (2, rank 1); a -> c (3, rank 0); c -> d (4, rank 0)
    tree = _tree([-1, 0, 0, 1, 3], [9, 11, 12, 13, 14], [0, 1, 1, 2, 3])
    assert sibling_ranks(tree).tolist() == [[0, 0, 1, 0, 0]]
    # the target's choice after each node: after the root 11 (a right), after a: 99 (c wrong), so d is unverified
    choice = torch.tensor([[11, 99, 0, 14, 0]])
    acceptance = DepthAcceptance(max_depth=4, max_rank=2)
    acceptance.observe(tree, choice, torch.tensor([[0, 1, 1, 1]]), torch.tensor([0.95]))  # accepted: a
    b = 9
    assert acceptance.total[b, 0].tolist() == [1.0, 1.0] and acceptance.accepted[b, 0].tolist() == [1.0, 0.0]
    assert acceptance.total[b, 1].tolist() == [1.0, 0.0] and acceptance.accepted[b, 1].tolist() == [0.0, 0.0]
    assert acceptance.total[b, 2].sum() == 0  # d's parent c was rejected: d says nothing
    table = acceptance.table()
    assert table[b, 0, 0] > table[b, 1, 0]  # depth 2 learned a rejection


def test_one_row_learns_on_host_lists_what_the_tensor_path_learns():
    """`DepthAcceptance.observe` of one CPU row (host lists) == the batched tensor path, on random trees, choices
    and accepted paths (the batch of two rows with the same tree twice takes the tensor path)."""
    gen = torch.Generator().manual_seed(0)
    for case in range(200):
        size = int(torch.randint(2, 14, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)]
        depths = [0] * size
        for node in range(1, size):
            depths[node] = depths[parents[node]] + 1
        tokens = torch.randint(0, 4, (size,), generator=gen).tolist()
        tree = _tree(parents, tokens, depths)
        choice = torch.randint(0, 4, (1, size), generator=gen)
        path = [0]
        while True:  # an accepted path: down to a child that carries the choice after its node
            nxt = [n for n in range(size) if parents[n] == path[-1] and tokens[n] == int(choice[0, path[-1]])]
            if not nxt:
                break
            path.append(nxt[0])
        path_index = torch.tensor([path + [path[-1]] * (6 - len(path))]) if len(path) < 6 else torch.tensor([path])
        alpha = torch.rand(1, generator=gen)
        depth, ranks = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        host, tensors = DepthAcceptance(depth, ranks), DepthAcceptance(depth, ranks)
        host.observe(tree, choice, path_index, alpha)
        double = DraftTree(**{name: torch.cat([getattr(tree, name)] * 2) for name in
                              ("tokens", "parents", "valid", "probs", "cum_probs", "depths", "drafter_slot")},
                           num_levels=tree.num_levels)
        tensors.observe(double, choice.repeat(2, 1), path_index.repeat(2, 1), alpha.repeat(2))
        assert torch.equal(host.total * 2, tensors.total) and torch.equal(host.accepted * 2, tensors.accepted), case
        assert host.rounds == tensors.rounds == 1


@pytest.mark.parametrize("curve", ["steep", "flat"])
def test_planned_rounds_stay_exact_and_follow_the_curve(curve):
    target = build_model("llama")
    drafter = build_drafter("llama", target, "copy")
    inputs = make_inputs("llama", batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    profile = (CostProfile(sizes=[1, 2, 3], seconds=[1.0, 1.0, 100.0]) if curve == "steep"
               else CostProfile(sizes=[1, 64], seconds=[1.0, 1.0]))
    config = SageConfig(d_min=2, d_max=6, w_min=1, w_max=3, n_max=12, verify_cost=True)
    out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          spec_strategy="sage", spec_config=config, return_dict_in_generate=True,
                          spec_calibration=cost.SpecCalibration(profile), spec_runtime={"compact_weights": False})
    assert torch.equal(out.sequences, expected)
    stats = out.spec_stats
    assert len(stats.round_values["candidate"]) == stats.row_rounds
    if curve == "steep":  # one draft node per row and round: the cheapest verification that drafts at all
        assert stats.drafted_tokens <= stats.row_rounds
    else:  # free verification and a copy of the target: deep trees, nearly all accepted
        assert stats.mean_accepted_length > 3.0


def test_sampling_runs_sage_as_written():
    strategy = _strategy(verify_cost=True)
    strategy.sampling = True
    assert not strategy.plans  # a planned tree would be chosen by values a draw must not depend on
    strategy.sampling = False
    assert strategy.plans
    assert not _strategy(verify_cost=True, plan=False).plans
