"""The block drafter's host-built trees (batch 1, greedy, budget strategy) equal the tensor path's, field by field."""

import random

import pytest
import torch

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.cost import Calibration, CostModel, CostProfile
from hf_adaptive_spec.drafters.datastore import TokenDatastore
from hf_adaptive_spec.drafters import block as block_module
from hf_adaptive_spec.trees import host as host_tree
from hf_adaptive_spec.trees.branches import MAX_LOOKUP_CODE, context_lookup
from hf_adaptive_spec.strategies import resolve_config
from hf_adaptive_spec.cost.planning import DepthAcceptance, RoundPlanner
from hf_adaptive_spec.strategies.chain import ChainStrategy
from hf_adaptive_spec.strategies.laspec import LaSpecStrategy
from hf_adaptive_spec.strategies.sage import SageStrategy
from hf_adaptive_spec.strategies.static_tree import StaticTreeStrategy, default_tree_paths
from tiny_models import build_model, make_inputs

FIELDS = ("tokens", "parents", "valid", "probs", "cum_probs", "depths", "drafter_slot", "lookup")


@pytest.fixture(scope="module")
def pair():
    target = build_model("llama")
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval().attach_target(target)
    return target, drafter


def _scores(gen, depth, vocab, kind):
    if kind == "random":
        return torch.randn(1, depth, vocab, generator=gen) * 3
    if kind == "ties":  # few distinct logits: many equal probabilities and equal path products
        return torch.randint(0, 3, (1, depth, vocab), generator=gen).float()
    logits = torch.full((1, depth, vocab), -10.0)  # one sure token per depth, the rest tied near 0
    logits[0, torch.arange(depth), torch.randint(0, vocab, (depth,), generator=gen)] = 10.0
    return logits


def _draw(state, strategy, scores, max_depth, context, host):
    state.host_trees = host
    state.block_scores = lambda depth: (scores[:, :depth], None)
    return state.draft(strategy, None, torch.tensor([max_depth]), committed=context)


def _spy(monkeypatch, name: str) -> list:
    """The calls of `trees.host.<name>` (a host-backend builder), counted."""
    built = []
    original = getattr(host_tree, name)
    monkeypatch.setattr(host_tree, name, lambda *a: built.append(1) or original(*a))
    return built


def _assert_same_tree(a_tree, b_tree, case) -> None:
    for name in FIELDS:
        a, b = getattr(a_tree, name), getattr(b_tree, name)
        assert (a is None) == (b is None), (case, name)
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), (case, name, a, b)
    assert a_tree.num_levels == b_tree.num_levels


@pytest.mark.parametrize("kind", ["random", "ties", "sure"])
def test_host_tree_equals_tensor_tree(pair, kind, monkeypatch):
    target, drafter = pair
    built = _spy(monkeypatch, "budget_tree")
    vocab = drafter.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(2)
    kept_nodes = []
    for case in range(60):
        block_size = rng.choice([1, 2, 4])
        lookup = rng.choice([0, 1, 3, 4])
        state = block_module.BlockDrafter(drafter, target, block_size=block_size, context_lookup=lookup,
                                          lookup_tokens=rng.choice([None, 2, 8]))
        config = resolve_config("laspec", {"top_k": rng.choice([1, 2, 3, 4]), "n_max": rng.choice([1, 3, 6, 16, 40])},
                                torch.device("cpu"))
        strategy = LaSpecStrategy(config, 1, torch.device("cpu"))
        scores = _scores(gen, block_size, vocab, kind)
        store = None
        if rng.random() < 0.5:  # a datastore of short random sequences over the row's few token ids
            sequences = [torch.randint(0, 6, (rng.randint(1, 12),), generator=gen).tolist() for _ in range(12)]
            sequences.append(scores[0].argmax(-1).tolist())  # sometimes agreeing with the drafter
            store = TokenDatastore.from_sequences(sequences, min_ngram=1, max_ngram=rng.choice([2, 4]))
        state.datastore, state.datastore_tokens = store, rng.choice([state.lookup_tokens, 3])
        # a committed row that repeats itself, behind left padding, with the sure tokens in it now and then
        length, start = rng.randint(2, 40), rng.randint(0, 3)
        ids = torch.zeros(1, 64, dtype=torch.long)
        ids[0, start:start + length] = torch.randint(0, 6, (length,), generator=gen)
        if kind == "sure" and rng.random() < 0.5:
            ids[0, start + length - 1] = scores[0, 0].argmax()
        if rng.random() < 0.5:  # the row repeats [root, the drafter's top tokens]: lookup nodes the drafter agrees with
            period = torch.cat([scores[0].argmax(-1), ids[0, start + length - 1:start + length]])  # ends on the root
            repeats = period.repeat(length // len(period) + 1)[-length:]
            ids[0, start:start + length] = repeats
        state.root = ids[:, start + length - 1].clone()
        context = (ids, torch.tensor([start + length]), torch.tensor([start]))
        max_depth = rng.choice([0, 1, block_size, block_size + 3])
        tensor_tree = _draw(state, strategy, scores, max_depth, context, host=False)
        host = _draw(state, strategy, scores, max_depth, context, host=True)
        _assert_same_tree(tensor_tree, host, case)
        assert host.draft_probs is None
        # the cost rule and the subset it keeps: host lists == tensors, with random calibration and costs
        cost = _random_cost_model(rng, gen)
        (keep_a, n_a), (keep_b, n_b) = cost.prune(tensor_tree), cost.prune(host)
        assert torch.equal(keep_a, keep_b) and int(n_a) == int(n_b), (case, keep_a, keep_b)
        kept_nodes.append(int(n_a))
        _assert_same_tree(tensor_tree.subset(keep_a), host.subset(keep_b), case)
    assert len(built) > 30  # the host path ran (max_depth 0 keeps the tensor path)
    assert 0 < max(kept_nodes) and min(kept_nodes) < max(kept_nodes)  # the rule kept some nodes, and not always as many


def _shape_strategy(rng, block_size):
    """A chain of random length, a random static tree, or a planned sage round with a random candidate."""
    cpu = torch.device("cpu")
    kind = rng.choice(["chain", "static_tree", "sage"])
    if kind == "chain":
        strategy = ChainStrategy(resolve_config("chain", {}, cpu), 1, cpu)
        strategy.length = torch.tensor([rng.randint(1, 8)])
        return strategy
    if kind == "static_tree":
        paths = default_tree_paths(rng.randint(1, 12), rng.randint(1, 6), rank_acceptance=(0.7, 0.2, 0.08))
        return StaticTreeStrategy(resolve_config("static_tree", {"paths": paths}, cpu), 1, cpu)
    strategy = SageStrategy(resolve_config("sage", {"n_max": rng.choice([3, 8, 20])}, cpu), 1, cpu)
    shapes = strategy.candidate_shapes(block_size + rng.choice([0, 2]))
    planner = RoundPlanner(shapes, DepthAcceptance(max(map(len, (p for s in shapes for p in s))), 6),
                           lambda nodes: 0.01 * nodes, lambda width: 0.0)
    choice = rng.randrange(len(shapes))
    planner.choose = lambda alpha: torch.tensor([choice])
    strategy.plan_with(planner)
    return strategy


@pytest.mark.parametrize("kind", ["random", "ties", "sure"])
def test_host_shape_tree_equals_tensor_tree(pair, kind, monkeypatch):
    """Shape strategies (chain, static tree, planned sage) at batch 1: the host-built tree == the tensor path's,
    with depth cuts, lookup chains and shapes deeper or wider than the block's candidates."""
    target, drafter = pair
    built = _spy(monkeypatch, "shape_tree")
    vocab = drafter.config.vocab_size
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(5)
    for case in range(90):
        block_size = rng.choice([1, 2, 4])
        state = block_module.BlockDrafter(drafter, target, block_size=block_size,
                                          context_lookup=rng.choice([0, 0, 2, 4]), lookup_tokens=rng.choice([None, 3]))
        strategy = _shape_strategy(rng, block_size)
        scores = _scores(gen, block_size, vocab, kind)
        length = rng.randint(2, 30)
        ids = torch.randint(0, 6, (1, length), generator=gen)
        state.root = ids[:, -1].clone()
        context = (ids, torch.tensor([length]), torch.tensor([0]))
        max_depth = rng.choice([0, 1, block_size, block_size + 3])
        tensor_tree = _draw(state, strategy, scores, max_depth, context, host=False)
        host = _draw(state, strategy, scores, max_depth, context, host=True)
        _assert_same_tree(tensor_tree, host, (case, type(strategy).__name__))
        assert host.draft_probs is None
    assert len(built) > 60  # the host path ran (all but the few cases whose ranks the candidates lack)


def _random_cost_model(rng, gen):
    sizes = [1, 2, 4, 8, 16]
    seconds = sorted(rng.uniform(0.02, 0.2) for _ in sizes)
    calibration = Calibration.fresh()
    calibration.acceptance.accepted = torch.rand(20, generator=gen) * 5
    calibration.acceptance.total = calibration.acceptance.accepted + torch.rand(20, generator=gen) * 5 + 0.1
    calibration.lookup.accepted = torch.rand(2, MAX_LOOKUP_CODE + 1, generator=gen) * 5
    calibration.lookup.total = calibration.lookup.accepted + torch.rand(2, MAX_LOOKUP_CODE + 1, generator=gen) * 5 + 0.1
    cost = CostModel(CostProfile(sizes=sizes, seconds=seconds), max_tokens=64, device="cpu", calibration=calibration)
    cost.scale = rng.uniform(0.5, 2.0)
    cost.seconds_per_token = torch.tensor(rng.uniform(0.01, 0.2))
    return cost


def test_latest_match_equals_context_lookup():
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(300):
        length, start = rng.randint(1, 50), rng.randint(0, 4)
        ids = torch.full((1, 60), 99, dtype=torch.long)
        ids[0, start:start + length] = torch.randint(0, rng.choice([2, 4, 30]), (length,), generator=gen)
        max_ngram, num_tokens = rng.randint(1, 5), rng.randint(1, 6)
        tokens, valid, match = context_lookup(ids, torch.tensor([start + length]), torch.tensor([start]),
                                              max_ngram, num_tokens)
        chain, n = host_tree.latest_match(ids[0, start:start + length].tolist(), max_ngram, num_tokens)
        assert n == int(match) and chain == tokens[0][valid[0]].tolist()


@pytest.mark.parametrize("verify_cost", [False, True])
def test_generate_builds_host_trees_and_stays_exact(verify_cost, monkeypatch):
    """Batch 1 greedy laspec output == plain greedy, with every drafted round's tree built (all but a last,
    depth-cut one) and, with the cost rule, priced on the host; batch 2 keeps the tensor path."""
    target = build_model("llama")
    torch.manual_seed(3)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    built = _spy(monkeypatch, "budget_tree")
    priced = []
    original_prune = CostModel._prune_host
    monkeypatch.setattr(CostModel, "_prune_host", lambda self, *a: priced.append(1) or original_prune(self, *a))
    for batch in (1, 2):
        inputs = make_inputs("llama", batch_size=batch)
        expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
        before, priced_before = len(built), len(priced)
        out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              spec_strategy="laspec", spec_config={"verify_cost": verify_cost}, spec_runtime={"retire_rows": False},
                              return_dict_in_generate=True)  # (both rows to the end: a lone row would go host)
        assert torch.equal(out.sequences, expected)
        drafted = out.spec_stats.rounds - out.spec_stats.paused_rounds
        if batch == 1:
            assert len(built) - before >= drafted - 1 > 2  # all but a last, depth-cut round
            assert len(priced) == (drafted if verify_cost else 0)  # one CPU row: every round priced on lists
        else:
            assert len(built) == before and len(priced) == priced_before  # two rows: the tensor path


@pytest.mark.parametrize("strategy", ["chain", "static_tree", "sage"])
def test_generate_builds_host_shape_trees_and_stays_exact(strategy, monkeypatch):
    """Batch 1 greedy output of a shape strategy on a block drafter == plain greedy, its drafted rounds' trees
    built on the host; under sampling (and with a logits processor) the tensor path runs."""
    target = build_model("llama")
    torch.manual_seed(3)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    built = _spy(monkeypatch, "shape_tree")
    inputs = make_inputs("llama", batch_size=1)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          spec_strategy=strategy, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    drafted = out.spec_stats.rounds - out.spec_stats.paused_rounds
    assert len(built) == drafted > 2
    before = len(built)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False, repetition_penalty=1.3)
    out = target.generate(**inputs, max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                          assistant_model=drafter, spec_strategy=strategy)
    assert torch.equal(out, expected) and len(built) == before
    target.generate(**inputs, max_new_tokens=8, do_sample=True, assistant_model=drafter, spec_strategy=strategy)
    assert len(built) == before
