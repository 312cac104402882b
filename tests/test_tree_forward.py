"""One tree forward == each root-to-node path run on its own; a compacted cache == recomputation.

The references run the whole sequence (prompt, image, path) from scratch
through the model's own forward, with the model computing its own
positions, so the tree mask, the explicit (m)RoPE positions and the cache
compaction are all checked against the simplest possible path.
"""

import pytest
import torch

from hf_adaptive_spec.drafters.independent import IndependentDrafter
from tiny_models import ARCHS, build_model, make_inputs, split_rows

#        0 (root, a new token)
#       / \
#      1   2
#     / \   \
#    3   4   5
#    |
#    6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def _prefilled_runner(model, inputs):
    drafter = IndependentDrafter(model)
    raw = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    drafter.prefill(inputs["input_ids"], inputs.get("attention_mask"), raw)
    return drafter.runner


def _scratch_logits(model, row_inputs, extra_tokens):
    """Last-position logits of the row's real prompt + `extra_tokens`, computed from scratch."""
    inputs = dict(row_inputs)
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if mask is not None:  # drop left padding: the reference sees the bare row
        keep = mask[0].bool()
        ids = ids[:, keep]
        if inputs.get("mm_token_type_ids") is not None:
            inputs["mm_token_type_ids"] = inputs["mm_token_type_ids"][:, keep]
    extra = torch.tensor([extra_tokens], dtype=torch.long)
    inputs["input_ids"] = torch.cat([ids, extra], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if inputs.get("mm_token_type_ids") is not None:
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1
        )
    return model(**inputs).logits[0, -1]


def _random_tree(batch, generator):
    tokens = torch.randint(3, 90, (batch, len(PARENTS)), generator=generator)
    parents = torch.tensor([PARENTS] * batch)
    valid = torch.ones(batch, len(PARENTS), dtype=torch.bool)
    return tokens, parents, valid


def _path(node, tokens_row):
    path = []
    while node >= 0:
        path.append(int(tokens_row[node]))
        node = PARENTS[node]
    return path[::-1]


@pytest.mark.parametrize(
    "arch,attn", [(arch, "sdpa") for arch in ARCHS] + [("llama", "eager"), ("qwen2_vl", "eager")]
)
def test_tree_forward_equals_per_path_forward(arch, attn):
    model = build_model(arch, attn_implementation=attn)
    inputs = make_inputs(arch, batch_size=2)
    rows = split_rows(arch, inputs)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        runner = _prefilled_runner(model, inputs)
        tokens, parents, valid = _random_tree(2, generator)
        logits = runner.forward(tokens, parents, valid).logits  # (B, N, V)
        for b in range(2):
            for node in range(len(PARENTS)):
                expected = _scratch_logits(model, rows[b], _path(node, tokens[b]))
                torch.testing.assert_close(logits[b, node], expected, atol=2e-5, rtol=1e-4)


def test_a_plain_causal_mask_would_fail_this_test():
    """The per-path reference can tell a tree mask from a causal one (the test has power)."""
    model = build_model("llama")
    inputs = make_inputs("llama", batch_size=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        runner = _prefilled_runner(model, inputs)
        tokens, _, valid = _random_tree(1, generator)
        chain_parents = torch.arange(len(PARENTS))[None] - 1  # every node sees all earlier nodes
        logits = runner.forward(tokens, chain_parents, valid).logits
        expected = _scratch_logits(model, split_rows("llama", inputs)[0], _path(4, tokens[0]))
        assert (logits[0, 4] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_compacted_cache_equals_recomputation(arch):
    model = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    rows = split_rows(arch, inputs)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        runner = _prefilled_runner(model, inputs)
        history = [[], []]
        # rounds with different accepted paths per row, so rows get different holes; the second keeps the
        # first tail slots in order in every row (compaction then moves nothing)
        for accepted in ([[0, 1, 3, 6], [0, 2]], [[0, 1], [0, 1]], [[0, 2, 5], [0, 1, 4]]):
            tokens, parents, valid = _random_tree(2, generator)
            runner.forward(tokens, parents, valid)
            width = max(len(a) for a in accepted)
            keep = torch.tensor([a + [a[-1]] * (width - len(a)) for a in accepted])
            keep_valid = torch.tensor([[i < len(a) for i in range(width)] for a in accepted])
            runner.commit(keep, keep_valid)
            for b in range(2):
                history[b] += [int(tokens[b, i]) for i in accepted[b]]
        next_tokens = torch.randint(3, 90, (2, 1), generator=generator)
        single = torch.tensor([[-1], [-1]])
        logits = runner.forward(next_tokens, single, torch.ones(2, 1, dtype=torch.bool)).logits
        for b in range(2):
            expected = _scratch_logits(model, rows[b], history[b] + [int(next_tokens[b, 0])])
            torch.testing.assert_close(logits[b, 0], expected, atol=2e-5, rtol=1e-4)


def test_appending_in_place_keeps_the_cache_that_concatenation_builds():
    """Rounds append into spare slots of a buffer (`InPlaceAppend`) instead of concatenating the whole cache:
    through forwards of trees, commits that keep a chain prefix or gather tree slots, and rows leaving the
    batch, logits and every cache slot equal a runner that concatenates, and the buffer is not copied while it
    has room; `close` gives the layers their stock update back."""
    from hf_adaptive_spec.adapters.runner import InPlaceAppend

    model = build_model("llama", num_layers=2, hidden_size=64)
    inputs = make_inputs("llama", batch_size=3, seed=5)
    appending, stock = _prefilled_runner(model, inputs), _prefilled_runner(model, inputs)
    stock.close()
    assert appending.appending and all(isinstance(layer.update, InPlaceAppend) for layer in appending.cache.layers)
    assert not any("update" in layer.__dict__ for layer in stock.cache.layers)
    generator = torch.Generator().manual_seed(0)
    parents = torch.tensor([PARENTS] * 3)
    pointers = []
    for step in range(6):
        rows = appending.slot_valid.shape[0]
        tokens = torch.randint(0, 50, (rows, len(PARENTS)), generator=generator)
        valid = torch.ones(rows, len(PARENTS), dtype=torch.bool)
        valid[0, 4:] = False
        with torch.no_grad():
            got = appending.forward(tokens, parents[:rows], valid).logits
            expected = stock.forward(tokens, parents[:rows], valid).logits
        assert torch.equal(got, expected)
        if step % 2:  # gather a tree path per row
            keep = torch.tensor([[0, 1, 3, 6], [0, 2, 5, 5], [0, 1, 4, 4]])[:rows]
            keep_valid = torch.tensor([[True] * 4, [True, True, True, False], [True, True, True, False]])[:rows]
        else:  # a chain prefix: the slots stay where they are
            keep, keep_valid = torch.arange(2).expand(rows, 2), torch.ones(rows, 2, dtype=torch.bool)
        for runner in (appending, stock):
            runner.commit(keep, keep_valid)
        for mine, theirs in zip(appending.cache.layers, stock.cache.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        pointers.append(appending.cache.layers[0].keys.data_ptr())
        if step == 3:  # a row leaves the batch: its tensors are new, the next update starts a new buffer
            for runner in (appending, stock):
                runner.keep_rows(torch.tensor([0, 2]))
    assert pointers[1] == pointers[2] == pointers[3]  # appended in place (spare capacity >= 64 slots)
    appending.close()
    assert not any("update" in layer.__dict__ for layer in appending.cache.layers)
