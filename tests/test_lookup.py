"""Context lookup: the suffix match against a brute-force reference, the chain merged into a tree, its
calibration, and exact greedy output with the lookup branch on."""

import random

import pytest
import torch
from tiny_models import build_model, make_inputs

from hf_adaptive_spec.cost import AcceptanceCalibrator, CostModel, CostProfile, LookupCalibrator
from hf_adaptive_spec.drafters.laspec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.trees.branches import add_chain, context_lookup
from hf_adaptive_spec.trees import DraftTree


def _reference(row: list, max_ngram: int, num_tokens: int, min_ngram: int = 1):
    """The latest earlier occurrence of the longest suffix (n from max_ngram down), by brute force."""
    end = len(row)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > end - 1:
            continue
        suffix = row[end - n:]
        for j in range(end - n - 1, -1, -1):
            if row[j:j + n] == suffix:
                return row[j + n:j + n + num_tokens], n
    return [], 0


@pytest.mark.parametrize("seed", range(6))
def test_context_lookup_matches_brute_force(seed):
    rng = random.Random(seed)
    batch, width, pad = 4, 40, 99
    rows, starts = [], []
    for _ in range(batch):
        length = rng.randrange(2, 30)
        rows.append([rng.randrange(4) for _ in range(length)])  # 4 symbols: many repeats
        starts.append(rng.randrange(0, 6))  # left padding
    ids = torch.full((batch, width), pad)
    for b, (row, start) in enumerate(zip(rows, starts)):
        ids[b, start:start + len(row)] = torch.tensor(row)
    start = torch.tensor(starts)
    lengths = start + torch.tensor([len(r) for r in rows])
    for max_ngram, min_ngram in ((4, 1), (3, 2), (1, 1)):
        tokens, valid, match = context_lookup(ids, lengths, start, max_ngram, 5, min_ngram)
        for b, row in enumerate(rows):
            expected, n = _reference(row, max_ngram, 5, min_ngram)
            assert int(match[b]) == n
            assert tokens[b][valid[b]].tolist() == expected
            assert valid[b].tolist() == [i < len(expected) for i in range(5)]  # a prefix


def test_context_lookup_ignores_padding_and_needs_a_real_earlier_occurrence():
    ids = torch.tensor([[7, 7, 7, 1, 2, 3, 7, 7]])  # three pads (7) then 1 2 3 7 7: the suffix "7 7" is only in padding
    tokens, valid, match = context_lookup(ids, torch.tensor([8]), torch.tensor([3]), 2, 3)
    # "7 7": no earlier real occurrence; "7": only the one at position 6 (inside the row, before the end)
    assert int(match[0]) == 1 and tokens[0][valid[0]].tolist() == [7]
    with pytest.raises(ValueError, match="min_ngram"):
        context_lookup(ids, torch.tensor([8]), torch.tensor([0]), 2, 3, min_ngram=3)


def _tree(tokens, parents, probs):
    parents = torch.tensor([parents])
    depths = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depths[0, i] = depths[0, parents[0, i]] + 1
    probs = torch.tensor([probs])
    return DraftTree(tokens=torch.tensor([tokens]), parents=parents, valid=torch.ones_like(parents, dtype=torch.bool),
                     probs=probs, cum_probs=probs, depths=depths, drafter_slot=torch.full_like(parents, -1),
                     num_levels=int(depths.max()))


def test_add_chain_shares_existing_nodes_and_appends_the_rest():
    # root(5) -> 10 -> 11, root -> 12
    tree = _tree([5, 10, 12, 11], [-1, 0, 0, 1], [1.0, 0.6, 0.3, 0.5])
    chain = torch.tensor([[10, 13, 14, 15]])
    valid = torch.tensor([[True, True, True, False]])
    out = add_chain(tree, chain, valid, torch.tensor([3]))
    # 10 is shared (node 1); 13 and 14 are new, under 1 and then under 13
    assert out.tokens[0].tolist() == [5, 10, 12, 11, 13, 14]
    assert out.parents[0].tolist() == [-1, 0, 0, 1, 1, 4]
    assert out.depths[0].tolist() == [0, 1, 1, 2, 2, 3] and out.num_levels == 3
    assert out.lookup[0].tolist() == [0, 3, 0, 0, 3, 3]  # the shared node is on the chain too
    assert out.probs[0, 4:].tolist() == [0.0, 0.0]
    kept = out.subset(torch.tensor([[True, True, False, False, True, True]]))
    assert kept.tokens[0].tolist() == [5, 10, 13, 14] and kept.lookup[0].tolist() == [0, 3, 3, 3]
    assert kept.parents[0].tolist() == [-1, 0, 1, 2]
    # a chain the tree already holds adds nothing
    same = add_chain(tree, torch.tensor([[10, 11]]), torch.ones(1, 2, dtype=torch.bool), torch.tensor([2]))
    assert torch.equal(same.tokens, tree.tokens) and same.lookup[0].tolist() == [0, 2, 0, 2]


def test_add_chain_per_row_in_a_batch():
    base = _tree([5, 10], [-1, 0], [1.0, 0.9])
    tree = DraftTree(**{name: (torch.cat([getattr(base, name)] * 2) if torch.is_tensor(getattr(base, name))
                               else getattr(base, name)) for name in base.__dataclass_fields__})
    chain = torch.tensor([[10, 20], [30, 31]])
    valid = torch.tensor([[True, True], [True, False]])
    out = add_chain(tree, chain, valid, torch.tensor([2, 1]))
    assert out.tokens.shape == (2, 4)
    assert out.valid.tolist() == [[True, True, False, True], [True, True, True, False]]
    assert out.parents[0].tolist() == [-1, 0, -1, 1] and out.parents[1].tolist() == [-1, 0, 0, -1]
    assert out.lookup.tolist() == [[0, 2, 0, 2], [0, 0, 1, 0]]


def test_lookup_nodes_are_priced_by_their_own_acceptance():
    tree = add_chain(_tree([5, 10], [-1, 0], [1.0, 0.9]), torch.tensor([[20, 21]]), torch.ones(1, 2, dtype=torch.bool),
                     torch.tensor([2]))  # nodes: root, 10 (drafter), 20, 21 (lookup, match 2)
    calibrator, lookup = AcceptanceCalibrator(), LookupCalibrator()
    before = calibrator.total.clone()
    choice = torch.tensor([[20, 0, 21, 0]])  # the target takes 20 after the root, 21 after 20
    calibrator.observe(tree, choice)
    lookup.observe(tree, choice)
    assert float((calibrator.total - before).sum()) == 1.0  # only the drafter node
    assert float(lookup(torch.tensor([2]), torch.tensor([False]))) == pytest.approx((1.0 + 2.0) / (2.0 + 2.0))
    assert float(lookup(torch.tensor([2]), torch.tensor([True]))) == 0.5  # no agreed node seen: the prior
    model = CostModel(CostProfile(sizes=[1, 8], seconds=[1.0, 1.0]), max_tokens=8, device="cpu")
    for _ in range(10):
        model.observe(tree, choice, round_seconds=1.0, tokens=torch.tensor(3))
    keep, n = model.prune(tree)
    assert int(n) == 3 and bool(keep.all())  # flat curve: all pay
    steep = CostModel(CostProfile(sizes=[1, 2, 3], seconds=[1.0, 1.0, 50.0]), max_tokens=8, device="cpu")
    steep.seconds_per_token = torch.tensor(1.0)
    for _ in range(20):  # lookup nodes always right, the drafter's node always wrong
        steep.lookup_calibrator.observe(tree, choice)
        steep.calibrator.observe(tree, choice)
    keep, n = steep.prune(tree)
    assert int(n) == 1 and keep[0].tolist() == [True, False, True, False]  # the one node that pays is the lookup


def _drafter(target, seed=0):
    torch.manual_seed(seed)
    return LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()


def test_sampling_has_no_lookup_branch(monkeypatch):
    from hf_adaptive_spec.drafters import block as block_module

    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=1)
    trees = []
    original = block_module.BlockDrafter.draft

    def record(self, *args, **kwargs):
        tree = original(self, *args, **kwargs)
        trees.append(tree)
        return tree

    monkeypatch.setattr(block_module.BlockDrafter, "draft", record)
    target.generate(**inputs, max_new_tokens=12, do_sample=True, assistant_model=_drafter(target),
                    spec_strategy="laspec")
    assert trees and all(tree.lookup is None for tree in trees)


def test_a_node_both_propose_is_priced_by_the_agreement_rate():
    # drafter: root -> 10 (p 0.3), root -> 12 (p 0.6); the lookup chain 10, 11 shares node 10
    tree = add_chain(_tree([5, 10, 12], [-1, 0, 0], [1.0, 0.3, 0.6]), torch.tensor([[10, 11]]),
                     torch.ones(1, 2, dtype=torch.bool), torch.tensor([3]))
    assert tree.lookup[0].tolist() == [0, 3, 0, 3] and tree.probs[0, 1] > 0  # node 1: agreed
    model = CostModel(CostProfile(sizes=[1, 2, 3], seconds=[1.0, 1.0, 50.0]), max_tokens=8, device="cpu")
    model.seconds_per_token = torch.tensor(1.0)
    keep, n = model.prune(tree)
    assert int(n) == 1 and keep[0].tolist() == [True, False, True, False]  # priors: 12's 0.6 beats 0.5
    choice = torch.tensor([[10, 11, 0, 0]])  # the target takes 10, then 11
    for _ in range(10):
        model.lookup_calibrator.observe(tree, choice)
    assert float(model.lookup_calibrator(torch.tensor([3]), torch.tensor([True]))) > 0.8
    keep, n = model.prune(tree)
    assert int(n) == 1 and keep[0].tolist() == [True, True, False, False]  # the agreed node now wins
