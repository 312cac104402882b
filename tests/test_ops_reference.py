"""The torch references of the per-round ops, checked against hand-computed cases."""

import math

import pytest
import torch

from hf_adaptive_spec import ops
from hf_adaptive_spec.ops import reference

#        0
#       / \
#      1   2
#     / \    \
#    3   4    5
#    |
#    6
PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])


def test_ancestor_matrix_and_depths():
    ancestors, depths = reference.ancestor_matrix(PARENTS)
    assert depths.tolist() == [[0, 1, 1, 2, 2, 2, 3]]
    expected_rows = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    for node, ancestor_set in expected_rows.items():
        assert set(torch.nonzero(ancestors[0, node]).flatten().tolist()) == ancestor_set


def test_ancestor_matrix_long_chain_and_padding():
    parents = torch.tensor([[-1] + list(range(0, 39)) + [-1, -1]])  # a 40-node chain then 2 padding nodes
    ancestors, depths = reference.ancestor_matrix(parents)
    assert depths[0, :40].tolist() == list(range(40))
    assert depths[0, 40:].tolist() == [0, 0]
    assert bool(ancestors[0, 39, :40].all())


def test_tree_attention_mask_values():
    valid = torch.tensor([[True] * 6 + [False]])
    slot_valid = torch.tensor([[False, True, True]])
    mask, depths = reference.tree_attention_mask(PARENTS, valid, slot_valid, torch.float32)
    assert mask.shape == (1, 1, 7, 10)
    allowed = mask[0, 0] == 0
    assert allowed[:, 0].sum() == 0 and allowed[:, 1:3].all()  # pad slot blocked, real slots open
    assert set(torch.nonzero(allowed[4, 3:]).flatten().tolist()) == {0, 1, 4}
    assert allowed[6, 3:].tolist() == [False] * 6 + [True]  # padding node sees only itself
    assert not allowed[3, 3 + 6]  # nobody sees the padding node
    assert mask.min() == torch.finfo(torch.float32).min
    last_two, _ = reference.tree_attention_mask(PARENTS, valid, slot_valid, torch.bfloat16, num_query=2)
    assert last_two.dtype == torch.bfloat16 and last_two.shape == (1, 1, 2, 10)
    assert torch.equal(last_two[0, 0] == 0, allowed[5:])


def test_greedy_accept_picks_longest_matching_path():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    valid = torch.ones(1, 7, dtype=torch.bool)
    # target: after root -> 11, after node1 -> 14, after node4 -> 99 (bonus)
    choice = torch.tensor([[11, 14, 0, 0, 99, 0, 0]])
    path, length, bonus = reference.greedy_accept(tokens, PARENTS, valid, choice, max_depth=3)
    assert length.tolist() == [2] and bonus.tolist() == [99]
    assert path[0, :3].tolist() == [0, 1, 4]
    # nothing matches: only the root, bonus = the target's choice at the root
    choice = torch.tensor([[42, 0, 0, 0, 0, 0, 0]])
    path, length, bonus = reference.greedy_accept(tokens, PARENTS, valid, choice, max_depth=3)
    assert length.tolist() == [0] and bonus.tolist() == [42] and path[0, 0] == 0


def test_greedy_accept_ignores_padding_and_batches():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]])
    parents = PARENTS.expand(2, -1)
    valid = torch.tensor([[True] * 7, [True, True, True, False, True, True, True]])
    choice = torch.tensor([[11, 13, 0, 16, 0, 0, 5], [21, 23, 0, 0, 0, 0, 0]])
    path, length, bonus = reference.greedy_accept(tokens, parents, valid, choice, max_depth=3)
    assert length.tolist() == [3, 1]  # row 1's node 3 matches but is padding
    assert path[0].tolist() == [0, 1, 3, 6] and bonus[0] == 5
    assert path[1, :2].tolist() == [0, 1] and bonus[1] == 23


def test_compact_kv_matches_recomputed_gather():
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 9, 4)
    original = keys.clone()
    keep = torch.tensor([[0, 3, 4], [1, 2, 2]])
    (out,) = reference.compact_kv_([keys], keep, start=4)
    assert out.shape == (2, 3, 7, 4)
    assert torch.equal(out[:, :, :4], original[:, :, :4])
    for b in range(2):
        assert torch.equal(out[b, :, 4:], original[b, :, 4 + keep[b]])


@pytest.mark.parametrize("k", [2, 10])
def test_sage_confidence_bounds(k):
    vocab = 50
    flat = torch.zeros(1, vocab)
    peaked = torch.full((1, vocab), -1e4)
    peaked[0, 3] = 0
    assert reference.sage_confidence(flat, k).item() == pytest.approx(0.0, abs=1e-6)
    assert reference.sage_confidence(peaked, k).item() == pytest.approx(1.0, abs=1e-6)
    two = torch.full((1, vocab), -1e4)
    two[0, :2] = 0  # two equal tokens: H = log 2
    assert reference.sage_confidence(two, k).item() == pytest.approx(1 - math.log(2) / math.log(k), abs=1e-5)


def test_quantize_int8_error_bound():
    torch.manual_seed(0)
    keys = torch.randn(2, 4, 11, 16) * 3
    quantized, scale = reference.quantize_int8(keys)
    assert quantized.dtype == torch.int8 and scale.shape == (2, 4, 11, 1)
    error = (quantized.float() * scale - keys).abs()
    assert bool((error <= scale / 2 + 1e-6).all())


def test_visual_selection_finds_the_attended_tokens():
    torch.manual_seed(0)
    batch, heads, tokens, dim = 2, 4, 30, 16
    keys = torch.randn(batch, 2, tokens, dim) * 0.1
    query = torch.zeros(batch, heads, dim)
    targets = [[3, 17, 25], [0, 8, 29]]
    for b, chosen in enumerate(targets):
        direction = torch.randn(dim)
        query[b] = direction
        for t in chosen:
            keys[b, :, t] = direction  # these keys align with the query in every head
    quantized, scale = reference.quantize_int8(keys)
    scores = reference.visual_scores(query, quantized, scale)
    assert torch.allclose(scores.sum(-1), torch.ones(batch))
    per_layer = torch.stack([scores, scores + 0.01 * torch.rand_like(scores)])
    picked = reference.visual_vote(per_layer, per_layer=3, keep=3)
    for b, chosen in enumerate(targets):
        assert set(picked[b].tolist()) == set(chosen)


def test_dispatch_keeps_cpu_tensors_on_torch(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("triton must not be imported for CPU tensors")

    monkeypatch.setattr(ops, "_triton_module", boom)
    mask, _ = ops.tree_attention_mask(PARENTS, torch.ones(1, 7, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool),
                                      torch.float32)
    assert mask.shape == (1, 1, 7, 9)
    with pytest.raises(ValueError, match="valid backends"):
        with ops.use_backend("cuda-magic"):
            pass
