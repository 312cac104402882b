"""The host (one CPU row) tree ops equal the torch references exactly, and `ops` dispatches batch 1 to them."""

import random

import pytest
import torch

from hf_adaptive_spec import ops
from hf_adaptive_spec.ops import host, reference


def _random_tree(rng, num_nodes, padding):
    """A (1, N) tree in layout order: parents before children, duplicate sibling tokens now and then, padding
    nodes (valid False, parent -1) mixed in, and sometimes a stray parentless node."""
    parents, tokens, valid = [-1], [rng.randrange(5)], [True]
    for node in range(1, num_nodes):
        if padding and rng.random() < 0.2:
            parents.append(-1); tokens.append(0); valid.append(False)
            continue
        real = [i for i in range(node) if valid[i]]
        parents.append(-1 if rng.random() < 0.03 else rng.choice(real))
        tokens.append(rng.randrange(4))
        valid.append(True)
    as_row = lambda values, dtype: torch.tensor([values], dtype=dtype)
    return as_row(tokens, torch.long), as_row(parents, torch.long), as_row(valid, torch.bool)


@pytest.mark.parametrize("padding", [False, True])
def test_host_ops_equal_the_references(padding):
    rng = random.Random(0)
    for _ in range(300):
        num_nodes = rng.randint(1, 24)
        tokens, parents, valid = _random_tree(rng, num_nodes, padding)
        for got, want in zip(host.ancestor_matrix(parents), reference.ancestor_matrix(parents)):
            assert torch.equal(got, want)
        slots = torch.rand(1, rng.randint(0, 6), generator=torch.Generator().manual_seed(num_nodes)) < 0.8
        num_query = rng.randint(1, num_nodes)
        for dtype in (torch.float32, torch.bfloat16):
            got = host.tree_attention_mask(parents, valid, slots, dtype, num_query=num_query)
            want = reference.tree_attention_mask(parents, valid, slots, dtype, num_query=num_query)
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
        # the target's choice matches a child's token often enough for deep accepted paths
        choice = torch.tensor([[rng.randrange(4) for _ in range(num_nodes)]])
        max_depth = int(reference.ancestor_matrix(parents)[1].max())
        got = host.greedy_accept(tokens, parents, valid, choice, max_depth)
        want = reference.greedy_accept(tokens, parents, valid, choice, max_depth)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)


def test_ops_dispatch_one_cpu_row_to_the_host_versions(monkeypatch):
    calls = []
    monkeypatch.setattr(host, "greedy_accept", lambda *args: calls.append(args) or reference.greedy_accept(*args))
    tokens, parents = torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 1]])
    valid, choice = torch.ones(1, 3, dtype=torch.bool), torch.tensor([[6, 7, 8]])
    ops.greedy_accept(tokens, parents, valid, choice, 2)
    assert len(calls) == 1
    ops.greedy_accept(tokens.expand(2, -1), parents.expand(2, -1), valid.expand(2, -1), choice.expand(2, -1), 2)
    with ops.use_backend("torch"):
        ops.greedy_accept(tokens, parents, valid, choice, 2)
    assert len(calls) == 1  # batch 2 and the forced torch backend take the reference


def test_host_ops_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="one CPU row"):
        host.ancestor_matrix(torch.tensor([[-1, 0], [-1, 0]]))
    with pytest.raises(ValueError, match="parent to come before"):
        host.ancestor_matrix(torch.tensor([[-1, 2, 0]]))
